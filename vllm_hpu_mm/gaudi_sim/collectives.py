"""Collectives in HPU lazy mode, simulated: each needs the lazy graph cut.

In lazy mode (``PT_HPU_LAZY_MODE=1``) a step's ops accumulate into a graph
that runs at ``mark_step``. Tensor-parallel inference with HPU graphs needs
lazy collectives (``PT_HPU_ENABLE_LAZY_COLLECTIVES=true``, Habana's
"Inference Using HPU Graphs" guide; vllm-gaudi ``platform.py``
``set_torch_compile`` sets it in lazy mode), and a collective issued on a
graph that was not cut before it hits a bug of the bridge: the official
plugin marks a step before every collective (vllm-gaudi
``hpu_communicator.py``, "a workaround for a bug in Habana PT bridge
occurring when PT_HPU_ENABLE_LAZY_COLLECTIVES=true"). Here, in lazy mode, a
collective on an ``hccl`` group without a ``mark_step`` since the previous
one (or since the process started) raises ``UncutLazyCollective``; gloo
groups (vLLM's CPU groups) and eager mode are not concerned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

# torch.distributed collectives vLLM's device communicators call, with the
# position of their ``group`` argument.
COLLECTIVES = {
    "all_reduce": 2,
    "all_gather_into_tensor": 3,
    "reduce_scatter_tensor": 3,
    "gather": 3,
    "broadcast": 2,
    "send": 2,
    "recv": 2,
}


class UncutLazyCollective(RuntimeError):
    """A collective in lazy mode on a graph not cut by ``mark_step``."""


class LazyCollectives:
    """The rule (module doc) for one simulated process: ``is_lazy`` reports
    the mode; ``mark_step`` must be called by the bridge's ``mark_step``."""

    def __init__(self, is_lazy: Callable[[], bool]) -> None:
        self.is_lazy = is_lazy
        self.cut = False
        self.checked = 0  # collectives checked in lazy mode

    def mark_step(self) -> None:
        self.cut = True

    def check(self, name: str, group: Any) -> None:
        if _backend(group) != "hccl" or not self.is_lazy():
            return
        self.checked += 1
        if not self.cut:
            raise UncutLazyCollective(
                f"torch.distributed.{name} in lazy mode (PT_HPU_LAZY_MODE=1) "
                "without mark_step() since the previous collective: cut the "
                "lazy graph before each collective (htorch.core.mark_step())"
            )
        self.cut = False

    def wrappers(self) -> dict[str, Callable[..., Any]]:
        """Replacements of ``torch.distributed``'s collectives that check."""
        return {
            name: self._wrap(name, getattr(dist, name), pos)
            for name, pos in COLLECTIVES.items()
        }

    def _wrap(self, name: str, fn: Callable[..., Any], pos: int) -> Callable[..., Any]:
        def collective(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[pos] if len(args) > pos else None)
            self.check(name, group)
            return fn(*args, **kwargs)

        collective.__wrapped__ = fn  # type: ignore[attr-defined]
        return collective


def _backend(group: Any) -> str | None:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        return None
