"""The metrics reader reads the registry vLLM's /metrics serves
(``get_prometheus_registry``): the multiprocess files when
PROMETHEUS_MULTIPROC_DIR is set, else the process's own registry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A worker: counts in its own process, into the multiprocess files.
_WORKER = """
from prometheus_client import Counter
c = Counter("vllm_hpu_mm:test_runs", "runs", ["bucket"])
c.labels(bucket="16").inc(3)
c.labels(bucket="32").inc(4)
"""
# The reader, in another process (as the API server or the test is).
_READER = """
from prometheus_client import Counter
from vllm_hpu_mm.metrics_reader import read_metric, read_samples
if {own}:
    Counter("vllm_hpu_mm:test_runs", "runs", ["bucket"]).labels(bucket="16").inc(5)
print(read_metric("vllm_hpu_mm:test_runs_total", {{"bucket": "16"}}))
print(read_samples("vllm_hpu_mm:test_runs_total", "bucket"))
"""


def _run(code: str, prom_dir: Path | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = str(REPO)
    if prom_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(prom_dir)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_reads_a_workers_counts_from_the_multiprocess_files(tmp_path: Path) -> None:
    _run(_WORKER, tmp_path)
    out = _run(_READER.format(own=False), tmp_path).split("\n")
    assert out[0] == "3.0"
    assert out[1] == "{'16': 3.0, '32': 4.0}"


def test_reads_this_processs_registry_without_the_directory() -> None:
    # An engine run in the reader's own process (no multiprocess files).
    out = _run(_READER.format(own=True), None).split("\n")
    assert out[0] == "5.0"
    assert out[1] == "{'16': 5.0}"
