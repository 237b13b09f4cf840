"""Run Python code that needs vLLM's process-wide state in a fresh interpreter.

vLLM's model-parallel groups and the model registry's cached inspection are
process-wide: a unit test that builds a vLLM model runs it in a child process,
which prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_for_result(args: list[str], cache_root: Path, timeout: int = 300) -> Any:
    """``python *args`` from the repository root; its ``RESULT`` line, parsed.

    ``cache_root`` becomes ``VLLM_CACHE_ROOT``: a private one, so that a cached
    model inspection of an earlier run cannot hide a failure in this one.
    """
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache_root)}
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])
