"""Greedy tokens of an FP8 checkpoint on the simulated Gaudi, in a fresh
interpreter (the device is chosen once per process):
``python -m tests.fp8_sim_engine MODEL PROMPTS_JSON MAX_NEW BUCKETS_FILE`` prints
``RESULT {"tokens": [...], "fp8_gemm_calls": n, "fp8_weights": m}``."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _facts(worker: Any) -> dict[str, int]:
    """Runs in the worker (collective_rpc)."""
    import torch

    from vllm_hpu_mm.gaudi_sim.fp8_ops import Counts

    params = worker.model_runner.model.parameters()
    fp8 = sum(1 for p in params if p.dtype == torch.float8_e4m3fn)
    return {"fp8_gemm_calls": Counts.gemm, "fp8_weights": fp8}


def main() -> None:
    model, prompts_json, max_new, buckets = sys.argv[1:5]
    os.environ.update(
        {
            "VLLM_HPU_MM_DEVICE": "hpu",
            "VLLM_HPU_MM_GAUDI_SIM": "1",
            "VLLM_HPU_MM_GAUDI_SIM_MEMORY": "64M",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        }
    )
    from vllm import LLM, SamplingParams

    plugin = {
        "hpu_mm": {
            "graph_mode": "compile",
            "bucketing": {"strategy": "explicit", "file": buckets},
            "warmup": {"progress_bar": False},
            "fused": {"softmax_mode": "exact"},
        }
    }
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        seed=0,
        additional_config=plugin,
    )
    prompts = json.loads(prompts_json)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_new), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    (facts,) = llm.collective_rpc(_facts)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    print("RESULT " + json.dumps({"tokens": tokens, **facts}), flush=True)


if __name__ == "__main__":
    main()
