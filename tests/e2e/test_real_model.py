"""A real model (SmolLM2-135M-Instruct, real weights) through ``vllm.LLM``,
compared with HF transformers on the same chat prompts.

Built by ``make models`` (``tools.real_model``). Five engines, one
each: bfloat16 in graph mode (Inductor, chunked prefill in 16-token chunks),
bfloat16 eager (no chunking), float32 eager (16-token chunks), and the static
plan (Gaudi's path) in float32 and bfloat16 (16-token chunks); and ``vllm
serve`` (float32) answering the chat question.

- float32: every generated token is HF float32's greedy choice on the same
  prefix (teacher-forced: one HF forward per sequence), so the sequences are
  HF's greedy sequences; "What is the capital of France?" gets Paris.
- bfloat16: at every generated step, the plugin's top-5 logprobs are compared
  with HF's log-softmax on the same prefix. Against HF bfloat16 no value may
  differ by more than ``MAX_ABS_NATS``; against HF float32 (the model's exact
  values) the plugin's RMS error must be no worse than HF bfloat16's own RMS
  error on the same values times ``RMS_RATIO``: a graph that rounds something to
  bfloat16 that HF keeps in float32 shows as a larger error than HF's.
- bfloat16 greedy steps that leave HF bfloat16's argmax must be near-ties
  (``tests.hf_reference.BF16_TIE_SPACINGS``); the module prints how many were.

"Paris" in bfloat16: in float32 this model's first answer token is "The" (504)
over "L" (60) by 0.082 nats, less than one bfloat16 spacing of those logits
(0.125 around 20). With bfloat16 logits the plugin's eager mode tied them and
answered "L'Etoile"; the plugin computes float32 logits for each row's top
candidates (``hpu_kernels.logits``), so every bfloat16 engine here must rank
the two as float32 does and answer Paris (``check_france``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.graph_config import compiled_with_buckets
from tests.hf_reference import BF16_TIE_SPACINGS, Bf16Tally, GreedyMatch, bf16_spacing
from tests.mm_reference import engine_lifetime

pytestmark = pytest.mark.e2e

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-instruct"
FRANCE = "What is the capital of France?"
PARIS_TOKEN, L_TOKEN = 504, 60  # "The" (-> "The capital ... is Paris.") and "L"
# (question, new tokens): prompts of 31 to 62 tokens with the system prompt.
QUESTIONS = [
    (FRANCE, 16),
    ("Hi!", 16),
    ("Write a short poem about the sea and the wind, in four lines.", 64),
    (
        "Explain in two sentences why the sky is blue. Then list three colours of "
        "the rainbow and say which has the longest wavelength.",
        64,
    ),
]
TOP = 5
# Measured on this model (8 chat prompts, 323 prompt and 189 to 213 generated
# tokens): HF bfloat16 is off float32 by 0.11 nats RMS (0.38 at most), the
# plugin by 0.09 (compiled), 0.10 (traced attention) and 0.12 (eager) RMS, 0.46
# at most. An lm_head accumulated in bfloat16 (9 chunks of 64) gave 1.55x HF's
# RMS here and fails the ratio. Here the
# plugin's top-5 values differ from HF bfloat16's by 0.58 (graph) and 0.75
# (eager) nats at most, RMS 0.09 and 0.08 from float32 where HF's is 0.08.
MAX_ABS_NATS = 1.0
RMS_RATIO = 1.5


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    """``make models`` builds it; a run without that builds it here (offline,
    from the installed package), never skips."""
    from tools.real_model import build_real_model

    build_real_model(MODEL_DIR.parent)


@dataclass(frozen=True, slots=True)
class Run:
    """One engine's greedy outputs for ``QUESTIONS``."""

    prompts: list[list[int]]
    tokens: list[list[int]]  # generated, per prompt
    top: list[list[dict[int, float]]]  # per prompt, per step: token -> logprob
    text: list[str]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True
        )["input_ids"]
        for q, _ in QUESTIONS
    ]


@pytest.fixture(scope="module")
def tally(request: pytest.FixtureRequest) -> Iterator[Bf16Tally]:
    t = Bf16Tally("SmolLM2-135M real weights, teacher-forced steps")
    yield t
    t.report(request.config)


def _engine(dtype: str, chunk: int | None, graph: dict[str, Any] | None) -> Any:
    from vllm import LLM

    hpu_mm = graph if graph is not None else {"hpu_mm": {"graph_mode": "eager"}}
    chunking: dict[str, Any] = (
        {"max_num_batched_tokens": chunk, "enable_chunked_prefill": True}
        if chunk
        else {"max_num_batched_tokens": 256, "enable_chunked_prefill": False}
    )
    return LLM(
        model=str(MODEL_DIR),
        dtype=dtype,
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        additional_config=hpu_mm,
        **chunking,
    )


def _run(llm: Any, prompts: list[list[int]]) -> Run:
    from vllm import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=n, logprobs=TOP, ignore_eos=True)
        for _, n in QUESTIONS
    ]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    done = [o.outputs[0] for o in outs]
    return Run(
        prompts,
        [list(c.token_ids) for c in done],
        [
            [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]
            for c in done
        ],
        [c.text for c in done],
    )


@pytest.fixture(scope="module")
def bf16_graph(
    prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    graph = compiled_with_buckets(
        tmp_path_factory,
        "smollm2",
        "prefill_tokens: [16]\ndecode_batch: [1, 4]\nblocks: [2, 4, 8, 16]\n",
    )
    for llm in engine_lifetime(_engine("bfloat16", 16, graph)):
        assert llm.llm_engine.model_config.dtype == torch.bfloat16
        yield _run(llm, prompts)


# The static plan (Gaudi's path on the CPU): the bucket set of the dynamic
# graph-mode engine plus a 4-row prefill bucket, flat decode, tiled prefill.
STATIC_BUCKETS = (
    "prefill_tokens: [4, 16]\ndecode_batch: [1, 4]\nblocks: [2, 4, 8, 16]\n"
)


@pytest.fixture(scope="module")
def bf16_static(
    prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    graph = compiled_with_buckets(
        tmp_path_factory, "smollm2-static", STATIC_BUCKETS, "static"
    )
    for llm in engine_lifetime(_engine("bfloat16", 16, graph)):
        yield _run(llm, prompts)


@pytest.fixture(scope="module")
def f32_static(
    prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Run]:
    graph = compiled_with_buckets(
        tmp_path_factory, "smollm2-static-f32", STATIC_BUCKETS, "static"
    )
    for llm in engine_lifetime(_engine("float32", 16, graph)):
        yield _run(llm, prompts)


@pytest.fixture(scope="module")
def bf16_eager(prompts: list[list[int]]) -> Iterator[Run]:
    for llm in engine_lifetime(_engine("bfloat16", None, None)):
        yield _run(llm, prompts)


@pytest.fixture(scope="module")
def f32_eager(prompts: list[list[int]]) -> Iterator[Run]:
    for llm in engine_lifetime(_engine("float32", 16, None)):
        yield _run(llm, prompts)


@functools.cache
def _hf_model(dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=dtype).eval()


def hf_step_logprobs(
    prompt: list[int], generated: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """HF's log-softmax (float64) before each generated token, teacher-forced on
    the prompt and the generated tokens: ``[len(generated), vocab]``; also the raw
    logits in ``hf_step_logits``."""
    return torch.log_softmax(hf_step_logits(prompt, generated, dtype).double(), -1)


def hf_step_logits(
    prompt: list[int], generated: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """HF's logits (as computed, e.g. bfloat16) before each generated token."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = _hf_model(dtype)(ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def near_tie_match(tokens: list[int], hf_logits: torch.Tensor) -> GreedyMatch:
    """Each step's token is HF's argmax, or one of HF's near-tied tokens (top-2
    margin at most ``BF16_TIE_SPACINGS`` bfloat16 spacings of the top logit).
    Teacher-forced: both sides condition on the plugin's prefix, so every step
    is compared. ``differs_at``: the first step that needed the rule."""
    ties, first = 0, None
    for step, token in enumerate(tokens):
        row = hf_logits[step].float()
        top2 = torch.topk(row, 2).values
        spacing = bf16_spacing(float(top2[0]))
        margin = float(top2[0] - top2[1]) / spacing
        if margin > BF16_TIE_SPACINGS:
            assert token == int(row.argmax()), (
                f"step {step}: token {token}, HF bfloat16 {int(row.argmax())} with a "
                f"top-2 margin of {margin:.1f} bfloat16 spacings (not a near-tie)"
            )
            continue
        ties += 1
        tied = torch.nonzero(row >= top2[0] - BF16_TIE_SPACINGS * spacing).flatten()
        assert token in tied.tolist(), (step, token, tied.tolist())
        if token != int(row.argmax()) and first is None:
            first = step
    return GreedyMatch(ties, first, None)


def check_bf16(run: Run, label: str, tally: Bf16Tally) -> dict[str, float]:
    """The bfloat16 checks of the module docstring; returns the figures."""
    hf_abs: list[float] = []
    ours_f32: list[float] = []
    hf_f32: list[float] = []
    for prompt, tokens, top in zip(run.prompts, run.tokens, run.top, strict=True):
        ref16 = hf_step_logprobs(prompt, tokens, torch.bfloat16)
        ref32 = hf_step_logprobs(prompt, tokens, torch.float32)
        for step, got in enumerate(top):
            for token, logprob in got.items():
                hf_abs.append(abs(logprob - float(ref16[step, token])))
                ours_f32.append(logprob - float(ref32[step, token]))
                hf_f32.append(float(ref16[step, token] - ref32[step, token]))
        logits16 = hf_step_logits(prompt, tokens, torch.bfloat16)
        tally.add(f"{label}, prompt of {len(prompt)}", near_tie_match(tokens, logits16))
    rms = lambda xs: math.sqrt(sum(x * x for x in xs) / len(xs))  # noqa: E731
    figures = {
        "max_abs_vs_hf_bf16": max(hf_abs),
        "rms_vs_f32": rms(ours_f32),
        "hf_bf16_rms_vs_f32": rms(hf_f32),
    }
    print(label, {k: round(v, 4) for k, v in figures.items()})
    assert figures["max_abs_vs_hf_bf16"] <= MAX_ABS_NATS, figures
    assert figures["rms_vs_f32"] <= RMS_RATIO * figures["hf_bf16_rms_vs_f32"], figures
    return figures


def check_france(run: Run) -> None:
    """ "The" (-> Paris) leads "L" by 0.08 nats in float32, less than a bfloat16
    logit spacing (0.125): bfloat16 logits tie them or split them by rounding
    (HF bfloat16 says Paris, the plugin's eager mode said "L'Etoile" with
    bfloat16 logits). With float32 logits at the top (``hpu_kernels.logits``)
    every mode must rank them as float32 does and answer Paris."""
    first = run.top[0][0]
    leaders = sorted(first, key=first.__getitem__, reverse=True)[:2]
    assert leaders == [PARIS_TOKEN, L_TOKEN], first
    assert first[PARIS_TOKEN] > first[L_TOKEN], first
    assert run.tokens[0][0] == PARIS_TOKEN and "Paris" in run.text[0], run.text[0]


def check_float32(run: Run) -> None:
    for prompt, tokens in zip(run.prompts, run.tokens, strict=True):
        want = hf_step_logits(prompt, tokens, torch.float32).argmax(-1).tolist()
        assert tokens == want, (len(prompt), tokens, want)
    assert "Paris" in run.text[0], run.text[0]


def test_float32_is_hf_greedy_and_says_paris(f32_eager: Run) -> None:
    check_float32(f32_eager)


def test_float32_static_plan_is_hf_greedy_and_says_paris(f32_static: Run) -> None:
    """Gaudi's path (execution: static: traced attention in bucketed graphs,
    tiled prefill, flat decode) on real weights."""
    check_float32(f32_static)


def test_bf16_static_plan_logprobs_match_hf(bf16_static: Run, tally: Bf16Tally) -> None:
    check_bf16(bf16_static, "bf16 static plan, chunked", tally)
    check_france(bf16_static)


def test_bf16_graph_mode_logprobs_match_hf(bf16_graph: Run, tally: Bf16Tally) -> None:
    check_bf16(bf16_graph, "bf16 graph, chunked", tally)
    check_france(bf16_graph)


def test_bf16_eager_logprobs_match_hf(bf16_eager: Run, tally: Bf16Tally) -> None:
    check_bf16(bf16_eager, "bf16 eager", tally)
    check_france(bf16_eager)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``vllm serve`` on the real model (float32, eager: the serving path)."""
    from tests.e2e.test_serve import serve

    log = tmp_path_factory.mktemp("smollm2-serve") / "server.log"
    yield from serve(str(MODEL_DIR), log)


def test_served_chat_is_hf_greedy_and_says_paris(server: Any) -> None:
    """The chat endpoint applies the model's own template; the answer is HF
    float32's greedy continuation of the prompt ids the server tokenised."""
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": FRANCE}],
        "max_tokens": 16,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    reply = server.post("/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    prompt, tokens = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
    want = hf_step_logits(prompt, tokens, torch.float32).argmax(-1).tolist()
    assert tokens == want, (tokens, want)
    assert "Paris" in answer["choices"][0]["message"]["content"]
