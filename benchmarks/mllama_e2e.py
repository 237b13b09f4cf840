"""End-to-end effect of the ``encoder_states`` layout: ``vllm-hpu-mm bench
throughput`` with short outputs (``--output-len 4``: the prompt phase, where the
images are encoded, dominates) on a mid-size random Mllama, run on a baseline
revision of this repository and on the working tree, one after the other.

    .venv/bin/python benchmarks/mllama_e2e.py --baseline-rev 9f4398c \\
        [--baseline-rev REV ...] [--model-dir /tmp/mid-mllama --num-prompts 16
        --graph-mode eager]

Each baseline tree is ``git archive``d into a temporary folder and imported
through ``PYTHONPATH`` (its own code, same venv); both runs get the same flags.
There is no in-tree switch between the layouts: the tuple+stack layout needs
HF's projector column order and a cache without padding rows (another loader
and cache layout kept only for a benchmark), so the comparison is with the
revision that had the earlier buffer (a sliced, copied projector input; graph
mode writing into a graph input; clone+cat padding of the encoder inputs).

The model (built once, offline, random): vision hidden 512, 8 heads, MLP 2048,
8 local layers keeping [0, 1, 3, 5, 7] (the 11B's [3, 7, 15, 23, 30] of 32
scaled), 2 global layers, 4 tiles of 112 px in 14 px patches (65 rows, padded to
72); text hidden 512, 4 layers of which 1 and 3 cross-attend, 8 heads, 2 KV heads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

VISION = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_global_layers": 2,
    "attention_heads": 8,
    "intermediate_size": 2048,
    "intermediate_layers_indices": [0, 1, 3, 5, 7],
    "vision_output_dim": 512 * 6,
    "image_size": 112,
    "patch_size": 14,
    "initializer_range": 0.02,
}
TEXT = {
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "cross_attention_layers": [1, 3],
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1024,
    "initializer_range": 0.02,
}


def build_model(model_dir: Path) -> None:
    """The tiny Mllama's spec (``tools.tiny_model_specs``) with mid-size widths
    and tiles (same tokenizer), saved as ``make models`` saves it."""
    from dataclasses import replace

    sys.path.insert(0, str(ROOT))  # the repository's top-level ``tools``
    from tools import tiny_model_specs as specs
    from tools.build_tiny_models import model_specs, save_tiny_model

    tiny = model_specs()["tiny-mllama"]

    def config(tok: Any) -> Any:
        cfg = tiny.config(tok)
        for key, value in VISION.items():
            setattr(cfg.vision_config, key, value)
        for key, value in TEXT.items():
            setattr(cfg.text_config, key, value)
        return cfg

    def processor(tok: Any) -> Any:
        from transformers import MllamaImageProcessorPil, MllamaProcessor

        tile = int(VISION["image_size"])
        return MllamaProcessor(
            image_processor=MllamaImageProcessorPil(
                size={"height": tile, "width": tile},
                max_image_tiles=specs.MLLAMA_MAX_NUM_TILES,
            ),
            tokenizer=tok,
            chat_template=tok.chat_template,
        )

    spec = replace(tiny, name="mid-mllama", config=config, processor=processor)
    save_tiny_model(spec, model_dir)


def bench_args(args: argparse.Namespace, model_dir: Path, out: Path) -> list[str]:
    return [
        "bench", "throughput", "--model", str(model_dir), "--dtype", "float32",
        "--max-model-len", "1024", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256", "--dataset-name", "random-mm",
        "--num-prompts", str(args.num_prompts), "--input-len", "64",
        "--output-len", "4", "--mm-items-per-prompt", "1",
        "--mm-image-sizes", "224x224,224x112,112x224", "--seed", "0",
        "--additional-config",
        json.dumps({"hpu_mm": {"graph_mode": args.graph_mode}}),
        "--output-json", str(out),
    ]  # fmt: skip


def run_tree(tree: Path, cli_args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import sys; from vllm_hpu_mm.cli.main import main; sys.exit(main())"
    subprocess.run(
        [sys.executable, "-c", code, *cli_args], cwd=tree, env=env, check=True
    )
    out = Path(cli_args[cli_args.index("--output-json") + 1])
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def summary(report: dict[str, Any]) -> dict[str, float]:
    """The plugin's figures from a ``bench throughput`` report."""
    (r,) = report["results"].values()
    return {
        "requests_per_s": round(r["requests_per_s"], 3),
        "total_tokens_per_s": round(r["tokens_per_s"]["total"], 1),
        "elapsed_s": round(r["elapsed_s"], 2),
        "ttft_p50_ms": round(1000 * r["ttft_s"]["p50"], 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--baseline-rev",
        required=True,
        action="append",
        help="git revision to compare with the working tree (repeat for more)",
    )
    p.add_argument(
        "--model-dir", default=str(Path(tempfile.gettempdir()) / "mid-mllama")
    )
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--graph-mode", default="eager", choices=("eager", "compile"))
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        build_model(model_dir)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="mllama-e2e-") as tmp:
        trees: list[tuple[str, Path]] = []
        for rev in args.baseline_rev:
            tree = Path(tmp) / rev
            tree.mkdir()
            archive = subprocess.run(
                ["git", "archive", rev], cwd=ROOT, check=True, capture_output=True
            )
            subprocess.run(
                ["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True
            )
            trees.append((rev, tree))
        trees.append(("this tree", ROOT))
        for name, tree in trees:
            out = Path(tmp) / f"{name.replace(' ', '_')}.json"
            results[name] = run_tree(tree, bench_args(args, model_dir, out))
    table = {name: summary(r) for name, r in results.items()}
    print()
    print("| tree | requests/s | total tokens/s | elapsed s | TTFT p50 ms |")
    print("|---|---:|---:|---:|---:|")
    for name, t in table.items():
        print(
            f"| {name} | {t['requests_per_s']} | {t['total_tokens_per_s']} "
            f"| {t['elapsed_s']} | {t['ttft_p50_ms']} |"
        )
    ours = table["this tree"]["requests_per_s"]
    for rev in args.baseline_rev:
        ratio = ours / table[rev]["requests_per_s"]
        print(f"this tree / {rev} requests/s: {ratio:.3f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
