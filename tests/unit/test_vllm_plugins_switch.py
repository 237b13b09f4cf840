"""``VLLM_PLUGINS`` switches the plugin off and on (in fresh interpreters).

vLLM 0.33 reads ``VLLM_PLUGINS`` as a comma-separated allow-list of entry-point
names: unset loads every plugin, and a list without ``hpu_mm`` (our
``vllm.platform_plugins`` entry point) skips ours, so vLLM's own detection picks
the platform.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

PROBE = (
    "import sys\n"
    "from vllm.platforms import current_platform\n"
    "cls = type(current_platform)\n"
    "print('PLATFORM', cls.__module__, cls.__qualname__)\n"
    "print('LOADED', 'vllm_hpu_mm' in sys.modules)\n"
)


def _child_env(tmp_path: Path, plugins: str | None) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("VLLM_PLUGINS", "VLLM_TARGET_DEVICE", "VLLM_HPU_MM_DEVICE"):
        env.pop(name, None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    # CPU whatever the host has, so the expectation holds on a GPU/Gaudi host
    # too; and no stray Prometheus directory left in /tmp.
    env["VLLM_HPU_MM_DEVICE"] = "cpu"
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    return env


def _parse(out: str) -> tuple[str, bool]:
    platform = loaded = None
    for line in out.splitlines():
        if line.startswith("PLATFORM "):
            _, module, name = line.split()
            platform = f"{module}.{name}"
        elif line.startswith("LOADED "):
            loaded = line.split()[1] == "True"
    assert platform is not None and loaded is not None, out
    return platform, loaded


def test_vllm_plugins_switch(tmp_path: Path) -> None:
    # Both interpreters at once: each import of vLLM takes a few seconds.
    procs = {
        plugins: subprocess.Popen(
            [sys.executable, "-c", PROBE],
            cwd=REPO_ROOT,
            env=_child_env(tmp_path, plugins),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for plugins in (None, "none")
    }
    results = {}
    for plugins, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        assert proc.returncode == 0, f"VLLM_PLUGINS={plugins}: {err[-3000:]}"
        results[plugins] = _parse(out)

    platform, loaded = results[None]
    assert platform == "vllm_hpu_mm.platform.CpuMMPlatform"
    assert loaded

    platform, loaded = results["none"]
    assert platform.startswith("vllm."), platform
    assert not platform.startswith("vllm_hpu_mm"), platform
    assert not loaded  # our entry point was not even imported
