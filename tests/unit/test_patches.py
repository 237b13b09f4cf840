"""The CPU patches hold in any process that resolves vLLM's platform.

vLLM's ``cleanup_dist_env_and_memory()`` (its tests call it between engines)
calls ``torch.accelerator.empty_cache()`` for every non-CPU platform enum, which
raises "Cannot access accelerator device" on a host without one, unless the
plugin's patch is in place. Run in a fresh interpreter that never starts an
engine, so nothing else applied the patch first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

PROBE = (
    "import torch\n"
    "from vllm.distributed.parallel_state import cleanup_dist_env_and_memory\n"
    "cleanup_dist_env_and_memory()\n"
    "from vllm.platforms import current_platform\n"
    "print('PLATFORM', type(current_platform).__name__)\n"
    "print('OK')\n"
)
UNPATCHED = "import torch\ntorch.accelerator.empty_cache()\n"


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    env["VLLM_HPU_MM_DEVICE"] = "cpu"
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )


def test_unpatched_empty_cache_raises_on_this_host(tmp_path: Path) -> None:
    """The premise (on a host without an accelerator)."""
    import torch

    if torch.accelerator.is_available():
        return  # a host with a device has nothing to patch
    out = _run(UNPATCHED, tmp_path)
    assert out.returncode != 0
    assert "accelerator" in out.stderr


def test_cleanup_without_an_engine(tmp_path: Path) -> None:
    out = _run(PROBE, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "PLATFORM CpuMMPlatform" in out.stdout
    assert "OK" in out.stdout
