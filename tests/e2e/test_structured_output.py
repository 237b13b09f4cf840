"""Structured outputs through the plugin: the grammar bitmask reaches the right rows.

One offline engine (tiny Llama, its byte-level tokenizer spells any JSON) for
the module, in graph mode (torch.compile per bucket, a small explicit bucket
set): after warmup, constrained steps compile nothing (the bitmask and the
sampler run outside the graphs). The random model, left free, writes random
bytes; every output below is checked against its constraint (parsed JSON
validated against the schema, full regex match, one of the choices, the
grammar), and in a batch that mixes constrained and free requests the free ones
must equal a run of their own, so a bitmask on a wrong row would show on
either side.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_llm_generate import _shutdown
from tests.graph_config import compiled_with_buckets

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"(cat|dog)-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma"]
GRAMMAR = r"""
root ::= "(" expr ")"
expr ::= num ("+" num)*
num ::= [1-9] [0-9]?
"""
PROMPTS = ["The quick brown fox", "Hi", "Memory is divided into blocks", "a b c"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm import LLM

    hpu_mm = compiled_with_buckets(
        tmp_path_factory,
        "tiny",
        "prefill_tokens: [16, 64]\ndecode_batch: [1, 4, 8]\nblocks: [4, 16, 32]\n",
    )
    engine = LLM(
        model=tiny_llama_dir,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,  # chunked prompts: partial-prefill rows
        seed=0,
        # A random model loves whitespace, which JSON allows anywhere: compact
        # JSON keeps the outputs within max_tokens.
        structured_outputs_config={
            "backend": "xgrammar",
            "disable_any_whitespace": True,
        },
        additional_config=hpu_mm,
    )
    try:
        yield engine
    finally:
        _shutdown(engine)


def _params(max_tokens: int = 60, **so: Any) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    structured = StructuredOutputsParams(**so) if so else None
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=structured
    )


def _loads(text: str) -> Any:
    # xgrammar's JSON strings admit raw control characters (the tiny
    # tokenizer has a token for each byte); Python parses them with strict=False.
    return json.loads(text, strict=False)


def _check_schema(text: str) -> None:
    obj = _loads(text)
    assert set(obj) == {"name", "age", "ok"}, text
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
    assert isinstance(obj["ok"], bool)


def _check_grammar(text: str) -> None:
    assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", text), text


def test_free_output_is_not_json(llm: Any) -> None:
    """The premise: unconstrained, the random model does not write these."""
    out = llm.generate(PROMPTS, _params(40), use_tqdm=False)
    texts = [o.outputs[0].text for o in out]
    assert not any(re.fullmatch(REGEX, t) for t in texts)
    assert not any(t in CHOICES for t in texts)


@pytest.mark.parametrize(
    ("so", "check"),
    [
        ({"json": SCHEMA}, _check_schema),
        ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
        ({"choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(t)),
        ({"grammar": GRAMMAR}, _check_grammar),
    ],
    ids=["json_schema", "regex", "choice", "grammar"],
)
def test_constraint_holds(llm: Any, so: dict[str, Any], check: Any) -> None:
    out = llm.generate(PROMPTS, _params(200, **so), use_tqdm=False)
    for o in out:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]
        check(o.outputs[0].text)


def test_mixed_batch(llm: Any) -> None:
    """Constrained and free requests in one batch, prompts long enough to be
    chunked: each constraint holds, and the free requests decode exactly as
    they do alone."""
    long = " ".join(["memory blocks hold tokens"] * 12)
    prompts = [long, "Hi", long + " again", "The fox", long[:90], "x y"]
    params = [
        _params(200, json=SCHEMA),
        _params(24),
        _params(200, regex=REGEX),
        _params(24),
        _params(200, choice=CHOICES),
        _params(200, grammar=GRAMMAR),
    ]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    alone = llm.generate([prompts[1], prompts[3]], _params(24), use_tqdm=False)
    texts = [o.outputs[0].text for o in mixed]
    _check_schema(texts[0])
    assert re.fullmatch(REGEX, texts[2]), texts[2]
    assert texts[4] in CHOICES
    _check_grammar(texts[5])
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == [
        o.outputs[0].token_ids for o in alone
    ]


def test_no_compilation_after_warmup(llm: Any) -> None:
    """Runs last: every constrained and mixed step above used warmed-up graphs."""
    from vllm_hpu_mm.metrics_reader import read_metric

    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "warmup"}) > 0
    assert read_metric("vllm_hpu_mm:graph_compiles_total", {"phase": "serving"}) == 0
