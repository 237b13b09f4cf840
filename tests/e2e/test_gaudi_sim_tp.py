"""TP=2 and PP=2 on the simulated Gaudi: two spawned workers, each with the
simulated Habana stack, joined by ``hccl`` process groups (gloo underneath).
Each engine runs in a fresh interpreter (``_SCRIPT``); greedy tokens are
compared with HF transformers in bfloat16 up to the first near-tie.

- TP=2, eager: the vocab-parallel embedding calls vLLM's
  ``get_masked_input_and_mask`` (compiled with ``dynamic=True`` for
  ``simple_compile_backend``, refused by ``hpu_backend``) and the request asks
  for logprobs and prompt logprobs (the sampler's compiled rank helper); both
  run eagerly on HPU (``vllm_hpu_mm.patches``).
- PP=2, graph mode (every step shape compiled by the simulated ``hpu_backend``
  at warmup, on each stage): a prompt cut into chunks, then again from the
  prefix cache (one 128-token block, Gaudi's block size); each stage holds its
  own decoder layer's KV cache and the second stage computes from the
  intermediate tensors the first sends, of the step's bucket shape: nothing is
  compiled while serving.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fresh_interpreter import run_for_result
from tests.hf_reference import compare_greedy_bf16, hf_greedy_steps

pytestmark = pytest.mark.e2e

PROMPT = [1, 415, 293, 96, 285, 114]
MAX_NEW = 6
BUCKETS = "prefill_tokens: [16, 64]\ndecode_batch: [1, 4]\nblocks: [2, 4, 8]\n"
_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

def stage(worker):
    from vllm.distributed import get_pp_group
    return get_pp_group().rank_in_group, sorted(worker.runner.kv_caches)

def main():
    model, rounds = sys.argv[1], int(sys.argv[5])
    engine, sampling, prompts = (json.loads(a) for a in sys.argv[2:5])
    llm = LLM(model, dtype="bfloat16", max_model_len=256, max_num_seqs=4, seed=0,
              **engine)
    params = SamplingParams(temperature=0, ignore_eos=True, **sampling)
    result = {"rounds": []}
    for _ in range(rounds):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        result["rounds"].append([{
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": len(o.outputs[0].logprobs or []),
            "prompt_logprobs": len(o.prompt_logprobs or []),
            "cached": o.num_cached_tokens,
        } for o in outs])
    from vllm_hpu_mm.metrics_reader import read_metric
    name = "vllm_hpu_mm:graph_compiles_total"
    result["compiles"] = {p: read_metric(name, {"phase": p})
                          for p in ("warmup", "serving")}
    result["stages"] = sorted(llm.collective_rpc(stage))
    print("RESULT " + json.dumps(result))

if __name__ == "__main__":
    main()
"""


def _run_on_sim(
    model_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    engine: dict[str, Any],
    sampling: dict[str, Any],
    prompts: list[list[int]],
    rounds: int,
) -> Any:
    """``_SCRIPT`` on the simulated Gaudi (a 64 MiB card a worker); its result."""
    script = tmp_path / "engine.py"
    script.write_text(_SCRIPT)
    monkeypatch.setenv("VLLM_HPU_MM_DEVICE", "hpu")
    monkeypatch.setenv("VLLM_HPU_MM_GAUDI_SIM", "1")
    monkeypatch.setenv("VLLM_HPU_MM_GAUDI_SIM_MEMORY", "64M")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc
    metrics = tmp_path / "metrics"  # this engine's counters only
    metrics.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics))
    repo = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    args = [json.dumps(engine), json.dumps(sampling), json.dumps(prompts), str(rounds)]
    return run_for_result(
        [str(script), model_dir, *args], tmp_path / "cache", timeout=600
    )


def test_tp2_on_the_simulated_gaudi_matches_hf(
    tiny_llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = {"tensor_parallel_size": 2, "enforce_eager": True}
    sampling = {"max_tokens": MAX_NEW, "logprobs": 2, "prompt_logprobs": 1}
    result = _run_on_sim(
        tiny_llama_dir, tmp_path, monkeypatch, engine, sampling, [PROMPT], 1
    )
    (out,) = result["rounds"][0]
    assert out["logprobs"] == MAX_NEW
    assert out["prompt_logprobs"] == len(PROMPT)
    want, logits = hf_greedy_steps(tiny_llama_dir, PROMPT, MAX_NEW, torch.bfloat16)
    compare_greedy_bf16(out["tokens"], want, logits)  # asserts


def test_pp2_on_the_simulated_gaudi_compiles_nothing_while_serving(
    tiny_llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "buckets.yaml").write_text(BUCKETS)
    hpu_mm = {
        "graph_mode": "compile",
        "bucketing": {"strategy": "explicit", "file": str(tmp_path / "buckets.yaml")},
        "warmup": {"progress_bar": False},
    }
    engine = {
        "pipeline_parallel_size": 2,
        "max_num_batched_tokens": 64,  # the 150-token prompt: 3 chunks
        "enable_chunked_prefill": True,
        "enable_prefix_caching": True,
        "additional_config": {"hpu_mm": hpu_mm},
    }
    rng = random.Random(5)
    prompts = [PROMPT, [1] + [rng.randrange(6, 500) for _ in range(149)]]
    result = _run_on_sim(
        tiny_llama_dir,
        tmp_path,
        monkeypatch,
        engine,
        {"max_tokens": MAX_NEW},
        prompts,
        2,
    )
    for outs in result["rounds"]:  # the second round from the prefix cache
        for prompt, out in zip(prompts, outs, strict=True):
            want, logits = hf_greedy_steps(
                tiny_llama_dir, prompt, MAX_NEW, torch.bfloat16
            )
            compare_greedy_bf16(out["tokens"], want, logits)  # asserts
    assert [o["cached"] for o in result["rounds"][1]] == [0, 128]
    assert result["compiles"]["warmup"] > 0
    assert result["compiles"]["serving"] == 0
    assert result["stages"] == [
        [0, ["model.layers.0.self_attn.attn"]],
        [1, ["model.layers.1.self_attn.attn"]],
    ]
