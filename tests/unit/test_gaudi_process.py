"""The Gaudi process model, through ``tests.fakes.habana`` (real semantics).

Each test fails if the plugin drives Gaudi the way the real stack rejects:
a card taken by the API-server process, indexed ``hpu:N`` devices, ranks that
do not follow ``HABANA_VISIBLE_MODULES``, Inductor on HPU tensors, fork for
HPU workers, torch.compile under lazy mode, HPU graphs without lazy mode in the
HF baseline.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

# ParallelConfig imports vLLM's executors, whose module-level @torch.compile
# helpers look the platform's compile backend up: imported here, before any
# test's fake Habana process makes the platform HPU ('hpu_backend' unregistered).
from vllm.config import ParallelConfig
from vllm.v1 import executor as _executors  # noqa: F401

from tests.fakes.habana import (
    HABANA_NAMES,
    LAZY_ENV,
    VISIBLE_MODULES_ENV,
    CardUnavailable,
    FakeGaudiHost,
    FakeHabana,
    check_gaudi_generate_kwargs,
    reject_inductor,
)
from vllm_hpu_mm import device
from vllm_hpu_mm.config import HpuMMConfig
from vllm_hpu_mm.device import DEVICE_ENV, DeviceError
from vllm_hpu_mm.platform import CpuMMPlatform, HpuMMPlatform
from vllm_hpu_mm.platform_config import (
    MULTIPROC_METHOD_ENV,
    UnsupportedConfigError,
    _check_lazy_mode,
    _set_worker_start_method,
)

GaudiProcess = Callable[..., FakeHabana]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (DEVICE_ENV, VISIBLE_MODULES_ENV, LAZY_ENV, MULTIPROC_METHOD_ENV):
        monkeypatch.delenv(name, raising=False)
    for name in HABANA_NAMES:
        monkeypatch.setitem(sys.modules, name, None)
    device.select_device.cache_clear()
    yield
    device.select_device.cache_clear()


@pytest.fixture
def gaudi_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[GaudiProcess]:
    """Start a fake Habana process on a host: ``gaudi_process(host, name)``.
    One at a time is current (its torch.hpu is on torch), as in one process."""
    started: list[FakeHabana] = []

    def start(host: FakeGaudiHost, name: str) -> FakeHabana:
        for fake in started:
            fake.uninstall()
        device.select_device.cache_clear()
        fake = FakeHabana(host, name).install(monkeypatch)
        started.append(fake)
        assert device.device_kind() == "hpu"
        return fake

    yield start
    for fake in started:
        fake.uninstall()


# ---- the API-server process never touches the card ---------------------------------


def _api_server_device_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM 0.33 asks the platform in the API-server process: batch
    defaults (engine/arg_utils.py) and the device name of dtype checks
    (config/model.py)."""
    import vllm.engine.arg_utils as arg_utils

    monkeypatch.setattr(arg_utils, "current_platform", HpuMMPlatform())
    max_tokens, max_seqs = arg_utils.EngineArgs.get_batch_defaults(world_size=1)
    assert max_tokens and max_seqs
    assert HpuMMPlatform.get_device_name() == "hpu"
    assert HpuMMPlatform.get_device_total_memory() == 0


def test_api_server_leaves_the_only_card_to_the_engine(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    host = FakeGaudiHost(modules=(0,))
    api = gaudi_process(host, "api-server")
    _api_server_device_calls(monkeypatch)
    assert api.hpu.calls == [] and host.owner == {}

    engine = gaudi_process(host, "engine-core")
    assert device.claim_device(0) == torch.device("hpu")
    free, total = device.memory_info()  # the worker's first touch
    assert (free, total) == (host.memory - engine.hpu.in_use, host.memory)
    assert host.owner == {0: "engine-core"}


def test_the_fake_host_refuses_a_second_owner(gaudi_process: GaudiProcess) -> None:
    host = FakeGaudiHost(modules=(0,))
    gaudi_process(host, "api-server").hpu.mem_get_info()
    engine = gaudi_process(host, "engine-core")
    with pytest.raises(CardUnavailable, match="no free Gaudi card"):
        engine.hpu.mem_get_info()


# ---- un-indexed device, card per rank --------------------------------------------


def test_worker_device_is_unindexed_and_accepted(gaudi_process: GaudiProcess) -> None:
    fake = gaudi_process(FakeGaudiHost(modules=(0, 1)), "rank1")
    dev = device.claim_device(1, local_ranks=2)
    assert dev == torch.device("hpu") and dev.index is None
    HpuMMPlatform.set_device(dev)  # vLLM's call; no indexed set_device
    with pytest.raises(RuntimeError, match="indexed HPU device"):
        fake.hpu.set_device(torch.device("hpu", 1))
    fake.hpu.set_device(torch.device("hpu", 0))  # names the process's card


def test_ranks_take_their_listed_modules_in_any_start_order(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    host = FakeGaudiHost(modules=(0, 1, 2, 3))
    cards = {}
    for rank in (1, 0):  # rank 1 starts first
        monkeypatch.setenv(VISIBLE_MODULES_ENV, "2,3")  # what every worker inherits
        fake = gaudi_process(host, f"rank{rank}")
        device.claim_device(rank, local_ranks=2)
        device.synchronize()
        cards[rank] = fake.hpu.card
    # rank r -> r-th listed module, as vLLM's device_id_to_physical_device_id maps
    assert cards == {0: 2, 1: 3}


def test_one_listed_module_is_kept(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    monkeypatch.setenv(VISIBLE_MODULES_ENV, "5")  # Ray: one module per actor
    fake = gaudi_process(FakeGaudiHost(modules=(4, 5)), "ray-actor")
    assert device.select_card(3) == "5"
    device.synchronize()
    assert fake.hpu.card == 5


def test_a_single_worker_keeps_the_list(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    monkeypatch.setenv(VISIBLE_MODULES_ENV, "1,2")
    host = FakeGaudiHost(modules=(0, 1, 2))
    host.owner[1] = "another job"
    fake = gaudi_process(host, "engine-core")
    assert device.select_card(0, local_ranks=1) is None
    device.synchronize()
    assert fake.hpu.card == 2  # the first free listed card


def test_unset_modules_leave_the_choice_to_habana(gaudi_process: GaudiProcess) -> None:
    fake = gaudi_process(FakeGaudiHost(modules=(0, 1)), "rank1")
    assert device.select_card(1, local_ranks=2) is None
    device.synchronize()
    assert fake.hpu.card == 0  # the first free card


def test_rank_beyond_the_listed_modules(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    monkeypatch.setenv(VISIBLE_MODULES_ENV, "0,1")
    gaudi_process(FakeGaudiHost(modules=(0, 1)), "rank2")
    with pytest.raises(
        DeviceError,
        match=r"3 workers on this node \(this one: local index 2\) but .* 2 module",
    ):
        device.select_card(2, local_ranks=3)


def test_select_card_leaves_other_devices_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(VISIBLE_MODULES_ENV, "0,1")
    assert device.select_card(1, 2) is None  # the CPU host of this test
    assert device.claim_device(1, 2) == torch.device("cpu")
    assert os.environ[VISIBLE_MODULES_ENV] == "0,1"


# ---- vLLM's helpers compile with hpu_backend, not Inductor -------------------------


def _double_plus_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_simple_compile_backend_runs_on_hpu(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    fake = gaudi_process(FakeGaudiHost(), "worker")
    reject_inductor(monkeypatch)
    torch._dynamo.reset()
    try:
        fn = torch.compile(
            _double_plus_one, backend=HpuMMPlatform.simple_compile_backend
        )
        assert torch.equal(fn(torch.arange(4.0)), torch.arange(4.0) * 2 + 1)
        assert fake.calls == ["compile"]
        # What the same call with Inductor meets on a Gaudi host.
        inductor = torch.compile(_double_plus_one, backend="inductor")
        with pytest.raises(Exception, match="Device hpu not supported"):
            inductor(torch.arange(5.0))
    finally:
        torch._dynamo.reset()


def test_simple_compile_backend_elsewhere_is_inductor() -> None:
    assert CpuMMPlatform.simple_compile_backend == "inductor"


# ---- spawn for HPU workers ---------------------------------------------------------


def test_hpu_workers_are_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.utils.system_utils import get_mp_context

    monkeypatch.setenv(MULTIPROC_METHOD_ENV, "x")
    monkeypatch.delenv(MULTIPROC_METHOD_ENV)  # restored to unset afterwards
    _set_worker_start_method("hpu")
    assert get_mp_context().get_start_method() == "spawn"


def test_explicit_fork_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MULTIPROC_METHOD_ENV, "fork")
    _set_worker_start_method("hpu")
    assert os.environ[MULTIPROC_METHOD_ENV] == "fork"


def test_cpu_workers_keep_vllms_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MULTIPROC_METHOD_ENV, "x")
    monkeypatch.delenv(MULTIPROC_METHOD_ENV)
    _set_worker_start_method("cpu")
    assert MULTIPROC_METHOD_ENV not in os.environ


# ---- lazy mode ---------------------------------------------------------------------


def _cfg(enforce_eager: bool = False) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=enforce_eager))


def test_compile_is_refused_under_lazy_mode(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    monkeypatch.setenv(LAZY_ENV, "1")  # before habana_frameworks.torch loads
    gaudi_process(FakeGaudiHost(), "api-server")
    assert device.is_lazy_mode()
    for given in ("auto", "compile"):
        with pytest.raises(UnsupportedConfigError) as info:
            _check_lazy_mode(HpuMMConfig(graph_mode=given), _cfg(), "hpu")
        msg = str(info.value)
        assert f"given {given!r}" in msg and "PT_HPU_LAZY_MODE=1" in msg
        assert "PT_HPU_LAZY_MODE=0" in msg and "--enforce-eager" in msg
    # Eager execution is fine in lazy mode.
    _check_lazy_mode(HpuMMConfig(graph_mode="eager"), _cfg(), "hpu")
    _check_lazy_mode(HpuMMConfig(graph_mode="auto"), _cfg(enforce_eager=True), "hpu")


def test_the_fake_bridge_refuses_compile_in_lazy_mode(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    monkeypatch.setenv(LAZY_ENV, "1")
    gaudi_process(FakeGaudiHost(), "worker")
    torch._dynamo.reset()
    try:
        fn = torch.compile(_double_plus_one, backend=device.compile_backend())
        with pytest.raises(Exception, match="not supported in lazy mode"):
            fn(torch.arange(3.0))
    finally:
        torch._dynamo.reset()


def test_lazy_worker_runs_vllms_compiled_helpers_eagerly(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    import torch._dynamo.config as dynamo_config

    monkeypatch.setenv(LAZY_ENV, "1")
    fake = gaudi_process(FakeGaudiHost(), "worker")
    torch._dynamo.reset()
    with dynamo_config.patch(disable=False):  # restored on exit
        device.claim_device(0)
        assert dynamo_config.disable is True
        # as vLLM's @torch.compile(backend=current_platform.simple_compile_backend)
        backend = HpuMMPlatform.simple_compile_backend
        fn = torch.compile(_double_plus_one, backend=backend)
        assert torch.equal(fn(torch.arange(3.0)), torch.arange(3.0) * 2 + 1)
        assert fake.calls == []  # never reached the backend
    torch._dynamo.reset()


def test_eager_worker_keeps_dynamo(gaudi_process: GaudiProcess) -> None:
    import torch._dynamo.config as dynamo_config

    gaudi_process(FakeGaudiHost(), "worker")
    with dynamo_config.patch(disable=False):
        device.claim_device(0)
        assert dynamo_config.disable is False


def test_compile_is_accepted_in_eager_mode(gaudi_process: GaudiProcess) -> None:
    gaudi_process(FakeGaudiHost(), "api-server")  # PT_HPU_LAZY_MODE unset: eager
    assert not device.is_lazy_mode()
    _check_lazy_mode(HpuMMConfig(graph_mode="compile"), _cfg(), "hpu")


# ---- the HF baseline follows the bridge's mode ---------------------------------------


class _Model:
    def to(self, where: str) -> _Model:
        self.where = where
        return self


@pytest.mark.parametrize("lazy", ["0", "1"])
def test_hf_generate_kwargs_match_the_mode(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess, lazy: str
) -> None:
    monkeypatch.setenv(LAZY_ENV, lazy)
    fake = gaudi_process(FakeGaudiHost(), "bench")
    kwargs = device.hf_generate_kwargs()
    check_gaudi_generate_kwargs(kwargs)  # optimum-habana's own check
    assert kwargs == {"lazy_mode": lazy == "1", "hpu_graphs": lazy == "1"}
    model = device.hf_model_to_device(_Model())
    assert model.where == "hpu"
    assert fake.calls == (["wrap_in_hpu_graph"] if lazy == "1" else [])


def test_optimum_check_refuses_graphs_without_lazy_mode() -> None:
    with pytest.raises(ValueError, match="HPU graphs require `lazy_mode`"):
        check_gaudi_generate_kwargs({"lazy_mode": False, "hpu_graphs": True})


def test_data_parallel_engines_take_distinct_modules(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    """--data-parallel-size 2 x --tensor-parallel-size 2 on one node: the
    worker's host-local index is vLLM's own ``get_local_gpu_index`` (the local
    rank offset by the DP engine), out of TP x local DP workers, as
    ``HpuMMWorker.init_device`` passes them; the four workers take the four
    listed modules, each once."""
    cards = {}
    for dp_rank in (1, 0):
        pc = ParallelConfig(
            tensor_parallel_size=2,
            data_parallel_size=2,
            data_parallel_rank=dp_rank,
            data_parallel_rank_local=dp_rank,
            data_parallel_size_local=2,
        )
        for local_rank in (0, 1):
            monkeypatch.setenv(VISIBLE_MODULES_ENV, "4,5,6,7")
            fake = gaudi_process(FakeGaudiHost(modules=(4, 5, 6, 7)), "worker")
            device.claim_device(
                pc.get_local_gpu_index(local_rank),
                pc.local_world_size * pc.data_parallel_size_local,
            )
            device.synchronize()
            cards[(dp_rank, local_rank)] = fake.hpu.card
    assert cards == {(0, 0): 4, (0, 1): 5, (1, 0): 6, (1, 1): 7}


def test_pipeline_and_tensor_parallel_workers_take_distinct_modules(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    """--tensor-parallel-size 2 x --pipeline-parallel-size 2 with the
    multiprocessing executor on one node: vLLM numbers the workers stage by
    stage (rank = stage x TP + TP rank, the local rank on one node), and each
    takes the listed module at its host-local index, as
    ``HpuMMWorker.init_device`` passes it: stage 0 on modules 4 and 5, stage 1
    on 6 and 7."""
    pc = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert pc.world_size == pc.local_world_size == 4
    cards = {}
    for stage in (1, 0):
        for tp_rank in (0, 1):
            local_rank = stage * pc.tensor_parallel_size + tp_rank
            monkeypatch.setenv(VISIBLE_MODULES_ENV, "4,5,6,7")
            fake = gaudi_process(FakeGaudiHost(modules=(4, 5, 6, 7)), "worker")
            device.claim_device(
                pc.get_local_gpu_index(local_rank),
                pc.local_world_size * pc.data_parallel_size_local,
            )
            device.synchronize()
            cards[(stage, tp_rank)] = fake.hpu.card
    assert cards == {(0, 0): 4, (0, 1): 5, (1, 0): 6, (1, 1): 7}


def test_ray_pipeline_workers_keep_the_module_ray_gives_them(
    monkeypatch: pytest.MonkeyPatch, gaudi_process: GaudiProcess
) -> None:
    """Over Ray, one stage a node: Ray lists one module per actor in
    ``HABANA_VISIBLE_MODULES``, and the worker keeps it whatever its index
    (the stage-1 workers on the second node have local ranks 0 and 1 there)."""
    pc = ParallelConfig(
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
    )
    for local_rank, module in ((0, 2), (1, 3)):
        monkeypatch.setenv(VISIBLE_MODULES_ENV, str(module))
        fake = gaudi_process(FakeGaudiHost(modules=(0, 1, 2, 3)), "worker")
        device.claim_device(pc.get_local_gpu_index(local_rank), pc.local_world_size)
        device.synchronize()
        assert fake.hpu.card == module
