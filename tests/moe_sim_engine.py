"""Greedy tokens of a MoE checkpoint in bfloat16 on the simulated Gaudi, in a
fresh interpreter (the device is chosen once per process):
``python -m tests.moe_sim_engine MODEL PROMPT_SETS_JSON MAX_NEW BUCKETS_FILE``
serves each prompt set in turn and prints ``RESULT {"tokens": [[...]], ...}``:
the tokens per set, the calls of ``torch.ops.hpu.mixture_of_experts`` and the
tokens it routed to each expert while serving, and the graphs compiled while
serving (the simulated ``hpu_backend``'s count and the plugin's metric)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _facts(worker: Any) -> dict[str, Any]:
    """Runs in the worker (collective_rpc)."""
    from vllm_hpu_mm import gaudi_sim
    from vllm_hpu_mm.gaudi_sim.moe_ops import MoeCounts

    stack = gaudi_sim.installed()
    assert stack is not None, "the simulated Gaudi is not installed in the worker"
    return {
        "plan": worker.model_runner.plan.name,
        "device_kind": worker.model_runner.plan.device_kind,
        "moe_calls": MoeCounts.calls,
        "routed": {e: int(n) for e, n in sorted(MoeCounts.routed.items())},
        "sim_compiles": stack.calls.count("compile"),
    }


def main() -> None:
    model, prompt_sets_json, max_new, buckets = sys.argv[1:5]
    os.environ.update(
        {
            "VLLM_HPU_MM_DEVICE": "hpu",
            "VLLM_HPU_MM_GAUDI_SIM": "1",
            "VLLM_HPU_MM_GAUDI_SIM_MEMORY": "64M",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        }
    )
    from vllm import LLM, SamplingParams

    from vllm_hpu_mm.metrics_reader import read_metric

    plugin = {
        "hpu_mm": {
            "graph_mode": "compile",  # execution: auto, the static plan on HPU
            "bucketing": {"strategy": "explicit", "file": buckets},
            "warmup": {"progress_bar": False},
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
    (warm,) = llm.collective_rpc(_facts)
    serving_before = read_metric(
        "vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(max_new), ignore_eos=True)
    tokens = []
    for prompts in json.loads(prompt_sets_json):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    (served,) = llm.collective_rpc(_facts)
    result = {
        "tokens": tokens,
        "plan": served["plan"],
        "device_kind": served["device_kind"],
        "moe_calls_warmup": warm["moe_calls"],
        "moe_calls_serving": served["moe_calls"] - warm["moe_calls"],
        "routed_serving": {
            e: n - warm["routed"].get(e, 0) for e, n in served["routed"].items()
        },
        "sim_compiles_warmup": warm["sim_compiles"],
        "sim_compiles_serving": served["sim_compiles"] - warm["sim_compiles"],
        "metric_compiles_serving": read_metric(
            "vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}
        )
        - serving_before,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
