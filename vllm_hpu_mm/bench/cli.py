"""``vllm-hpu-mm bench throughput``: offline throughput, vllm-hpu-mm and/or HF.

Flags follow ``vllm bench throughput``; every engine argument of ``vllm
serve`` (``--model``, ``--max-num-seqs``, ``--enable-prefix-caching``,
``--additional-config``, ...) is accepted and passed to the engine. The full
parser (with vLLM's engine arguments) is built only when the command runs, so
``vllm-hpu-mm --help`` stays light.

    vllm-hpu-mm bench throughput --model models/tiny-llava --dtype float32 \\
        --dataset-name random-mm --num-prompts 16 --input-len 32 --output-len 16 \\
        --mm-image-pool 4 --prefix-len 16 --backend both --output-json out.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from vllm_hpu_mm.bench import datasets as ds

__all__ = ["add_parser", "build_parser", "main"]

BACKENDS = ("vllm-hpu-mm", "hf", "both")
DEFAULT_OUTPUT_LEN = 128


# --- the dispatcher's side: `vllm-hpu-mm bench throughput ...` ------------------


def add_parser(subparsers: Any) -> None:
    """Register ``bench`` (and ``bench throughput``) with the dispatcher.

    ``throughput`` takes its arguments unparsed (``takes_extra_args``): its
    handler parses them with the full parser, engine arguments included.
    """
    bench = subparsers.add_parser(
        "bench",
        help="benchmark the plugin",
        description="Benchmarks of vllm-hpu-mm.",
    )
    bench.set_defaults(help_parser=bench)
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    throughput = sub.add_parser(
        "throughput",
        add_help=False,  # -h goes to the full parser, engine arguments included
        help="offline throughput on a dataset, vllm-hpu-mm and/or HF transformers",
        description=__doc__,
    )
    throughput.set_defaults(handler=_from_dispatcher, takes_extra_args=True)


def _from_dispatcher(args: argparse.Namespace) -> int:
    argv: list[str] = list(args.argv)
    return main(argv[argv.index("throughput") + 1 :])


# --- the full parser ------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _typed(parse: Any) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return convert


def add_bench_args(parser: Any) -> None:
    """The benchmark's own flags (not the engine's)."""
    g = parser.add_argument_group("benchmark")
    g.add_argument(
        "--backend",
        choices=[*BACKENDS, "vllm"],
        default="vllm-hpu-mm",
        help="vllm-hpu-mm (alias vllm), hf (transformers generate), or both "
        "(one after the other, with the ratio of their throughputs)",
    )
    g.add_argument("--dataset-name", choices=ds.DATASETS, default="random")
    g.add_argument(
        "--dataset-path", type=Path, help="the sharegpt4v JSON file (its images local)"
    )
    g.add_argument(
        "--image-root",
        type=Path,
        help="folder the sharegpt4v image paths are relative to "
        "(default: the JSON file's folder)",
    )
    g.add_argument("--num-prompts", type=_positive, default=100)
    g.add_argument(
        "--input-len",
        type=_non_negative,
        default=128,
        help="random tokens per prompt after the shared prefix (random-mm: "
        "about that many tokens of text, besides the images)",
    )
    g.add_argument(
        "--output-len",
        type=_positive,
        default=None,
        help=f"tokens generated per request, eos ignored (default: "
        f"{DEFAULT_OUTPUT_LEN}; sharegpt4v: the reference answer's length)",
    )
    g.add_argument(
        "--prefix-len",
        type=_non_negative,
        default=0,
        help="tokens of one random prefix shared by every prompt (random, random-mm)",
    )
    g.add_argument(
        "--range-ratio",
        type=_ratio,
        default=0.0,
        help="input and output lengths uniform in [L*(1-r), L*(1+r)] (default: 0)",
    )
    g.add_argument(
        "--mm-items-per-prompt",
        type=_typed(ds.parse_range),
        default=(1, 1),
        metavar="N|MIN-MAX",
        help="images per random-mm prompt, uniform in the range (default: 1)",
    )
    g.add_argument(
        "--mm-image-sizes",
        type=_typed(ds.parse_sizes),
        default=((336, 336),),
        metavar="WxH[,WxH...]",
        help="random-mm image sizes, one drawn per image (default: 336x336)",
    )
    g.add_argument(
        "--mm-aspect-ratios",
        default=None,
        metavar="W:H[,W:H...]",
        help="instead of --mm-image-sizes: aspect ratios at --mm-image-long-side",
    )
    g.add_argument("--mm-image-long-side", type=_positive, default=336)
    g.add_argument(
        "--mm-image-pool",
        type=_non_negative,
        default=0,
        metavar="N",
        help="N distinct images shared by all random-mm prompts (0: every image "
        "new); with --prefix-len, what prefix caching can reuse",
    )
    g.add_argument(
        "--num-warmups",
        type=_non_negative,
        default=0,
        help="extra requests of the dataset run untimed first (hf: one batch of "
        "at most the batch size); a fresh engine's first batch pays one-off costs",
    )
    g.add_argument(
        "--hf-max-batch-size",
        type=_positive,
        default=None,
        help="HF generate batch size (default: --max-num-seqs, else 16)",
    )
    g.add_argument(
        "--disable-detokenize",
        action="store_true",
        help="vllm-hpu-mm: do not detokenize the outputs (not timed then)",
    )
    g.add_argument("--output-json", type=Path, help="write the report here")
    g.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="draw padding per bucket and the latency distribution (matplotlib)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> Any:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="vllm-hpu-mm bench throughput",
        description=__doc__.split("\n\n")[0],
    )
    add_bench_args(parser)
    EngineArgs.add_cli_args(parser)
    return parser


# --- running ------------------------------------------------------------------------


def _tokenizer_vocab(tokenizer: Any) -> list[int]:
    """Ordinary token ids: the base vocabulary minus special and added tokens
    (an added ``<image>`` must never be drawn as random text)."""
    excluded = set(tokenizer.all_special_ids) | set(
        tokenizer.get_added_vocab().values()
    )
    return ds.text_vocab(tokenizer.vocab_size, sorted(excluded))


def _image_token(model: str) -> str:
    from vllm_hpu_mm.models.qwen_processor import image_prompt, load_processor

    try:
        processor = load_processor(model)
    except (OSError, ValueError):
        return ds.IMAGE_PLACEHOLDER
    return image_prompt(processor) or ds.IMAGE_PLACEHOLDER


def make_requests(args: argparse.Namespace) -> list[ds.BenchRequest]:
    """The dataset the flags describe: ``--num-warmups`` requests, then the
    ``--num-prompts`` timed ones (same distribution, same shared prefix and
    image pool, but not the same requests)."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    text = ds.TextSpec(
        num_prompts=args.num_warmups + args.num_prompts,
        input_len=args.input_len,
        output_len=output_len,
        prefix_len=args.prefix_len,
        range_ratio=args.range_ratio,
        seed=args.seed,
    )
    if args.dataset_name == "random":
        return ds.random_text(text, _tokenizer_vocab(tokenizer))
    if args.dataset_name == "random-mm":
        sizes = (
            ds.sizes_from_ratios(args.mm_aspect_ratios, args.mm_image_long_side)
            if args.mm_aspect_ratios
            else args.mm_image_sizes
        )
        images = ds.ImageSpec(
            sizes=sizes,
            items_per_prompt=args.mm_items_per_prompt,
            pool=args.mm_image_pool,
        )
        return ds.random_mm(
            text,
            images,
            tokenizer,
            _tokenizer_vocab(tokenizer),
            _image_token(args.model),
        )
    if args.dataset_path is None:
        raise ValueError("--dataset-name sharegpt4v needs --dataset-path")
    from vllm_hpu_mm.bench.sharegpt import sharegpt4v

    return sharegpt4v(
        args.dataset_path,
        args.num_warmups + args.num_prompts,
        tokenizer,
        _image_token(args.model),
        output_len=args.output_len,
        image_root=args.image_root,
        seed=args.seed,
    )


def _engine_args(args: argparse.Namespace, max_images: int) -> Any:
    """vLLM's ``EngineArgs`` from the flags; ``--limit-mm-per-prompt`` defaults
    to the dataset's most images per prompt."""
    from vllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    if max_images and not engine_args.limit_mm_per_prompt:
        engine_args.limit_mm_per_prompt = {"image": max_images}
    return engine_args


def _hf_dtype(dtype: str) -> str:
    return {"half": "float16", "float": "float32", "auto": "auto"}.get(dtype, dtype)


def _config(args: argparse.Namespace, argv: list[str], backend: str) -> dict[str, Any]:
    from vllm_hpu_mm import device

    return {
        "command": "vllm-hpu-mm bench throughput " + shlex.join(argv),
        "device": device.device_kind(),
        "backend": backend,
        "model": args.model,
        "dtype": args.dtype,
        "dataset_name": args.dataset_name,
        "dataset_path": str(args.dataset_path) if args.dataset_path else None,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len,
        "range_ratio": args.range_ratio,
        "mm_items_per_prompt": list(args.mm_items_per_prompt),
        "mm_image_pool": args.mm_image_pool,
        "seed": args.seed,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
    }


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (engine arguments included), run, report; exit status."""
    from vllm_hpu_mm.bench.stats import build_report, check_report, format_report

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    backend = "vllm-hpu-mm" if args.backend == "vllm" else args.backend
    try:
        requests = make_requests(args)
    except (OSError, ValueError) as exc:
        print(f"vllm-hpu-mm bench throughput: {exc}", file=sys.stderr)
        return 1
    warmups, requests = requests[: args.num_warmups], requests[args.num_warmups :]
    max_images = max(len(r.images) for r in warmups + requests)
    results = []
    if backend in ("vllm-hpu-mm", "both"):
        from vllm_hpu_mm.bench.vllm_backend import run_vllm

        results.append(
            run_vllm(
                _engine_args(args, max_images),
                requests,
                warmups=warmups,
                progress=not args.no_progress,
                detokenize=not args.disable_detokenize,
            )
        )
    if backend in ("hf", "both"):
        from vllm_hpu_mm.bench.hf_backend import run_hf

        results.append(
            run_hf(
                args.model,
                requests,
                batch_size=args.hf_max_batch_size or args.max_num_seqs or 16,
                dtype=_hf_dtype(args.dtype),
                warmups=warmups,
                progress=not args.no_progress,
            )
        )
    report = build_report(_config(args, argv, backend), results)
    problems = check_report(report)
    if problems:  # a bug of this tool, not of the run: say so loudly
        raise AssertionError("report layout: " + "; ".join(problems))
    print(format_report(report))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"Wrote {args.output_json}")
    if args.plot:
        from vllm_hpu_mm.bench.plot import write_plot

        write_plot(report, args.plot)
        print(f"Wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
