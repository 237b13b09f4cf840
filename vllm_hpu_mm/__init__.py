"""vllm-hpu-mm: a vLLM platform plugin for Intel Gaudi (HPU), multimodal first.

Importing this package only defines things. vLLM calls the two entry points:

- ``register()`` (group ``vllm.platform_plugins``) returns the dotted path of the
  platform class, so vLLM picks our platform over its built-in ones;
- ``register_models()`` (group ``vllm.general_plugins``) registers the models that
  this plugin adds or adapts, in every process that runs a model.
"""

from __future__ import annotations

__version__ = "0.1.0"

_PLATFORM_CLS = {
    "hpu": "vllm_hpu_mm.platform.HpuMMPlatform",
    "cuda": "vllm_hpu_mm.platform.CudaMMPlatform",
    "cpu": "vllm_hpu_mm.platform.CpuMMPlatform",
}


def register() -> str | None:
    """Platform plugin entry point: the platform's class path (lazy import).

    Also applies the patches: vLLM resolves the platform in every process that
    touches it (``cleanup_dist_env_and_memory()`` in a process that never
    started an engine, too), and the CPU patches must hold from then on.
    """
    from vllm_hpu_mm.device import select_device
    from vllm_hpu_mm.patches import apply_patches

    _ensure_prometheus_multiprocess_dir()
    # Logs once which device was chosen and why.
    kind = select_device().kind
    apply_patches()
    if kind == "hpu" and _simulated():
        return "vllm_hpu_mm.platform.SimulatedHpuMMPlatform"
    return _PLATFORM_CLS[kind]


def _simulated() -> bool:
    from vllm_hpu_mm.device import simulated

    return simulated()


def register_models() -> None:
    """General plugin entry point: out-of-tree model registrations, and the
    patches (also in the engine core, which on the CPU under Ray touches
    ``torch.accelerator`` at shutdown)."""
    from vllm_hpu_mm.models import register_all
    from vllm_hpu_mm.patches import apply_patches

    register_all()
    apply_patches()


def _ensure_prometheus_multiprocess_dir() -> None:
    """Let the worker's counters reach /metrics: vLLM's API server merges every
    process's values only in prometheus_client's multiprocess mode, which must
    be chosen before prometheus_client is first imported (an operator's own
    PROMETHEUS_MULTIPROC_DIR is kept).

    Not vLLM's ``setup_multiprocess_prometheus()``, which does the same: its module
    (``vllm.v1.metrics.prometheus``) imports prometheus_client at its top, and
    prometheus_client fixes its value class (in-memory or multiprocess files) at
    that first import, so calling it here would leave this process (the API
    server) in-memory while /metrics reads only the files (checked: ``MutexValue``
    after the call). vLLM itself calls it only in a parent, before starting
    several API servers. The registry /metrics serves is vLLM's
    ``get_prometheus_registry()``, which ``metrics_reader`` reads too."""
    import atexit
    import os
    import shutil
    import tempfile

    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        path = tempfile.mkdtemp(prefix="vllm_hpu_mm_prom_")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        # Removed by the process that made it (children inherit the variable).
        atexit.register(shutil.rmtree, path, ignore_errors=True)
