"""vLLM's Sampler at padded batch sizes (``worker.sampler_padding``): padding
rows never change a real row's token, logprobs, generator or processor state;
the warmup configurations read nothing back (Gaudi's compile-only mode)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdateBuilder, LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from tests.fakes.habana import COMPILE_ONLY_SETTING, CompileOnlyRead, FakeBridgeConfig
from vllm_hpu_mm.worker.sampler_padding import (
    padded_size,
    sample_padded,
    sampler_batch_sizes,
    warm_up_sampler,
    warmup_cases,
)

V = 50
ROWS = 3
BUCKETS = (1, 4, 8)


def _generators(seeded: tuple[int, ...]) -> dict[int, torch.Generator]:
    out = {}
    for row in seeded:
        gen = torch.Generator()
        gen.manual_seed(1000 + row)
        out[row] = gen
    return out


def _metadata(
    *,
    temps: list[float] | None,
    seeded: tuple[int, ...] = (),
    logprobs: int | None = None,
    top: bool = False,
    penalties: bool = False,
    procs: LogitsProcessors | None = None,
) -> SamplingMetadata:
    n = ROWS
    greedy = [t == 0.0 for t in temps] if temps else [True] * n
    return SamplingMetadata(
        temperature=None if temps is None else torch.tensor(temps),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=torch.tensor([0.9, 0.8, 1.0]) if top else None,
        top_k=torch.tensor([5, V, 3], dtype=torch.int32) if top else None,
        generators=_generators(seeded),
        max_num_logprobs=logprobs,
        no_penalties=not penalties,
        prompt_token_ids=torch.tensor([[1, 2, V], [3, 4, 5], [6, V, V]])
        if penalties
        else None,
        frequency_penalties=torch.tensor([0.5, 0.0, 0.2] if penalties else [0.0] * n),
        presence_penalties=torch.tensor([0.0, 0.3, 0.1] if penalties else [0.0] * n),
        repetition_penalties=torch.tensor([1.2, 1.0, 1.1] if penalties else [1.0] * n),
        output_token_ids=[[7, 7], [8], []] if penalties else [],
        allowed_token_ids_mask=torch.arange(V).expand(n, V) % 7 == 0
        if penalties
        else None,
        bad_words_token_ids={1: [[8, 9]]} if penalties else {},
        logitsprocs=procs or LogitsProcessors(),
    )


def _both(make: object, logits: torch.Tensor) -> tuple[object, object]:
    """The unpadded and the padded call, each on fresh metadata (same seeds)."""
    sampler = Sampler()
    plain = sampler(logits.clone(), make())  # type: ignore[operator]
    md = make()  # type: ignore[operator]
    padded = sample_padded(sampler, logits.clone(), md, BUCKETS)
    return plain, (padded, md)


def _logits() -> torch.Tensor:
    return torch.randn(ROWS, V, generator=torch.Generator().manual_seed(0)) * 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temps": None, "logprobs": 3},
        {"temps": [1.0, 0.7, 1.3], "seeded": (0, 1, 2), "logprobs": 2},
        {"temps": [0.0, 0.9, 1.1], "seeded": (1, 2), "top": True, "logprobs": 0},
        {"temps": [0.0, 0.0, 0.8], "seeded": (2,), "penalties": True},
    ],
    ids=["greedy+logprobs", "seeded random", "mixed top-k/top-p", "penalties+masks"],
)
def test_padded_call_gives_the_real_rows_the_unpadded_result(
    kwargs: dict[str, object],
) -> None:
    logits = _logits()
    plain, (padded, md) = _both(lambda: _metadata(**kwargs), logits)  # type: ignore[arg-type]
    assert padded.sampled_token_ids.shape == (ROWS, 1)  # type: ignore[attr-defined]
    assert torch.equal(plain.sampled_token_ids, padded.sampled_token_ids)  # type: ignore[attr-defined]
    if plain.logprobs_tensors is None:  # type: ignore[attr-defined]
        assert padded.logprobs_tensors is None  # type: ignore[attr-defined]
    else:
        pairs = zip(
            plain.logprobs_tensors[:3],  # type: ignore[attr-defined]
            padded.logprobs_tensors[:3],  # type: ignore[attr-defined]
            strict=True,
        )
        for a, b in pairs:
            assert a.shape[0] == ROWS and torch.equal(a, b)
    # each seeded row drew from its own generator exactly as unpadded
    ref = _metadata(**kwargs)  # type: ignore[arg-type]
    Sampler()(logits.clone(), ref)
    for row, gen in md.generators.items():
        assert torch.equal(gen.get_state(), ref.generators[row].get_state())


def _min_p(rows: int) -> MinPLogitsProcessor:
    """vLLM's min-p processor with ``rows`` requests of min_p 0.3: its
    thresholds are a [rows, 1] tensor, sized by the real batch."""
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    proc = MinPLogitsProcessor(config, torch.device("cpu"), False)  # type: ignore[arg-type]
    updates = BatchUpdateBuilder()
    for row in range(rows):
        updates.added.append((row, SamplingParams(min_p=0.3), [1], []))
    updates.batch_changed = True
    proc.update_state(updates.get_and_reset(rows))
    return proc


def test_logits_processors_see_the_real_rows_only() -> None:
    logits = _logits()

    def make() -> SamplingMetadata:
        return _metadata(
            temps=[1.0, 1.0, 1.0],
            seeded=(0, 1, 2),
            logprobs=1,
            procs=LogitsProcessors([_min_p(ROWS)]),
        )

    plain, (padded, _) = _both(make, logits)
    assert torch.equal(plain.sampled_token_ids, padded.sampled_token_ids)  # type: ignore[attr-defined]


def test_padded_size_and_static_path() -> None:
    assert [padded_size(n, BUCKETS) for n in (1, 2, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, 9]
    assert padded_size(3, ()) == 3
    from vllm_hpu_mm.config import HpuMMConfig
    from vllm_hpu_mm.plan import build_plan

    buckets = SimpleNamespace(batch=(4, 1))

    def plan(kind: str, **settings: str) -> object:
        return build_plan(HpuMMConfig.model_validate(settings), kind, False)

    static = plan("cpu", execution="static", graph_mode="compile")
    assert sampler_batch_sizes(static, buckets) == (1, 4)
    gaudi_dynamic = plan("hpu", execution="dynamic", graph_mode="compile")
    assert sampler_batch_sizes(gaudi_dynamic, buckets) == (1, 4)  # static counts
    symbolic = plan("cpu", execution="dynamic", graph_mode="compile")
    eager = plan("cpu", execution="static", graph_mode="eager")
    assert sampler_batch_sizes(symbolic, buckets) == ()
    assert sampler_batch_sizes(eager, buckets) == ()
    assert sampler_batch_sizes(static, None) == ()


def test_sampler_warmup_reads_nothing_back_in_compile_only_mode() -> None:
    bridge = FakeBridgeConfig()
    logits = torch.zeros(4, V)
    with bridge.env_setting(COMPILE_ONLY_SETTING, True):
        calls = warm_up_sampler(Sampler(), logits, max_logprobs=2)
    assert calls == len(warmup_cases(2)) == 6 + 3


def test_the_fake_compile_only_mode_refuses_value_reads() -> None:
    bridge = FakeBridgeConfig()
    t = torch.ones(2)
    with bridge.env_setting(COMPILE_ONLY_SETTING, True):
        for read in (lambda: t.sum().item(), t.tolist, lambda: bool(t[0])):
            with pytest.raises(CompileOnlyRead):
                read()
    assert t.sum().item() == 2.0  # restored on exit
    older = FakeBridgeConfig(known=()).env_setting(COMPILE_ONLY_SETTING, True)
    with pytest.raises(KeyError), older:  # an older bridge lacks the setting
        pass
