"""The HF backend's pieces without loading a model: batching, and the Gaudi
adaptation in ``vllm_hpu_mm.device`` driven through recording fakes of
optimum-habana and habana_frameworks."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_hpu_mm import device
from vllm_hpu_mm.bench.datasets import BenchRequest
from vllm_hpu_mm.bench.hf_backend import batches

GAUDI_MODULES = (
    "habana_frameworks",
    "habana_frameworks.torch",
    "habana_frameworks.torch.hpu",
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
    """Fake modules' calls, in order."""

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
def gaudi(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    """A Gaudi host as far as ``device`` can tell: fake habana_frameworks and
    optimum.habana modules that record what is called."""
    rec = Recorder()
    mods = {name: types.ModuleType(name) for name in GAUDI_MODULES}
    for name in GAUDI_MODULES[:-1]:
        mods[name].__path__ = []  # packages
    utils = mods["optimum.habana.transformers.modeling_utils"]
    utils.adapt_transformers_to_gaudi = lambda: rec.calls.append(("adapt", None))  # type: ignore[attr-defined]

    def wrap_in_hpu_graph(model: Any) -> Any:
        rec.calls.append(("wrap_in_hpu_graph", model.device))
        return ("graphed", model)

    mods["habana_frameworks.torch.hpu"].wrap_in_hpu_graph = wrap_in_hpu_graph  # type: ignore[attr-defined]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv(device.DEVICE_ENV, "hpu")
    device.select_device.cache_clear()
    yield rec
    device.select_device.cache_clear()


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(device.DEVICE_ENV, "cpu")
    for name in GAUDI_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # any import would fail
    device.select_device.cache_clear()
    yield
    device.select_device.cache_clear()


def test_gaudi_adapts_transformers_and_wraps_the_model(gaudi: Recorder) -> None:
    device.prepare_hf_for_device()
    assert gaudi.calls == [("adapt", None)]
    model = FakeModel(gaudi)
    wrapped = device.hf_model_to_device(model)
    assert wrapped == ("graphed", model)
    assert gaudi.calls[1:] == [("to", "hpu"), ("wrap_in_hpu_graph", "hpu")]
    assert device.hf_generate_kwargs() == {"lazy_mode": True, "hpu_graphs": True}


def test_cpu_leaves_transformers_and_model_alone(cpu: None) -> None:
    device.prepare_hf_for_device()  # would fail on any Gaudi import
    rec = Recorder()
    model = FakeModel(rec)
    assert device.hf_model_to_device(model) is model
    assert rec.calls == []
    assert device.hf_generate_kwargs() == {}
