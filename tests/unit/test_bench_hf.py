"""The HF backend's pieces without loading a model: batching, and the Gaudi
adaptation in ``vllm_hpu_mm.device`` driven through the fake Gaudi stack
(``tests.fakes.habana``) and a recording optimum-habana."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes.habana import HABANA_NAMES, FakeHabana, check_gaudi_generate_kwargs
from vllm_hpu_mm import device
from vllm_hpu_mm.bench.datasets import BenchRequest
from vllm_hpu_mm.bench.hf_backend import batches

OPTIMUM_MODULES = (
    "optimum",
    "optimum.habana",
    "optimum.habana.transformers",
    "optimum.habana.transformers.modeling_utils",
)


def _req(out: int, images: int = 0) -> BenchRequest:
    return BenchRequest(
        output_len=out,
        prompt="x",
        images=[object()] * images,
        image_keys=[str(i) for i in range(images)],
    )


def test_batches_group_by_images_then_length() -> None:
    reqs = [_req(4), _req(9, 1), _req(8), _req(2, 1), _req(16), _req(9, 1)]
    got = batches(reqs, 2)
    assert sorted(i for b in got for i in b) == list(range(6))
    assert all(len(b) <= 2 for b in got)
    for b in got:  # one image count per batch
        assert len({len(reqs[i].images) for i in b}) == 1
    # Text-only first, longest output first.
    assert got[0] == [4, 2] and got[1] == [0]
    assert got[2] == [1, 5] and got[3] == [3]
    with pytest.raises(ValueError):
        batches(reqs, 0)


class Recorder:
    """Calls on the fake optimum-habana and the model, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []


class FakeModel:
    """A real small object standing for an HF model: records ``to``."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.device = "cpu"

    def to(self, where: str) -> FakeModel:
        self.recorder.calls.append(("to", where))
        self.device = where
        return self


@pytest.fixture
def gaudi(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Recorder, FakeHabana]]:
    """A Gaudi host as far as ``device`` can tell: the fake habana_frameworks
    (tests.fakes.habana) and an optimum.habana whose adaptation is recorded."""
    rec = Recorder()
    mods = {name: types.ModuleType(name) for name in OPTIMUM_MODULES}
    for name in OPTIMUM_MODULES[:-1]:
        mods[name].__path__ = []  # packages
    utils = mods["optimum.habana.transformers.modeling_utils"]
    utils.adapt_transformers_to_gaudi = lambda: rec.calls.append(("adapt", None))  # type: ignore[attr-defined]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv(device.DEVICE_ENV, "hpu")
    fake = FakeHabana().install(monkeypatch)
    device.select_device.cache_clear()
    yield rec, fake
    device.select_device.cache_clear()
    fake.uninstall()


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(device.DEVICE_ENV, "cpu")
    for name in (*HABANA_NAMES, *OPTIMUM_MODULES):
        monkeypatch.setitem(sys.modules, name, None)  # any import would fail
    device.select_device.cache_clear()
    yield
    device.select_device.cache_clear()


def test_gaudi_adapts_transformers_and_moves_the_model(
    gaudi: tuple[Recorder, FakeHabana],
) -> None:
    rec, fake = gaudi
    device.prepare_hf_for_device()
    assert rec.calls == [("adapt", None)]
    model = FakeModel(rec)
    assert device.hf_model_to_device(model) is model
    assert rec.calls[1:] == [("to", "hpu")]
    # Eager bridge (PT_HPU_LAZY_MODE unset): no HPU graphs, which optimum-habana
    # accepts only with lazy mode (graphs in lazy mode: test_gaudi_process.py).
    kwargs = device.hf_generate_kwargs()
    assert kwargs == {"lazy_mode": False, "hpu_graphs": False}
    check_gaudi_generate_kwargs(kwargs)
    assert fake.calls == []


def test_cpu_leaves_transformers_and_model_alone(cpu: None) -> None:
    device.prepare_hf_for_device()  # would fail on any Gaudi import
    rec = Recorder()
    model = FakeModel(rec)
    assert device.hf_model_to_device(model) is model
    assert rec.calls == []
    assert device.hf_generate_kwargs() == {}
