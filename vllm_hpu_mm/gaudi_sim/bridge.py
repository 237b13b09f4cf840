"""The bridge's runtime settings (``habana_frameworks.torch.internal.
bridge_config``), simulated: ``env_setting`` and compile-only mode."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

COMPILE_ONLY_SETTING = "PT_COMPILE_ONLY_MODE"
# Tensor methods that hand a tensor's values to the host.
VALUE_READS = (
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__array__",
)


class CompileOnlyRead(RuntimeError):
    """A tensor's value was read while the bridge only compiles."""


class SimBridgeConfig:
    """``habana_frameworks.torch.internal.bridge_config``: ``env_setting(name,
    value)`` changes a bridge setting for the body of a ``with``; a setting the
    bridge does not know raises KeyError on entry (the official plugin probes
    ``PT_COMPILE_ONLY_MODE`` that way and falls back on older software,
    vllm-gaudi ``hpu_model_runner.py`` warmup).

    Compile-only mode compiles recipes without executing them, so no tensor
    holds computed values inside it: vllm-gaudi's own notes say ``clone()``
    "does not copy data in compile-only mode" (``ops`` split weights), that
    shapes "need to be predetermined, not depend on the tensor value itself"
    (its Qwen2.5-VL ``rot_pos_emb``), and it runs multimodal warmup outside the
    mode for "data-dependent output shapes that must be materialized"
    (``VLLM_MM_WARMUP_OUTSIDE_COMPILE_ONLY``). On the CPU every tensor stands
    for a device tensor, so while the mode is on every read of a value
    (``VALUE_READS``) raises ``CompileOnlyRead``, except inside torch's
    compiler (``_COMPILER_FRAMES``); ``entered`` counts the
    times warmup switched it on."""

    def __init__(self, known: tuple[str, ...] = (COMPILE_ONLY_SETTING,)) -> None:
        self.known = known
        self.settings: dict[str, object] = {}
        self.entered = 0

    @contextlib.contextmanager
    def env_setting(self, name: str, value: object) -> Iterator[None]:
        if name not in self.known:
            raise KeyError(name)
        before = self.settings.get(name)
        self.settings[name] = value
        guard = (
            _reject_value_reads()
            if name == COMPILE_ONLY_SETTING and value
            else contextlib.nullcontext()
        )
        self.entered += 1
        try:
            with guard:
                yield
        finally:
            self.settings[name] = before


# Frames of torch's compiler stack: a value read there is the compiler folding a
# constant it created itself (Inductor's ``scalar_tensor``), compile-time work
# that stands for hpu_backend's own, not a read of a computed device tensor.
_COMPILER_FRAMES = (
    f"{os.sep}torch{os.sep}_inductor{os.sep}",
    f"{os.sep}torch{os.sep}_functorch{os.sep}",
)


def _in_the_compiler() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _COMPILER_FRAMES):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@contextlib.contextmanager
def _reject_value_reads() -> Iterator[None]:
    saved = {name: getattr(torch.Tensor, name) for name in VALUE_READS}

    def refuse(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if _in_the_compiler():
                return saved[name](self, *args, **kwargs)
            raise CompileOnlyRead(
                f"Tensor.{name} on a {tuple(self.shape)} tensor in "
                f"{COMPILE_ONLY_SETTING}: values are not computed"
            )

        return read

    for name in VALUE_READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
