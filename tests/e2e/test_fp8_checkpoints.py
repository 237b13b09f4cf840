"""FP8 checkpoints through ``vllm.LLM`` on the CPU: greedy parity with HF
transformers, FP8 weights in memory.

Each checkpoint is quantized offline here from a tiny model's float32 weights
(``tests/fp8_checkpoint.py``), in one of the layouts vLLM loads:

- ``fp8`` with ``weight_block_size`` [32, 32] (the published Qwen FP8 layout;
  tiny Llama);
- ``fp8`` per tensor, static activation scales (tiny Llama);
- ``compressed-tensors`` W8A8 per channel, dynamic per-token activations (the
  tiny LLaVA's language model; vision tower and projector in ``ignore``).

The oracle is HF transformers in float32 on the checkpoint's dequantized twin
(each FP8 weight replaced by ``weight * scale`` in float32). Off Gaudi the
plugin dequantizes each weight per call and leaves the activations unquantized,
so the product is the same float32 matmul HF runs: greedy tokens must be
identical, token for token (the tolerance is zero). Each checkpoint's
dequantized model must also part from the unquantized one somewhere, so the
comparison sees the quantization.

One module-scoped engine per checkpoint (three, each a few seconds to start).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fp8_checkpoint import Fp8Format, write_fp8_checkpoint
from tests.hf_reference import hf_greedy
from tests.mm_reference import (
    engine_lifetime,
    greedy_generate,
    hf_llava_greedy,
    llava_prompt,
    named_image,
    tiny_llava_dir,
)

pytestmark = pytest.mark.e2e

MAX_NEW = 12
TEXT_PROMPTS = [[(7 + 13 * i) % 600 + 6 for i in range(n)] for n in (3, 17, 40, 90)]
FORMATS = {
    "fp8-block": Fp8Format("fp8", "block", block=(32, 32)),
    "fp8-tensor-static": Fp8Format("fp8", "tensor", static_input=True),
}
VLM_FORMAT = Fp8Format("compressed-tensors", "channel")


def _fp8_parameters(worker: Any) -> dict[str, str]:
    """Runs in the worker (collective_rpc): each linear weight's dtype."""
    return {
        name: str(p.dtype).removeprefix("torch.")
        for name, p in worker.model_runner.model.named_parameters()
        if name.endswith("proj.weight") or name.endswith("fc1.weight")
    }


def _engine(model: str, **kwargs: Any) -> Iterator[Any]:
    import cloudpickle
    from vllm import LLM

    # collective_rpc ships _fp8_parameters to the engine core: pickled (the
    # engine core is a child process and reads the variable at start).
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        llm = LLM(
            model=model,
            dtype="float32",
            max_model_len=512,
            enforce_eager=True,
            max_num_seqs=8,
            seed=0,
            **kwargs,
        )
        yield from engine_lifetime(llm)
    finally:
        mp.undo()


@pytest.fixture(scope="module", params=sorted(FORMATS))
def text_checkpoint(
    request: pytest.FixtureRequest,
    tiny_llama_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[str, str]:
    fmt = FORMATS[request.param]
    return write_fp8_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("fp8"), fmt)


@pytest.fixture(scope="module")
def text_llm(text_checkpoint: tuple[str, str]) -> Iterator[Any]:
    yield from _engine(text_checkpoint[0])


def _check_weights_fp8(llm: Any, expect: int) -> None:
    (dtypes,) = llm.collective_rpc(_fp8_parameters)
    fp8 = [n for n, d in dtypes.items() if d == "float8_e4m3fn"]
    assert len(fp8) == expect, dtypes


def test_text_checkpoint_matches_hf_dequantized(
    text_llm: Any, text_checkpoint: tuple[str, str], tiny_llama_dir: str
) -> None:
    # 2 layers x (qkv_proj, o_proj, gate_up_proj, down_proj)
    _check_weights_fp8(text_llm, 8)
    outs = greedy_generate(
        text_llm, [{"prompt_token_ids": p} for p in TEXT_PROMPTS], MAX_NEW
    )
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = [list(ids) for ids in hf_greedy(text_checkpoint[1], TEXT_PROMPTS, MAX_NEW)]
    assert got == want
    unquantized = [
        list(ids) for ids in hf_greedy(tiny_llama_dir, TEXT_PROMPTS, MAX_NEW)
    ]
    assert want != unquantized, "the quantization changed no greedy token"


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return write_fp8_checkpoint(
        tiny_llava_dir(), tmp_path_factory.mktemp("fp8-vlm"), VLM_FORMAT
    )


@pytest.fixture(scope="module")
def vlm_llm(vlm_checkpoint: tuple[str, str]) -> Iterator[Any]:
    yield from _engine(vlm_checkpoint[0], limit_mm_per_prompt={"image": 1})


def test_vlm_checkpoint_matches_hf_dequantized(
    vlm_llm: Any, vlm_checkpoint: tuple[str, str]
) -> None:
    (dtypes,) = vlm_llm.collective_rpc(_fp8_parameters)
    fp8 = sorted(n for n, d in dtypes.items() if d == "float8_e4m3fn")
    assert len(fp8) == 8 and all("language_model" in n for n in fp8), dtypes
    assert all(d == "float32" for n, d in dtypes.items() if "vision" in n), dtypes
    cases = [
        (llava_prompt(1), [named_image("checker_24x40")]),
        (llava_prompt(1, "What is it?"), [named_image("stripes_64x48")]),
        (llava_prompt(0, "Tell me a story about a boat."), []),
    ]
    inputs = [
        {"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": p}
        for p, imgs in cases
    ]
    outs = greedy_generate(vlm_llm, inputs, MAX_NEW)
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = [hf_llava_greedy(vlm_checkpoint[1], p, imgs, MAX_NEW) for p, imgs in cases]
    assert got == want
    unquantized = [hf_llava_greedy(tiny_llava_dir(), p, i, MAX_NEW) for p, i in cases]
    assert want != unquantized, "the quantization changed no greedy token"
