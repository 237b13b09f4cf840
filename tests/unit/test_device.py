"""Device selection and the device-specific helpers of ``vllm_hpu_mm.device``.

No Gaudi is needed: ``tests.fakes.habana`` serves a fake ``habana_frameworks``
and ``torch.hpu`` that behave as the real stack does (one card per process,
taken on first touch; no indexed devices). The Gaudi process model itself is
tested in ``test_gaudi_process.py``.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import vllm_hpu_mm
from tests.fakes.habana import HABANA_NAMES, FakeGaudiHost, FakeHabana, FakeTorchHpu
from vllm_hpu_mm import device
from vllm_hpu_mm.device import DEVICE_ENV, DeviceError, select_device

REPO_ROOT = Path(__file__).resolve().parents[2]
HABANA_TORCH = "habana_frameworks.torch"
HABANA_CORE = "habana_frameworks.torch.core"
PROM_ENV = "PROMETHEUS_MULTIPROC_DIR"


# ---- fixtures ------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _fresh_selection(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No forced device, no CUDA, no habana_frameworks; a fresh device choice."""
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in HABANA_NAMES:
        # None in sys.modules makes the import fail (even on a real Gaudi host).
        monkeypatch.setitem(sys.modules, name, None)
    select_device.cache_clear()
    yield
    select_device.cache_clear()


@pytest.fixture
def habana(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHabana]:
    """A Gaudi host where ``habana_frameworks.torch`` imports (the fake one)."""
    monkeypatch.delenv("HABANA_VISIBLE_MODULES", raising=False)
    fake = FakeHabana().install(monkeypatch)
    yield fake
    fake.uninstall()


@pytest.fixture
def torch_hpu(monkeypatch: pytest.MonkeyPatch) -> FakeTorchHpu:
    """A ``torch.hpu`` on torch, whatever the host (to see that it stays unused)."""
    fake = FakeGaudiHost().process("test")
    monkeypatch.setattr(torch, "hpu", fake, raising=False)
    return fake


@pytest.fixture
def cuda_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def prom_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """PROMETHEUS_MULTIPROC_DIR unset, restored to its original state afterwards
    (setenv first so monkeypatch also undoes a value that register() sets)."""
    monkeypatch.setenv(PROM_ENV, "placeholder")
    monkeypatch.delenv(PROM_ENV)
    yield
    made = os.environ.get(PROM_ENV)
    if made and Path(made).name.startswith("vllm_hpu_mm_prom_"):
        shutil.rmtree(made, ignore_errors=True)


# ---- automatic choice ----------------------------------------------------------


def test_auto_chooses_hpu_when_habana_imports(habana: FakeHabana) -> None:
    choice = select_device()
    assert choice.kind == "hpu"
    assert "habana_frameworks.torch imports" in choice.reason
    assert HABANA_TORCH in habana.imports
    assert device.device_kind() == "hpu"


class _VllmConfig:
    """What ``plan_of`` reads of a VllmConfig: no hpu_mm settings, no
    --enforce-eager."""

    additional_config = None
    model_config = None


def test_the_plan_of_a_gaudi_process_is_static(
    habana: FakeHabana, cuda_available: None
) -> None:
    """``execution: auto`` on the device this process selected: Gaudi's
    static path (a graph per bucket, tiles, flat decode, two-pass steps)."""
    from vllm_hpu_mm.plan import plan_of

    assert device.device_kind() == "hpu"
    plan = plan_of(_VllmConfig())
    assert (plan.name, plan.device_kind) == ("static", "hpu")
    assert plan.split_mixed_steps and not plan.symbolic_tokens


def test_the_plan_off_gaudi_is_dynamic(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_hpu_mm.plan import plan_of

    assert device.device_kind() == "cpu"
    assert plan_of(_VllmConfig()).name == "dynamic"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    select_device.cache_clear()
    assert device.device_kind() == "cuda"
    plan = plan_of(_VllmConfig())
    assert (plan.name, plan.symbolic_tokens, plan.dense_decode_cache) == (
        "dynamic",
        True,
        False,
    )


def test_auto_prefers_hpu_over_cuda(habana: FakeHabana, cuda_available: None) -> None:
    assert select_device().kind == "hpu"


def test_auto_chooses_cuda_when_available(cuda_available: None) -> None:
    choice = select_device()
    assert choice.kind == "cuda"
    assert "torch.cuda.is_available() is True" in choice.reason


def test_auto_chooses_cpu_when_nothing() -> None:
    choice = select_device()
    assert choice.kind == "cpu"
    assert choice.reason == "no habana_frameworks and no CUDA device"


def test_choice_is_cached_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    first = select_device()
    monkeypatch.setenv(DEVICE_ENV, "definitely-not-a-device")
    assert select_device() is first  # no re-read until cache_clear()


# ---- VLLM_HPU_MM_DEVICE --------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "kind"), [("cpu", "cpu"), (" CPU ", "cpu"), ("Cuda", "cuda")]
)
def test_env_forces_device(
    monkeypatch: pytest.MonkeyPatch,
    habana: FakeHabana,
    cuda_available: None,
    value: str,
    kind: str,
) -> None:
    monkeypatch.setenv(DEVICE_ENV, value)
    choice = select_device()
    assert choice.kind == kind
    assert choice.reason == f"forced by {DEVICE_ENV}={kind}"


def test_env_forces_hpu(monkeypatch: pytest.MonkeyPatch, habana: FakeHabana) -> None:
    monkeypatch.setenv(DEVICE_ENV, "hpu")
    assert select_device().kind == "hpu"
    assert HABANA_TORCH in habana.imports


def test_env_invalid_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(DeviceError) as info:
        select_device()
    msg = str(info.value)
    assert f"{DEVICE_ENV}='tpu' is not one of hpu, cuda, cpu" in msg
    assert "unset it to choose automatically" in msg


def test_env_forced_hpu_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "hpu")
    with pytest.raises(DeviceError) as info:
        select_device()
    msg = str(info.value)
    assert f"{DEVICE_ENV}=hpu but that device is not available here" in msg
    assert "habana_frameworks.torch does not import" in msg


def test_env_forced_cuda_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(DeviceError) as info:
        select_device()
    msg = str(info.value)
    assert f"{DEVICE_ENV}=cuda but that device is not available here" in msg
    assert "torch.cuda.is_available() is False" in msg


def test_device_error_is_a_runtime_error() -> None:
    assert issubclass(DeviceError, RuntimeError)


# ---- mark_step -----------------------------------------------------------------


def test_mark_step_on_hpu_calls_core_once(habana: FakeHabana) -> None:
    device.mark_step()
    assert habana.calls == ["mark_step"]
    assert HABANA_CORE in habana.imports


def test_mark_step_on_cpu_does_nothing(
    monkeypatch: pytest.MonkeyPatch, habana: FakeHabana
) -> None:
    # habana_frameworks is importable, but the operator forced the CPU.
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    device.mark_step()
    assert habana.calls == []
    assert HABANA_CORE not in habana.imports


def test_mark_step_on_plain_cpu_host_does_nothing() -> None:
    device.mark_step()  # no habana_frameworks at all: must not try to import it
    assert device.device_kind() == "cpu"


# ---- per-device facts ----------------------------------------------------------


def test_facts_on_hpu(habana: FakeHabana) -> None:
    # Un-indexed on every rank: the card is chosen per process.
    assert device.torch_device() == torch.device("hpu")
    assert device.torch_device(3) == torch.device("hpu")
    assert device.torch_device(3).index is None
    assert device.dist_backend() == "hccl"
    assert HABANA_CORE not in habana.imports
    assert device.compile_backend() == "hpu_backend"
    # Importing core is what registers "hpu_backend" with torch.compile.
    assert HABANA_CORE in habana.imports
    assert habana.calls == []  # no mark_step as a side effect


def test_facts_on_cuda(cuda_available: None) -> None:
    assert device.torch_device() == torch.device("cuda", 0)
    assert device.torch_device(1) == torch.device("cuda", 1)
    assert device.dist_backend() == "nccl"
    assert device.compile_backend() == "inductor"


def test_facts_on_cpu() -> None:
    assert device.torch_device() == torch.device("cpu")
    assert device.torch_device(5) == torch.device("cpu")
    assert device.dist_backend() == "gloo"
    assert device.compile_backend() == "inductor"
    assert device.device_count() == 1
    assert device.device_name() == "cpu"
    assert device.peak_memory_bytes() == 0


def test_hpu_helpers_go_to_torch_hpu(habana: FakeHabana) -> None:
    # Static facts first: they must not touch the card.
    assert device.device_name(2) == "hpu"
    assert device.total_memory() == 0
    assert habana.hpu.calls == [] and habana.hpu.card is None
    device.synchronize()
    device.manual_seed_all(7)
    assert device.device_count() == 1
    assert habana.hpu.calls == ["synchronize", "manual_seed_all", "device_count"]
    assert habana.hpu.card == 0  # taken by the first touch


def test_host_copy_event_on_hpu_is_recorded(habana: FakeHabana) -> None:
    event = device.host_copy_event()
    assert event is not None
    event.synchronize()
    assert habana.hpu.calls == ["event.record", "event.synchronize"]


def test_cpu_helpers_leave_torch_hpu_alone(torch_hpu: FakeTorchHpu) -> None:
    device.synchronize()
    device.manual_seed_all(7)
    device.empty_cache()
    assert device.host_copy_event() is None  # a CPU copy is done when it returns
    assert device.memory_info()[1] > 0
    assert torch_hpu.calls == []


# ---- memory_info ---------------------------------------------------------------


def test_memory_info_on_cpu_is_sane() -> None:
    available, total = device.memory_info()
    assert isinstance(available, int)
    assert isinstance(total, int)
    assert 0 < available <= total
    assert total >= 64 * 1024**2  # any host running these tests has more
    assert device.total_memory() == total


def test_memory_info_on_hpu_reads_mem_get_info(habana: FakeHabana) -> None:
    habana.hpu.host.memory, habana.hpu.in_use = 1000, 300
    assert device.memory_info() == (700, 1000)  # torch.hpu.mem_get_info()
    assert habana.hpu.calls == ["mem_get_info"]


# ---- register() ----------------------------------------------------------------

EXPECTED_PLATFORM = {
    # kind: (class path, device_type, dist_backend, ray_device_key)
    "hpu": ("vllm_hpu_mm.platform.HpuMMPlatform", "hpu", "hccl", "HPU"),
    "cuda": ("vllm_hpu_mm.platform.CudaMMPlatform", "cuda", "nccl", "GPU"),
    "cpu": ("vllm_hpu_mm.platform.CpuMMPlatform", "cpu", "gloo", "HPU"),
}


def _resolve(path: str) -> type:
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type)
    return cls


@pytest.mark.parametrize("kind", ["hpu", "cuda", "cpu"])
def test_register_returns_platform_of_device(
    request: pytest.FixtureRequest, prom_env: None, kind: str
) -> None:
    if kind == "hpu":
        request.getfixturevalue("habana")
    elif kind == "cuda":
        request.getfixturevalue("cuda_available")
    path, device_type, dist_backend, ray_key = EXPECTED_PLATFORM[kind]

    assert vllm_hpu_mm.register() == path

    from vllm.platforms.interface import Platform, PlatformEnum

    cls = _resolve(path)
    assert issubclass(cls, Platform)
    assert cls._enum == PlatformEnum.OOT
    assert cls.device_type == device_type
    assert cls.device_name == device_type
    assert cls.dist_backend == dist_backend
    assert cls.ray_device_key == ray_key
    # The module-level device helper agrees with the platform class.
    assert device.dist_backend() == dist_backend


def test_register_sets_prometheus_dir_when_unset(prom_env: None) -> None:
    assert PROM_ENV not in os.environ
    vllm_hpu_mm.register()
    made = os.environ.get(PROM_ENV)
    assert made
    assert Path(made).is_dir()
    assert Path(made).name.startswith("vllm_hpu_mm_prom_")


def test_register_sets_prometheus_dir_when_empty(
    monkeypatch: pytest.MonkeyPatch, prom_env: None
) -> None:
    monkeypatch.setenv(PROM_ENV, "")
    vllm_hpu_mm.register()
    assert os.environ[PROM_ENV]
    assert Path(os.environ[PROM_ENV]).is_dir()


def test_register_keeps_operator_prometheus_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(PROM_ENV, str(tmp_path))
    vllm_hpu_mm.register()
    assert os.environ[PROM_ENV] == str(tmp_path)


def test_register_propagates_forced_device_error(
    monkeypatch: pytest.MonkeyPatch, prom_env: None
) -> None:
    monkeypatch.setenv(DEVICE_ENV, "hpu")
    with pytest.raises(DeviceError, match="not available here"):
        vllm_hpu_mm.register()


# ---- design rule ---------------------------------------------------------------

_DEVICE_SPECIFIC = re.compile(r"habana_frameworks|torch\s*\.\s*(cuda|hpu)\b")


def _package_sources() -> list[Path]:
    files = [
        p
        for top in ("vllm_hpu_mm", "hpu_kernels")
        for p in sorted((REPO_ROOT / top).rglob("*.py"))
    ]
    assert files, "no sources found: wrong REPO_ROOT?"
    return files


def test_only_device_module_touches_habana_or_torch_cuda() -> None:
    """The simulated Habana stack (``vllm_hpu_mm/gaudi_sim``) is the one other
    place: it is what it simulates, and only ``device.py`` installs it."""
    device_py = REPO_ROOT / "vllm_hpu_mm" / "device.py"
    gaudi_sim = REPO_ROOT / "vllm_hpu_mm" / "gaudi_sim"
    offenders = []
    for path in _package_sources():
        if path == device_py or path.is_relative_to(gaudi_sim):
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if _DEVICE_SPECIFIC.search(line):
                rel = path.relative_to(REPO_ROOT)
                offenders.append(f"{rel}:{lineno}: {line.strip()}")
    assert not offenders, (
        "only vllm_hpu_mm/device.py may mention habana_frameworks, torch.cuda or "
        "torch.hpu; "
        "go through vllm_hpu_mm.device instead:\n" + "\n".join(offenders)
    )
    # The scan is not vacuous: device.py itself mentions all three.
    text = device_py.read_text()
    assert "habana_frameworks" in text
    assert "torch.cuda" in text
    assert "torch.hpu" in text
