"""Offline throughput of vllm-hpu-mm (and HF transformers): a thin wrapper of
``vllm-hpu-mm bench throughput``, with the same flags.

    .venv/bin/python benchmarks/throughput.py --model models/tiny-llama \\
        --dtype float32 --num-prompts 32 --input-len 64 --output-len 16 --backend both

Figures, never pass/fail: machines are shared and noisy.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run from a checkout without installing: the repository root on the path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vllm_hpu_mm.bench.cli import main

    raise SystemExit(main(sys.argv[1:]))
