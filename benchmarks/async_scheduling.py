"""Async scheduling on against off, side by side in one run.

Runs ``vllm-hpu-mm bench throughput`` with ``--async-scheduling`` and with
``--no-async-scheduling`` on the same seeded workload, alternating (on, off,
on, off, ...: a shared machine drifts), each in a fresh process, and prints
requests/s of every run and the ratio of the medians.

    .venv/bin/python benchmarks/async_scheduling.py --model models/tiny-llama

Any other flag goes to ``bench throughput`` unchanged (``--num-prompts``,
``--input-len``, ``--max-num-seqs``, ``--additional-config``, ...). Figures,
never pass/fail: read the ratio and the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(flag: str, bench_args: list[str], workdir: Path, index: int) -> dict:
    out = workdir / f"{flag}-{index}.json"
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=tempfile.mkdtemp(dir=workdir))
    cmd = [
        sys.executable,
        "-m",
        "vllm_hpu_mm.cli.main",
        "bench",
        "throughput",
        *bench_args,
        flag,
        "--no-progress",
        "--output-json",
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{flag} run {index} failed (exit {proc.returncode})")
    report = json.loads(out.read_text())
    result: dict = report["results"]["vllm-hpu-mm"]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2, help="on/off pairs (default 2)")
    args, bench_args = p.parse_known_args(argv)
    if "--model" not in bench_args:
        bench_args = ["--model", "models/tiny-llama", *bench_args]
    rates: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for name, flag in (
                ("on", "--async-scheduling"),
                ("off", "--no-async-scheduling"),
            ):
                rate = float(run_once(flag, bench_args, Path(tmp), i)["requests_per_s"])
                rates[name].append(rate)
                print(f"async {name:3s} run {i}: {rate:.2f} requests/s", flush=True)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    print(f"\nmedian requests/s: on {on:.2f}, off {off:.2f}; on/off = {on / off:.2f}x")
    # The best run of each is the least disturbed one on a shared machine.
    best_on, best_off = max(rates["on"]), max(rates["off"])
    print(
        f"best requests/s:   on {best_on:.2f}, off {best_off:.2f}; "
        f"on/off = {best_on / best_off:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
