"""Mixture-of-experts checkpoints in bfloat16 on the simulated Gaudi: the engine
side of ``tests/e2e/test_moe_gaudi_sim.py``.

``python -m tests.moe_sim_engine OUT.json QWEN3_MOE_DIR QWEN3_VL_MOE_DIR [ENGINE ...]``
runs, in this fresh interpreter with the simulated Habana stack (set here
before vLLM is imported), one engine after another (all of ``ENGINES`` unless
named), each on Gaudi's path (graph mode, the static plan, block size 128,
graphs compiled by the simulated ``hpu_backend``) with the experts through
Habana's MoE op ``torch.ops.hpu.mixture_of_experts``:

- ``qwen3_moe``: the tiny Qwen3-MoE, two prompt sets (two routings);
- ``qwen3_vl_moe``: the tiny Qwen3-VL-MoE, image prompts cut by the step
  budget and a text prompt;
- ``qwen3_moe_ep2``: the tiny Qwen3-MoE at TP=2 (two spawned workers,
  ``hccl`` over gloo) with expert parallelism: each rank holds four whole
  experts and passes their range of global ids to the op.

Each engine's result (prompt and output ids, the op's calls, the tokens it
routed to each expert and the expert ranges and weight shapes it saw, per
rank, at warmup and while serving; graphs compiled at warmup and while
serving) goes to ``OUT.json``; the test compares with HF transformers. Each
engine is shut down before the next starts.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from contextlib import contextmanager
from typing import Any

MAX_NEW = 10
TEXT_BUCKETS = "prefill_tokens: [16, 64]\ndecode_batch: [1, 4]\nblocks: [2, 4, 8]\n"
VL_BUCKETS = (
    "prefill_tokens: [16, 32]\ndecode_batch: [1, 4]\nblocks: [2, 4, 8]\n"
    "vision_patches: [64, 256]\n"
)
# TP=2: two workers compile each bucket; the fewest that serve the prompts.
EP2_BUCKETS = "prefill_tokens: [64]\ndecode_batch: [4]\nblocks: [8]\n"
VL_BUDGET = 32  # max_num_batched_tokens: smaller than an image's run
TEXT_SEEDS = (1, 2)  # two prompt sets of tests.e2e.test_moe: two routings
EP2_SEED = 3

# (prompt arguments of qwen_prompt, images as (kind, (width, height), variant))
VL_CASES: list[tuple[tuple[int, str, str], list[tuple[str, tuple[int, int], int]]]] = [
    (
        (2, "Which is brighter?", "Two: "),
        [("checkerboard", (64, 48), 1), ("stripes", (24, 56), 0)],
    ),
    ((0, "The quick brown fox", ""), []),
    ((1, "Describe it.", ""), [("gradient", (40, 24), 2)]),
]


def vl_case(i: int) -> tuple[str, list[Any]]:
    """The prompt text and images of ``VL_CASES[i]``."""
    from tests.mm_reference import make_image
    from tests.qwen_reference import qwen_prompt

    (n, question, preamble), specs = VL_CASES[i]
    images = [make_image(kind, size, v) for kind, size, v in specs]
    return qwen_prompt(n, question, preamble=preamble), images


def _moe_facts(worker: Any) -> dict[str, Any]:
    """Runs in each worker (collective_rpc)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_hpu_mm import gaudi_sim
    from vllm_hpu_mm.gaudi_sim.moe_ops import MoeCounts

    stack = gaudi_sim.installed()
    assert stack is not None, "the simulated Gaudi is not installed in the worker"
    return {
        "rank": get_tensor_model_parallel_rank(),
        "plan": worker.model_runner.plan.name,
        "device_kind": worker.model_runner.plan.device_kind,
        "moe_calls": MoeCounts.calls,
        "routed": {e: int(n) for e, n in sorted(MoeCounts.routed.items())},
        "ranges": sorted(MoeCounts.ranges),
        "sim_compiles": stack.calls.count("compile"),
    }


def _compiles() -> dict[str, float]:
    from vllm_hpu_mm.metrics_reader import read_metric

    name = "vllm_hpu_mm:graph_compiles_total"
    return {p: read_metric(name, {"phase": p}) for p in ("warmup", "serving")}


def _ranks(warm: list[dict[str, Any]], served: list[dict[str, Any]]) -> list[Any]:
    """Per rank: what serving added to warmup's counts."""
    out = []
    for w, s in zip(sorted(warm, key=lambda f: f["rank"]),
                    sorted(served, key=lambda f: f["rank"]), strict=True):  # fmt: skip
        out.append(
            {
                "rank": s["rank"],
                "plan": s["plan"],
                "device_kind": s["device_kind"],
                "moe_calls_warmup": w["moe_calls"],
                "moe_calls_serving": s["moe_calls"] - w["moe_calls"],
                "routed_serving": {
                    e: n - w["routed"].get(e, 0) for e, n in s["routed"].items()
                },
                "ranges": s["ranges"],
                "sim_compiles_warmup": w["sim_compiles"],
                "sim_compiles_serving": s["sim_compiles"] - w["sim_compiles"],
            }
        )
    return out


def _serve(
    model: str,
    workdir: str,
    name: str,
    buckets: str,
    requests_sets: list[list[dict[str, Any]]],
    **engine_args: Any,
) -> dict[str, Any]:
    """One engine on Gaudi's path: serves each request set in turn (greedy)."""
    from vllm import LLM, SamplingParams

    from tests.mm_reference import engine_lifetime

    path = os.path.join(workdir, f"{name}.yaml")
    with open(path, "w") as f:
        f.write(buckets)
    before = _compiles()
    engine = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        additional_config={
            "hpu_mm": {
                "graph_mode": "compile",  # execution: auto, the static plan on HPU
                "bucketing": {"strategy": "explicit", "file": path},
                "warmup": {"progress_bar": False},
            }
        },
        **engine_args,
    )
    with contextmanager(engine_lifetime)(engine) as llm:
        warm = llm.collective_rpc(_moe_facts)
        started = _compiles()
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        sets = []
        for requests in requests_sets:
            outs = llm.generate(requests, params, use_tqdm=False)
            sets.append(
                [
                    {
                        "prompt_ids": list(o.prompt_token_ids),
                        "tokens": list(o.outputs[0].token_ids),
                    }
                    for o in outs
                ]
            )
        served = llm.collective_rpc(_moe_facts)
        done = _compiles()
    return {
        "sets": sets,
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
        "metric_compiles_warmup": started["warmup"] - before["warmup"],
        "metric_compiles_serving": done["serving"] - started["serving"],
        "ranks": _ranks(warm, served),
    }


def run_qwen3_moe(moe_dir: str, vl_dir: str, workdir: str) -> dict[str, Any]:
    from tests.e2e.test_moe import _prompts

    sets = [[{"prompt_token_ids": p} for p in _prompts(s)] for s in TEXT_SEEDS]
    return _serve(
        moe_dir, workdir, "qwen3_moe", TEXT_BUCKETS, sets, max_num_batched_tokens=64
    )


def run_qwen3_vl_moe(moe_dir: str, vl_dir: str, workdir: str) -> dict[str, Any]:
    requests = []
    for i in range(len(VL_CASES)):
        prompt, images = vl_case(i)
        requests.append(
            {"prompt": prompt, "multi_modal_data": {"image": images}}
            if images
            else {"prompt": prompt}
        )
    return _serve(
        vl_dir,
        workdir,
        "qwen3_vl_moe",
        VL_BUCKETS,
        [requests],
        max_num_batched_tokens=VL_BUDGET,
        limit_mm_per_prompt={"image": 2},
    )


def run_qwen3_moe_ep2(moe_dir: str, vl_dir: str, workdir: str) -> dict[str, Any]:
    from tests.e2e.test_moe import _prompts

    sets = [[{"prompt_token_ids": p} for p in _prompts(EP2_SEED)]]
    return _serve(
        moe_dir,
        workdir,
        "qwen3_moe_ep2",
        EP2_BUCKETS,
        sets,
        max_num_batched_tokens=64,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
    )


ENGINES = {
    "qwen3_moe": run_qwen3_moe,
    "qwen3_vl_moe": run_qwen3_vl_moe,
    "qwen3_moe_ep2": run_qwen3_moe_ep2,
}


def main(argv: list[str]) -> int:
    out_path, moe_dir, vl_dir = argv[:3]
    names = argv[3:] or list(ENGINES)
    os.environ.update(
        {
            "VLLM_HPU_MM_DEVICE": "hpu",
            "VLLM_HPU_MM_GAUDI_SIM": "1",
            "VLLM_HPU_MM_GAUDI_SIM_MEMORY": "128M",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc
        }
    )
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            try:
                results[name] = ENGINES[name](moe_dir, vl_dir, workdir)
            except Exception:  # reported per engine; the next one still runs
                results[name] = {"error": traceback.format_exc()[-3000:]}
            with open(out_path, "w") as f:
                json.dump(results, f)
    print("RESULT " + json.dumps({n: "error" in r for n, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
