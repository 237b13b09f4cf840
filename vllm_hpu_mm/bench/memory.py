"""Peak host memory of processes, from Linux's /proc (0 where it is unknown).

Device memory comes from ``vllm_hpu_mm.device``; this is the host side: the
high-water mark of a process's resident set (``VmHWM``), which the CPU
fallback's weights, KV cache and activations live in.

Why ``VmHWM`` is read here rather than taken from a library: psutil reports a
process's current RSS but no peak on Linux (its ``memory_info`` has no
high-water mark there), and ``resource.getrusage``'s ``ru_maxrss`` gives this
process's peak since it started, which ``reset_peak_rss`` cannot reset (the HF
backend measures from after its reset, so an in-process engine that ran first
is not counted), and its children's only once they have exited and been waited
for, as the largest one, not the sum. The engine's processes are measured while
they run. psutil lists them.
"""

from __future__ import annotations

import os
from pathlib import Path


def peak_rss_bytes(pid: int | None = None) -> int:
    """``VmHWM`` of process ``pid`` (default: this one), in bytes."""
    status = Path(f"/proc/{pid or os.getpid()}/status")
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def children_peak_rss_bytes() -> int:
    """Sum of ``VmHWM`` over this process's descendants (the engine's
    processes; their peaks may fall at different times, so an upper bound)."""
    import psutil

    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    return sum(peak_rss_bytes(k.pid) for k in kids)


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0);
    False when the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
