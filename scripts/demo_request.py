"""Send the demo's chat request to a running server and print what the run proved.

For a model with an image processor, the message carries a 64x32 picture (sky
over sea, drawn with Pillow, sent inline as a PNG data URL); otherwise text only.
After the answer it prints four checks, each with where its evidence comes from:

1. the greedy tokens equal HF transformers' for the same prompt ids (and image),
   run here through the benchmark's HF backend (``vllm_hpu_mm.bench.hf_backend``);
2. the warmup line of the server log;
3. graph compilations while serving: ``vllm_hpu_mm:graph_compiles_total
   {phase="serving"}`` on /metrics, which must be 0;
4. encoder runs for the image: the rise of ``vllm_hpu_mm:encoder_runs_total``
   over the request, which must be 1 (0 for a text-only model).

A model built by ``tools.build_tiny_models`` (it carries ``tiny_model_build.json``) has
random weights: its answer is noise by design, and the demo says so; it generates
exactly MAX_TOKENS tokens (``ignore_eos``), as HF is asked to. A trained model
(the default demo's SmolLM2) answers ``--question`` and stops at its end of turn:
its tokens must then be a prefix of HF's greedy continuation, ending in an
end-of-sequence token, and ``--expect WORD`` checks that the answer says WORD.

Usage: demo_request.py MODEL_DIR --url http://HOST:PORT --log SERVER_LOG
       [--question TEXT] [--expect WORD] [--hf-check auto|on|off]
       (auto: compare with HF when the weights are at most --hf-max-gib,
       default 2)
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
import sys
import urllib.request
from pathlib import Path
from typing import Any

MAX_TOKENS = 32
STAMP_FILE = "tiny_model_build.json"  # written by tools/build_tiny_models.py
SERVING_COMPILES = 'vllm_hpu_mm:graph_compiles_total{phase="serving"}'
WARMUP_COMPILES = 'vllm_hpu_mm:graph_compiles_total{phase="warmup"}'
ENCODER_RUNS = "vllm_hpu_mm:encoder_runs_total"


def picture() -> Any:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (64, 32), (40, 90, 200))
    ImageDraw.Draw(image).rectangle([0, 0, 63, 12], fill=(150, 200, 255))
    return image


def data_url(image: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def has_images(model: str) -> bool:
    return (Path(model) / "processor_config.json").is_file()


def is_tiny(model: str) -> bool:
    """A random-weights model of ``tools.build_tiny_models`` (its answer is noise)."""
    return (Path(model) / STAMP_FILE).is_file()


def default_question(model: str) -> str:
    if has_images(model):
        return "What is in this picture?"
    return "Hello! Write one sentence about the sea."


def build_request(model: str, question: str | None = None) -> dict[str, Any]:
    text = question or default_question(model)
    if has_images(model):
        content: object = [
            {"type": "image_url", "image_url": {"url": data_url(picture())}},
            {"type": "text", "text": text},
        ]
    else:
        content = text
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        # A tiny model's noise never ends: it generates exactly MAX_TOKENS, as
        # HF does. A trained model stops at its end of turn (HF's continuation
        # is then compared up to there).
        "ignore_eos": is_tiny(model),
        "return_token_ids": True,  # the prompt ids HF is given
    }


# -- the server --------------------------------------------------------------------


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        result: dict[str, Any] = json.load(reply)
        return result


def metrics(url: str) -> dict[str, float]:
    """The server's /metrics samples, ``name{labels}`` -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=60) as reply:
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def warmup_line(log: Path) -> str | None:
    text = log.read_text(encoding="utf-8", errors="replace")
    found = re.findall(r"(Warmup (?:finished|skipped)[^\n]*)", text)
    return found[-1].strip() if found else None


# -- HF transformers, the reference ---------------------------------------------------


def weights_gib(model: str) -> float:
    files = [*Path(model).glob("*.safetensors"), *Path(model).glob("*.bin")]
    return sum(f.stat().st_size for f in files) / 2**30


def hf_greedy(model: str, prompt_ids: list[int], image: Any | None) -> list[int]:
    """HF's greedy continuation of ``prompt_ids`` (with ``image``), in float32,
    MAX_TOKENS long: prompt ids as the server tokenized them, the image's tensors
    from the model's own image processor."""
    import torch
    from transformers.utils import logging as hf_logging

    from vllm_hpu_mm.bench.hf_backend import HfRunner

    hf_logging.disable_progress_bar()
    runner = HfRunner(model, dtype="float32")
    inputs: dict[str, Any] = {
        "input_ids": torch.tensor([prompt_ids]),
        "attention_mask": torch.ones(1, len(prompt_ids), dtype=torch.long),
    }
    if image is not None:
        assert runner.processor is not None
        images = [[image]] if runner.mllama else [image]  # Mllama: a list per prompt
        pix = dict(runner.processor.image_processor(images=images, return_tensors="pt"))
        if runner.mllama:  # the cross-attention mask, as MllamaProcessor makes it
            inputs.update(_mllama_cross_mask(runner, prompt_ids, pix.pop("num_tiles")))
        inputs.update(pix)
    inputs = {k: v.to(runner.device) for k, v in inputs.items()}
    return runner.generate(inputs, MAX_TOKENS)[1][0]


def _mllama_cross_mask(runner: Any, ids: list[int], num_tiles: Any) -> dict[str, Any]:
    import torch
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    mask = convert_sparse_cross_attention_mask_to_dense(
        [get_cross_attention_token_mask(ids, runner.image_id)],
        num_tiles=num_tiles,
        max_num_tiles=runner.processor.image_processor.max_image_tiles,
        length=len(ids),
    )
    return {"cross_attention_mask": torch.as_tensor(mask)}


# -- the report ----------------------------------------------------------------------


def check(ok: bool | None, text: str) -> bool:
    mark = {True: "ok  ", False: "FAIL", None: "skip"}[ok]
    print(f"  [{mark}] {text}")
    return ok is not False


def eos_ids(model: str) -> set[int]:
    """The model's end-of-sequence ids (config and generation config)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value])
    return {int(v) for v in ids if isinstance(v, int)}


def matches_hf(got: list[int], want: list[int], stop_ids: set[int]) -> bool:
    """``got`` is HF's greedy continuation: all of it, or (a request that
    stopped early) its prefix up to an end-of-sequence token."""
    if got == want:
        return True
    return bool(got) and got[-1] in stop_ids and want[: len(got)] == got


def hf_check(args: argparse.Namespace, ids: list[int], got: list[int]) -> bool:
    size = weights_gib(args.model)
    if args.hf_check == "off" or (args.hf_check == "auto" and size > args.hf_max_gib):
        why = "--hf-check off" if args.hf_check == "off" else f"{size:.1f} GiB weights"
        return check(None, f"HF transformers comparison skipped ({why}; HF_CHECK=on)")
    image = picture() if has_images(args.model) else None
    want = hf_greedy(args.model, ids, image)
    same = next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None
    )
    if matches_hf(got, want, eos_ids(args.model)):
        what = f"{len(ids)} prompt ids" + (" and image" if image is not None else "")
        upto = "" if got == want else ", up to the end of turn"
        return check(
            True,
            f"greedy tokens equal HF transformers' for the same {what} "
            f"({len(got)} of {len(want)} tokens{upto}, float32)",
        )
    return check(
        False,
        f"tokens differ from HF's from token {same}:\n  vllm {got}\n  hf   {want}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the model directory the server serves")
    parser.add_argument("--url", required=True, help="the server, http://HOST:PORT")
    parser.add_argument("--log", type=Path, required=True, help="the server's log")
    parser.add_argument(
        "--question", help="the user's message (default: one fitting the model)"
    )
    parser.add_argument(
        "--expect", help="a word the answer must contain (a trained model's check)"
    )
    parser.add_argument("--hf-check", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--hf-max-gib", type=float, default=2.0)
    args = parser.parse_args(argv)

    if is_tiny(args.model):
        print(
            f"demo: {args.model} is a tiny test model with RANDOM weights: its answer "
            "is noise by design. What the run proves is listed after it."
        )
    request = build_request(args.model, args.question)
    shown = json.dumps(request)
    if has_images(args.model):
        shown = re.sub(
            r"data:image/png;base64,[^\"]+", "data:image/png;base64,...", shown
        )
    print(f"demo: POST /v1/chat/completions {shown}")
    before = metrics(args.url)
    reply = post(args.url, request)
    after = metrics(args.url)
    choice = reply["choices"][0]
    prompt_ids, got = list(reply["prompt_token_ids"]), list(choice["token_ids"])
    print(f"demo: answer ({len(got)} tokens): {choice['message']['content']!r}")
    print(f"demo: answer token ids: {got}")

    print("demo: what this run proved")
    ok = True
    if args.expect:
        said = args.expect.lower() in choice["message"]["content"].lower()
        ok &= check(said, f"the answer says {args.expect!r}")
    ok &= hf_check(args, prompt_ids, got)
    line = warmup_line(args.log)
    ok &= check(line is not None, f"server log: {line or 'no warmup line found'}")
    serving = after.get(SERVING_COMPILES, 0.0)
    ok &= check(
        serving == 0,
        f"graph compilations while serving: {serving:g} "
        f"({WARMUP_COMPILES.split('{')[0]}: {after.get(WARMUP_COMPILES, 0.0):g} at "
        f"warmup, {serving:g} serving)",
    )
    runs = after.get(ENCODER_RUNS, 0.0) - before.get(ENCODER_RUNS, 0.0)
    want_runs = 1 if has_images(args.model) else 0
    what = "for the image" if want_runs else "(text-only request)"
    ok &= check(runs == want_runs, f"encoder runs {what}: {runs:g} ({ENCODER_RUNS})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
