"""The simulated Gaudi card and one process's ``torch.hpu``.

Semantics, from the official Gaudi plugin (vllm-project/vllm-gaudi) and the
Habana docs (summarised in docs/gaudi.md):

- One card per process, taken on first touch. A Habana process takes the first
  free card visible through ``HABANA_VISIBLE_MODULES`` when it first touches
  the device, so vllm-gaudi's ``platform.py`` answers ``get_device_name`` with
  a static name and ``get_device_total_memory`` with 0, and its
  ``set_device`` is a no-op. ``SimHost`` holds the cards of a host (in one
  Python process: tests start several simulated processes on one host);
  ``SimTorchHpu`` is one process's ``torch.hpu``: its first device query takes
  a card, and a process that finds none free fails as the runtime does.
- No indexed devices: vllm-gaudi makes ``torch.device("hpu")``; optimum-habana
  dropped ``hpu:X`` (#637). ``set_device`` refuses ``hpu:N`` for N > 0.
- Memory statistics as the bridge's ``torch.hpu`` memory API offers them
  (``mem_get_info``, ``memory_allocated``, ``max_memory_allocated``,
  ``reset_peak_memory_stats``; vllm-gaudi ``hpu_worker.py`` sizes the KV cache
  from them). The card is ``VLLM_HPU_MM_GAUDI_SIM_MEMORY`` bytes (default
  2 GiB, as the host backs it; suffixes K/M/G accepted). The simulated "HPU"
  tensors are host tensors underneath, so what is allocated on the card is
  counted as the
  bytes of every live tensor storage of the process (``live_tensor_bytes``,
  one pass over the garbage collector's objects, a storage counted once
  however many views hold it): weights, KV cache, buffers and whatever else
  is alive when a statistic is read. The peak is the bridge's as PyTorch
  documents ``max_memory_allocated`` (``torch.cuda.max_memory_allocated``,
  mirrored by ``torch.hpu``): "the maximum memory occupied by tensors" since
  ``reset_peak_memory_stats``, tensors freed in between included. From a reset
  until the peak is next read (the window a memory profile opens: reset, run
  the step, read the peak, as vllm-gaudi ``hpu_worker.py`` and this plugin's
  ``worker.profile.device_meter`` do), the card follows every tensor the
  process allocates (``worker.profile.LiveTensorBytes``, a TorchDispatchMode)
  so activations freed before the read still count; outside such a window the
  peak is the largest figure read.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import torch

VISIBLE_MODULES_ENV = "HABANA_VISIBLE_MODULES"
MEMORY_ENV = "VLLM_HPU_MM_GAUDI_SIM_MEMORY"
DEFAULT_MEMORY = 2 * 2**30
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__
_SUFFIX = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


class CardUnavailable(RuntimeError):
    """No free Gaudi card for this process (the runtime's acquire failure)."""


def card_memory_from_env() -> int:
    """The simulated card's size: ``VLLM_HPU_MM_GAUDI_SIM_MEMORY`` (bytes, or
    with a K/M/G/T suffix, binary), default 2 GiB (the host backs it)."""
    given = os.environ.get(MEMORY_ENV, "").strip().lower().removesuffix("ib")
    if not given:
        return DEFAULT_MEMORY
    scale = _SUFFIX.get(given[-1], 1)
    number = given[:-1] if given[-1] in _SUFFIX else given
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise ValueError(
            f"{MEMORY_ENV}={os.environ[MEMORY_ENV]!r} is not a size (bytes, or "
            "a number with K, M, G or T, e.g. 8G)"
        ) from None
    if size <= 0:
        raise ValueError(f"{MEMORY_ENV}={os.environ[MEMORY_ENV]!r} must be positive")
    return size


def live_tensor_bytes() -> int:
    """Bytes of the live tensor storages of this process (each storage once).

    Tensors whose class keeps PyTorch's own dispatch: plain tensors,
    parameters and their subclasses (vLLM's weight parameters,
    ``ModelWeightParameter`` and friends, hold most of a model's weights).
    A class with its own ``__torch_dispatch__`` (Dynamo's fake tensors,
    functional tensors) and meta tensors own no memory."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): a dead weak proxy raises on __class__, and
        # some module objects warn when their attributes are looked up.
        cls = type(obj)
        if not issubclass(cls, torch.Tensor):
            continue
        if cls.__torch_dispatch__ is not _PLAIN_DISPATCH:
            continue
        t: torch.Tensor = obj
        if t.is_meta or t.device.type != "cpu":
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. a sparse tensor
            continue
        nbytes = storage.nbytes()
        if nbytes:
            seen[storage.data_ptr()] = nbytes
    return sum(seen.values())


class SimHost:
    """A host's Gaudi cards (module ids), shared by the simulated processes."""

    def __init__(self, modules: tuple[int, ...] = (0,), memory: int | None = None):
        self.modules = modules
        self.memory = card_memory_from_env() if memory is None else memory
        self.owner: dict[int, str] = {}  # module id -> process name

    def process(
        self, name: str, allocated: Callable[[], int] | None = None
    ) -> SimTorchHpu:
        return SimTorchHpu(self, name, allocated)


class SimEvent:
    """An event of ``torch.hpu``: ``record()`` and ``synchronize()`` are device
    calls (they take the process's card); the host's work is done when a call
    returns, so there is nothing to wait for."""

    def __init__(self, hpu: SimTorchHpu) -> None:
        self.hpu = hpu

    def record(self, stream: object = None) -> None:
        self.hpu._touch("event.record")

    def synchronize(self) -> None:
        self.hpu._touch("event.synchronize")

    def query(self) -> bool:
        return True


class SimStream:
    """``torch.hpu.Stream``: the bridge's module has the class (Habana's
    PyTorch API reference lists ``hpu.Stream`` / ``hpu.Event``), and Dynamo
    reads ``torch.hpu.Stream`` and ``torch.hpu.Event`` as in-graph classes
    whenever ``torch.hpu`` exists (``torch/_dynamo/variables/user_defined.py``
    ``_in_graph_classes``): without it every compiled frame that meets a
    user-defined class (vLLM's tensor schemas in a VLM's image input) fails.
    The simulated card runs every op when called, so a stream orders nothing."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class SimTorchHpu:
    """``torch.hpu`` of one process. ``allocated`` gives the bytes allocated on
    the card (default ``live_tensor_bytes``); ``calls`` records the device
    calls in order."""

    Stream = SimStream

    def __init__(
        self,
        host: SimHost,
        name: str,
        allocated: Callable[[], int] | None = None,
    ) -> None:
        self.host = host
        self.name = name
        self.card: int | None = None
        self.calls: list[str] = []
        self._allocated = allocated or live_tensor_bytes
        self._peak = 0
        # Since the last reset, until the peak is read: the bytes allocated at
        # the reset and the mode following every allocation since.
        self._watch: tuple[int, Any] | None = None

    def _touch(self, call: str) -> None:
        self.calls.append(call)
        if self.card is not None:
            return
        listed = os.environ.get(VISIBLE_MODULES_ENV, "")
        visible = [int(m) for m in listed.split(",") if m.strip()] or list(
            self.host.modules
        )
        free = [m for m in visible if m not in self.host.owner]
        if not free:
            raise CardUnavailable(
                f"{self.name}: device acquire failed, no free Gaudi card among "
                f"modules {visible} (taken: {self.host.owner})"
            )
        self.card = free[0]
        self.host.owner[self.card] = self.name

    def is_available(self) -> bool:
        # Asked by Dynamo while it traces; answered from the loaded bridge.
        return True

    def is_initialized(self) -> bool:
        return self.card is not None

    # ---- memory (each query touches the card) ----------------------------------
    def _sample(self) -> int:
        now = int(self._allocated())
        if now > self.host.memory:
            raise RuntimeError(
                f"simulated Gaudi out of memory: {now / 2**30:.2f} GiB allocated on "
                f"a {self.host.memory / 2**30:.2f} GiB card (set "
                f"{MEMORY_ENV} for a larger card)"
            )
        self._peak = max(self._peak, now)
        return now

    def _end_watch(self) -> None:
        """Fold the allocations followed since the reset into the peak."""
        if self._watch is None:
            return
        base, mode = self._watch
        self._watch = None
        mode.__exit__(None, None, None)
        self._peak = max(self._peak, base + mode.peak)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the card."""
        self._touch("mem_get_info")
        self._end_watch()
        return self.host.memory - self._sample(), self.host.memory

    def memory_allocated(self, device: object = None) -> int:
        self._touch("memory_allocated")
        return self._sample()

    def max_memory_allocated(self, device: object = None) -> int:
        self._touch("max_memory_allocated")
        self._end_watch()
        self._sample()
        return self._peak

    def reset_peak_memory_stats(self, device: object = None) -> None:
        """Start the peak afresh from what is allocated now, and follow every
        allocation until the peak is read (see the module docstring)."""
        from vllm_hpu_mm.worker.profile import LiveTensorBytes

        self._touch("reset_peak_memory_stats")
        self._end_watch()
        self._peak = 0
        mode = LiveTensorBytes()
        self._watch = (self._sample(), mode)
        mode.__enter__()

    # ---- other device calls ---------------------------------------------------
    def synchronize(self, device: object = None) -> None:
        self._touch("synchronize")

    def Event(self, enable_timing: bool = False) -> SimEvent:
        return SimEvent(self)

    def manual_seed_all(self, seed: int) -> None:
        self._touch("manual_seed_all")
        torch.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        self.manual_seed_all(seed)

    def device_count(self) -> int:
        self._touch("device_count")
        return 1

    def current_device(self) -> int:
        self._touch("current_device")
        return 0

    def get_device_name(self, index: int = 0) -> str:
        self._touch("get_device_name")
        return "GAUDI3 (simulated)"

    def set_device(self, device: torch.device | str | int) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index not in (None, 0):
            raise RuntimeError(
                f"indexed HPU device {device!r}: a Habana process drives one card, "
                f"chosen by {VISIBLE_MODULES_ENV}; use torch.device('hpu')"
            )
        self._touch("set_device")
