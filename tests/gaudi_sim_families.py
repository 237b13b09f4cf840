"""Every model family in bfloat16 on the simulated Gaudi: the engine side.

``python -m tests.gaudi_sim_families OUT.json [FAMILY ...]`` runs, in this
fresh interpreter with the simulated Habana stack (``VLLM_HPU_MM_DEVICE=hpu
VLLM_HPU_MM_GAUDI_SIM=1``, set here before vLLM is imported), one engine per
family after another, each on Gaudi's path: ``execution: auto`` resolves to
``static`` on HPU (traced attention in bucketed static graphs compiled by the
simulated ``hpu_backend``, tiled prefill, flat paged decode, two-pass mixed
steps, FusedSDPA / FusedRMSNorm / fused RoPE, block size 128, the KV cache
sized from the simulated card). Each engine serves, in one batch, image
prompts whose placeholder runs the 16-token step budget cuts, a text prompt,
a request with ``logprobs`` and ``prompt_logprobs`` and a structured-output
request (a choice); then the first prompt again (a prefix-cache hit). The
results (prompt and output ids, compilations at warmup and while serving,
the block size) go to ``OUT.json``; ``tests/e2e/test_gaudi_sim_families.py``
compares them with HF transformers in bfloat16.

One interpreter for all families: the simulated stack is installed once per
process and vLLM's import is paid once; each engine is shut down before the
next starts.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

MAX_NEW = 6
# About 155 tokens: the first prompt fills a 128-token KV block, so its rerun
# can hit the prefix cache (vLLM caches whole blocks only).
PREAMBLE = (
    "Look closely at every detail of the picture before you answer the question. " * 5
)
CHOICES = ["yes", "no"]


@dataclass(frozen=True)
class Family:
    """One model family's tiny checkpoint and how its prompts name images."""

    name: str
    model: str  # directory under models/
    image: str  # the prompt's placeholder for one image (Qwen: qwen_prompt's)
    vision: bool = True
    budget: int = 16  # max_num_batched_tokens: smaller than an image's run
    tp: int = 1  # tensor_parallel_size (spawned workers, hccl over gloo)
    prefill_buckets: str = "[16]"
    preempt: bool = False  # a KV cache too small for the batch: see run_preemption

    def prompt(self, question: str, images: int) -> str:
        if self.name.startswith("qwen"):
            from tests.qwen_reference import qwen_prompt

            return qwen_prompt(images, question)
        if self.name == "idefics3":
            from tests.e2e.test_vlm2 import user_prompt

            return user_prompt(question, with_image=images > 0)
        if self.name.startswith("mllama"):
            return self.image * images + question
        if self.name == "mistral":
            return question
        if self.name == "gemma3":  # as tests/e2e/test_gemma3.py writes it
            return f"USER: {self.image * images}{question} ASSISTANT:"
        return f"USER: {self.image * images}\n{question} ASSISTANT:"


FAMILIES = {
    f.name: f
    for f in (
        Family("mistral", "tiny-mistral", "", vision=False),
        Family("llava", "tiny-llava", "<image>"),
        Family("idefics3", "tiny-idefics3", "<image>"),
        Family("qwen2_5_vl", "tiny-qwen2_5-vl", ""),
        Family("qwen3_vl", "tiny-qwen3-vl", ""),
        # Gemma 3 schedules an image's bidirectional span whole: the budget
        # holds one image (16 soft tokens and its markers).
        Family(
            "gemma3",
            "tiny-gemma3",
            "<start_of_image>",
            budget=24,
            prefill_buckets="[8, 24]",
        ),
        Family("mllama", "tiny-mllama", "<|image|>"),
        # TP=2: each rank one KV head of every (cross-)attention layer.
        Family("mllama_tp2", "tiny-mllama", "<|image|>", tp=2),
        Family(
            "llama_preempt",
            "tiny-llama",
            "",
            vision=False,
            preempt=True,
            prefill_buckets="[16, 64]",
        ),
    )
}

# (image kind, (width, height)) drawn by tests.mm_reference.make_image.
IMAGE_A = ("gradient", (64, 48))
IMAGE_B = ("checkerboard", (40, 56))


def images_of(spec: list[tuple[str, tuple[int, int]]]) -> list[Any]:
    from tests.mm_reference import make_image

    return [make_image(kind, tuple(size)) for kind, size in spec]  # type: ignore[arg-type]


def cases(family: Family) -> list[dict[str, Any]]:
    """The greedy cases of one family: prompt text and image specs."""
    if not family.vision:
        return [
            {"prompt": PREAMBLE + "The quick brown fox jumps over the", "images": []},
            {"prompt": "Once upon a time", "images": []},
            {"prompt": "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18", "images": []},
        ]
    return [
        {"prompt": family.prompt(PREAMBLE + "What is shown?", 1), "images": [IMAGE_A]},
        {"prompt": family.prompt("Say something short.", 0), "images": []},
        {"prompt": family.prompt("Describe it.", 1), "images": [IMAGE_B]},
    ]


def _request(case: dict[str, Any]) -> dict[str, Any]:
    images = images_of(case["images"])
    if not images:
        return {"prompt": case["prompt"]}
    return {"prompt": case["prompt"], "multi_modal_data": {"image": images}}


def _serving_compiles() -> tuple[float, float]:
    from vllm_hpu_mm.metrics_reader import read_metric

    name = "vllm_hpu_mm:graph_compiles_total"
    return read_metric(name, {"phase": "warmup"}), read_metric(
        name, {"phase": "serving"}
    )


def _engine(family: Family, models: str, workdir: str, **engine_args: Any) -> Any:
    """An engine for ``family`` on Gaudi's path: bfloat16, graph mode, the
    family's explicit buckets, 4 sequences of at most 256 tokens."""
    from vllm import LLM

    buckets = os.path.join(workdir, f"{family.name}.yaml")
    with open(buckets, "w") as f:
        f.write(
            f"prefill_tokens: {family.prefill_buckets}\n"
            "decode_batch: [1, 4]\nblocks: [1, 2, 4, 8]\n"
        )
    return LLM(
        model=os.path.join(models, family.model),
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        tensor_parallel_size=family.tp,
        seed=0,
        additional_config={
            "hpu_mm": {
                "graph_mode": "compile",
                "bucketing": {"strategy": "explicit", "file": buckets},
                "warmup": {"progress_bar": False},
            }
        },
        **engine_args,
    )


def run_family(family: Family, models: str, workdir: str) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from tests.mm_reference import engine_lifetime

    warm0, serve0 = _serving_compiles()
    engine = _engine(
        family,
        models,
        workdir,
        max_num_batched_tokens=family.budget,
        limit_mm_per_prompt={"image": 1} if family.vision else None,
    )
    with contextmanager(engine_lifetime)(engine) as llm:
        warm1, serve1 = _serving_compiles()
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        with_lps = SamplingParams(
            temperature=0.0,
            max_tokens=MAX_NEW,
            ignore_eos=True,
            logprobs=2,
            prompt_logprobs=1,
        )
        choice = SamplingParams(
            temperature=0.0,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=CHOICES),
        )
        todo = cases(family)
        requests = [_request(c) for c in todo] + [{"prompt": todo[1]["prompt"]}]
        params = [greedy, greedy, with_lps, choice]
        outs = llm.generate(requests, params, use_tqdm=False)
        again = llm.generate([_request(todo[0])], greedy, use_tqdm=False)[0]
        _, serve2 = _serving_compiles()
        lp = outs[2]
        return {
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            "warmup_compiles": warm1 - warm0,
            "serving_compiles": serve2 - serve1,
            "compiles_before_start": serve1 - serve0,
            "cases": [
                {
                    **c,
                    "prompt_ids": list(o.prompt_token_ids),
                    "tokens": list(o.outputs[0].token_ids),
                }
                for c, o in zip(todo, outs[:3], strict=True)
            ],
            "logprobs": len(lp.outputs[0].logprobs or []),
            "prompt_logprobs": len(lp.prompt_logprobs or []),
            "choice": outs[3].outputs[0].text,
            "again_tokens": list(again.outputs[0].token_ids),
            "again_cached": again.num_cached_tokens or 0,
        }


# Preemption on Gaudi's path: four prompts of 100-124 tokens each fit one
# 128-token block and cross into a second while they decode PREEMPT_NEW
# tokens; PREEMPT_BLOCKS blocks cannot hold the four at once, so vLLM preempts
# running requests (their blocks freed, their K/V recomputed when they return)
# while others decode and prefill in the same steps.
PREEMPT_LENGTHS = (100, 108, 116, 124)
PREEMPT_NEW = 24
PREEMPT_BLOCKS = 5


def preemption_prompts(model_dir: str) -> list[list[int]]:
    """Seeded random ordinary ids (no special tokens), one prompt a length."""
    import torch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    gen = torch.Generator().manual_seed(27)
    return [
        torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PREEMPT_LENGTHS
    ]


def run_preemption(family: Family, models: str, workdir: str) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.mm_reference import engine_lifetime

    model_dir = os.path.join(models, family.model)
    warm0, _ = _serving_compiles()
    engine = _engine(
        family,
        models,
        workdir,
        max_num_batched_tokens=64,
        num_gpu_blocks_override=PREEMPT_BLOCKS,
        disable_log_stats=False,  # for vllm:num_preemptions
    )
    with contextmanager(engine_lifetime)(engine) as llm:
        warm1, serve1 = _serving_compiles()
        prompts = preemption_prompts(model_dir)
        greedy = SamplingParams(
            temperature=0.0, max_tokens=PREEMPT_NEW, ignore_eos=True
        )
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False
        )
        _, serve2 = _serving_compiles()
        preemptions = sum(
            getattr(m, "value", 0)
            for m in llm.get_metrics()
            if m.name == "vllm:num_preemptions"
        )
        return {
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            "num_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "warmup_compiles": warm1 - warm0,
            "serving_compiles": serve2 - serve1,
            "preemptions": preemptions,
            "cases": [
                {"prompt_ids": p, "tokens": list(o.outputs[0].token_ids)}
                for p, o in zip(prompts, outs, strict=True)
            ],
        }


def main(argv: list[str]) -> int:
    out_path, names = argv[0], argv[1:] or list(FAMILIES)
    os.environ["VLLM_HPU_MM_DEVICE"] = "hpu"
    os.environ["VLLM_HPU_MM_GAUDI_SIM"] = "1"
    os.environ.setdefault("VLLM_HPU_MM_GAUDI_SIM_MEMORY", "128M")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    models = os.path.join(repo, "models")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            try:
                family = FAMILIES[name]
                run = run_preemption if family.preempt else run_family
                results[name] = run(family, models, workdir)
            except Exception:  # reported per family; the next one still runs
                results[name] = {"error": traceback.format_exc()[-3000:]}
            with open(out_path, "w") as f:
                json.dump(results, f)
    print("RESULT " + json.dumps({n: "error" in r for n, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
