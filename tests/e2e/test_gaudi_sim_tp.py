"""TP=2 on the simulated Gaudi: two spawned workers, each with the simulated
Habana stack, joined by an ``hccl`` process group (gloo underneath).

The vocab-parallel embedding calls vLLM's ``get_masked_input_and_mask``
(compiled with ``dynamic=True`` for ``simple_compile_backend``, refused by
``hpu_backend``) and the request asks for logprobs and prompt logprobs (the
sampler's compiled rank helper); both run eagerly on HPU
(``vllm_hpu_mm.patches``). A second request in the same batch is constrained
to a choice (structured outputs: xgrammar's bitmask on a host copy of the
logits, ``gaudi_sim.grammar``). Eager mode keeps the module short; greedy tokens
are compared with HF transformers in bfloat16 up to the first near-tie.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.fresh_interpreter import run_for_result
from tests.hf_reference import compare_greedy_bf16, hf_greedy_steps

pytestmark = pytest.mark.e2e

PROMPT = [1, 415, 293, 96, 285, 114]
MAX_NEW = 6
_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
CHOICES = ["yes", "no", "maybe"]

def main():
    llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=256, max_num_seqs=4,
              tensor_parallel_size=2, enforce_eager=True, seed=0)
    params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0,
                            ignore_eos=True, logprobs=2, prompt_logprobs=1)
    choice = SamplingParams(max_tokens=8, temperature=0,
                            structured_outputs=StructuredOutputsParams(
                                choice=CHOICES))
    prompt = {"prompt_token_ids": json.loads(sys.argv[2])}
    out, constrained = llm.generate([prompt, prompt], [params, choice],
                                    use_tqdm=False)
    print("RESULT " + json.dumps({
        "tokens": list(out.outputs[0].token_ids),
        "logprobs": len(out.outputs[0].logprobs),
        "prompt_logprobs": len(out.prompt_logprobs),
        "choice": constrained.outputs[0].text,
        "choice_finish": constrained.outputs[0].finish_reason,
    }))

if __name__ == "__main__":
    main()
"""


def test_tp2_on_the_simulated_gaudi_matches_hf(
    tiny_llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "tp2.py"
    script.write_text(_SCRIPT)
    monkeypatch.setenv("VLLM_HPU_MM_DEVICE", "hpu")
    monkeypatch.setenv("VLLM_HPU_MM_GAUDI_SIM", "1")
    monkeypatch.setenv("VLLM_HPU_MM_GAUDI_SIM_MEMORY", "64M")
    repo = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    result = run_for_result(
        [str(script), tiny_llama_dir, json.dumps(PROMPT), str(MAX_NEW)],
        tmp_path / "cache",
        timeout=600,
    )
    assert result["logprobs"] == MAX_NEW
    assert result["prompt_logprobs"] == len(PROMPT)
    # Issue 28 item 3 with TP=2: each worker masks a host copy of its logits,
    # and the grammar ends the request on a choice. (The tiny random
    # tokenizer's first tokens pass xgrammar's choice grammar: the CPU without
    # the simulated Gaudi gives the same text, " soThe{ p\ufffdmaybe".)
    assert result["choice_finish"] == "stop", result
    assert result["choice"].endswith(("yes", "no", "maybe")), result["choice"]
    want, logits = hf_greedy_steps(tiny_llama_dir, PROMPT, MAX_NEW, torch.bfloat16)
    compare_greedy_bf16(result["tokens"], want, logits)  # asserts
