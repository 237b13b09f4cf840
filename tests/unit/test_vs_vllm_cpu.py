"""benchmarks/vs_vllm_cpu.py without an engine: the commands it builds (parsed by
the real parsers), thread settings, requirement filtering, what it reads back
from each engine's report, and its tables."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vs_vllm_cpu.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vs_vllm_cpu_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def b() -> ModuleType:
    return _load()


# --- threads and binding ------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "expected"),
    [
        ([0], "0"),
        ([0, 1], "0-1"),
        ([3, 0, 1, 2, 5], "0-3,5"),
        ([1, 3, 4, 7], "1,3-4,7"),
    ],
)
def test_cpu_list(b: ModuleType, cpus: list[int], expected: str) -> None:
    assert b.cpu_list(cpus) == expected


def test_cpu_list_rejects_empty(b: ModuleType) -> None:
    with pytest.raises(ValueError, match="no CPUs"):
        b.cpu_list([])


def test_every_engine_gets_the_same_threads(b: ModuleType) -> None:
    ours = b.thread_env(2)
    theirs = b.vllm_cpu_env(2, (0, 1, 2, 3), "all", 3)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        assert ours[key] == theirs[key] == "2"
    assert theirs["VLLM_TARGET_DEVICE"] == "cpu"
    assert theirs["VLLM_CPU_KVCACHE_SPACE"] == "3"
    # bound to as many CPUs as threads (vLLM sets OMP_NUM_THREADS from the list)
    assert theirs["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert (
        b.vllm_cpu_env(2, (4, 6), "nobind", 1)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    )


def test_vllm_cpu_env_rejects_more_threads_than_cpus(b: ModuleType) -> None:
    with pytest.raises(ValueError, match="3 threads but only 2 CPUs"):
        b.vllm_cpu_env(3, (0, 1), "all", 1)
    with pytest.raises(ValueError, match="bind must be"):
        b.vllm_cpu_env(1, (0, 1), "auto", 1)


# --- workloads ----------------------------------------------------------------------


def test_scaling_grid(b: ModuleType) -> None:
    base = b.Workload(num_warmups=4, output_len=64, max_num_batched_tokens=2048)
    grid = b.scaling_workloads(base, [128, 512, 1024], [8, 32])
    assert [(w.input_len, w.max_num_seqs, w.num_prompts) for w in grid] == [
        (128, 8, 16),
        (128, 32, 64),
        (512, 8, 16),
        (512, 32, 64),
        (1024, 8, 16),
        (1024, 32, 64),
    ]
    assert {w.output_len for w in grid} == {64}
    assert {w.max_num_batched_tokens for w in grid} == {2048}
    assert grid[-1].max_model_len == 1024 + 64
    fixed = b.scaling_workloads(base, [128], [2], num_prompts=5)
    assert (fixed[0].num_prompts, fixed[0].num_warmups) == (5, 2)  # warm-ups <= batch


# --- commands, parsed by the real parsers -------------------------------------------


def test_ours_command_parses_with_the_bench_cli(b: ModuleType, tmp_path: Path) -> None:
    from vllm_hpu_mm.bench.cli import build_parser

    w = b.Workload(num_prompts=64, input_len=256, output_len=64, max_num_seqs=32)
    out = tmp_path / "o.json"
    for eager, with_hf in ((False, True), (True, False)):
        cmd = b.ours_command(
            Path("py"), w, Path("m"), out, 2, eager=eager, with_hf=with_hf
        )
        assert cmd[1].endswith("benchmarks/throughput.py")
        args = build_parser().parse_args(cmd[2:])
        assert args.backend == ("both" if with_hf else "vllm-hpu-mm")
        assert args.enforce_eager is eager
        assert (args.num_prompts, args.input_len, args.output_len) == (64, 256, 64)
        assert (args.max_num_seqs, args.max_num_batched_tokens) == (32, 2048)
        assert args.max_model_len == 320
        assert args.hf_max_batch_size == 32
        assert args.dtype == "bfloat16"
        assert args.kv_cache_memory_bytes == 2 * 2**30
        assert args.num_warmups == w.num_warmups and args.seed == w.seed
        assert args.output_json == out


def test_vllm_cpu_command_parses_with_vllms_bench_parser(
    b: ModuleType, tmp_path: Path
) -> None:
    """The installed vLLM's own ``bench throughput`` parser (same flags as
    the CPU wheel's release)."""
    from vllm.benchmarks.throughput import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    w = b.Workload(num_prompts=16, input_len=512, output_len=64, max_num_seqs=8)
    out = tmp_path / "v.json"
    for eager in (True, False):
        cmd = b.vllm_cpu_command(Path("py"), w, Path("m"), out, 3, eager)
        assert cmd[1] == "-c" and cmd[3:5] == ["bench", "throughput"]
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args(cmd[5:])
        assert args.enforce_eager is eager
        assert (args.num_prompts, args.num_warmups) == (16, w.num_warmups)
        assert (args.random_input_len, args.random_output_len) == (512, 64)
        assert (args.max_num_seqs, args.max_num_batched_tokens) == (8, 2048)
        assert args.max_model_len == 576
        assert args.kv_cache_memory_bytes == 3 * 2**30
        assert args.output_json == str(out)


def test_launcher_is_python(b: ModuleType) -> None:
    compile(b.VLLM_LAUNCHER, "<launcher>", "exec")  # a SyntaxError fails the test
    assert f'os.environ.get("{b.PROMPTS_ENV}")' in b.VLLM_LAUNCHER
    assert b.STARTUP_MARK in b.VLLM_LAUNCHER
    assert "from vllm.entrypoints.cli.main import main" in b.VLLM_LAUNCHER


def test_prompts_payload_splits_warmups(b: ModuleType) -> None:
    pairs = [([1, 2], 3), ([4], 5), ([6, 7, 8], 9)]
    payload = b.prompts_payload(pairs, 1, 7)
    assert payload == {
        "seed": 7,
        "warmups": [[[1, 2], 3]],
        "requests": [[[4], 5], [[6, 7, 8], 9]],
    }
    json.dumps(payload)  # what the launcher reads


# --- requirements and stamps --------------------------------------------------------


def test_runtime_requirements(b: ModuleType) -> None:
    requires = [
        "regex",
        "torch==2.13.0+cpu; platform_machine == 'x86_64' or platform_system == 'Linux'",
        "torch==2.13.0; platform_system == 'Darwin'",
        "torchvision; platform_machine != 'riscv64'",
        "TorchAudio",
        "torchcodec>=0.14",
        "six>=1.16.0; python_version > '3.11' and python_version < '3.0'",
        "fastapi[standard]<0.137.0,>=0.133.0",
        "pandas; extra == 'bench'",
        "numba==0.65.0",
    ]
    assert b.runtime_requirements(requires) == [
        "regex",
        "fastapi[standard]<0.137.0,>=0.133.0",
        "numba==0.65.0",
    ]
    kept = b.runtime_requirements(["torchvision", "einops"], skipped=["einops"])
    assert kept == ["torchvision"]


def test_stamp_matches(b: ModuleType, tmp_path: Path) -> None:
    stamp = tmp_path / "s.json"
    assert not b.stamp_matches(stamp, b.venv_stamp())  # missing
    stamp.write_text("{not json")
    assert not b.stamp_matches(stamp, b.venv_stamp())
    stamp.write_text(json.dumps(b.venv_stamp()))
    assert b.stamp_matches(stamp, b.venv_stamp())
    stamp.write_text(json.dumps({**b.venv_stamp(), "vllm_cpu": "0.31.0"}))
    assert not b.stamp_matches(stamp, b.venv_stamp())


def test_model_stamp_names_the_config(b: ModuleType) -> None:
    cfg = b.model_stamp()["config"]
    assert cfg["head_dim"] == 64  # vLLM's CPU attention has no head_dim 16
    assert cfg["hidden_size"] == cfg["num_attention_heads"] * cfg["head_dim"]
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0


# --- reading the engines' reports ---------------------------------------------------

VLLM_LOG = """\
(EngineCore pid=1) INFO 12-01 09:31:03 [core.py:402] init engine (profile, create kv \
cache, warmup model) took 10.15 s
vs_vllm_cpu: engine start took 31.50 s
Throughput: 0.62 requests/s, 178.93 total tokens/s, 19.88 output tokens/s
Total num prompt tokens:  4096
Total num output tokens:  512
"""


def test_parse_vllm_log(b: ModuleType) -> None:
    assert b.parse_vllm_log(VLLM_LOG) == {
        "startup_s": 31.5,
        "init_s": 10.15,
        "prompt_tokens": 4096,
        "output_tokens": 512,
    }
    compiled = (
        "init engine (profile, create kv cache, warmup model) took 69.64 s "
        "(compilation: 41.20 s)"
    )
    assert b.parse_vllm_log(compiled) == {"init_s": 69.64, "compile_s": 41.2}
    assert b.parse_vllm_log("nothing") == {}


def test_vllm_cpu_row(b: ModuleType) -> None:
    w = b.Workload(num_prompts=16, input_len=256, output_len=32)
    data = {
        "elapsed_time": 25.6,
        "num_requests": 16,
        "total_num_tokens": 4608,
        "requests_per_second": 16 / 25.6,
        "tokens_per_second": 4608 / 25.6,
    }
    row = b.vllm_cpu_row(data, VLLM_LOG, w)
    assert row.engine == b.VLLM_CPU
    assert row.output_tokens_per_s == pytest.approx(512 / 25.6)
    assert (row.prompt_tokens, row.output_tokens) == (4096, 512)
    assert (row.startup_s, row.warmup_s) == (31.5, 10.15)
    assert b.token_mismatches([row], w) == []
    # without the log's counts: the output from the workload, the rest is prompt
    bare = b.vllm_cpu_row(data, "", w)
    assert (bare.prompt_tokens, bare.output_tokens, bare.startup_s) == (4096, 512, None)
    eager = b.vllm_cpu_row(data, VLLM_LOG, w, b.vllm_cpu_name("eager"))
    assert eager.engine == b.VLLM_CPU_EAGER != b.VLLM_CPU == b.vllm_cpu_name("compile")
    assert "(eager)" in b.VLLM_CPU_EAGER and "(compile)" in b.VLLM_CPU


def test_vllm_cpu_modes_flag(b: ModuleType) -> None:
    """Both of vLLM CPU's modes by default, compile first (the scaling table's);
    a subset or another order on request; unknown or repeated modes refused."""
    parse = b.build_parser().parse_args
    assert parse([]).vllm_cpu_modes == ["compile", "eager"]
    assert parse(["--vllm-cpu-modes", "eager"]).vllm_cpu_modes == ["eager"]
    assert parse(["--vllm-cpu-modes", "eager,compile"]).vllm_cpu_modes == [
        "eager",
        "compile",
    ]
    for bad in ("fast", "eager,eager", ""):
        with pytest.raises(SystemExit):
            parse(["--vllm-cpu-modes", bad])


def _our_report(elapsed: dict[str, float]) -> dict[str, Any]:
    """A real report of ``vllm-hpu-mm bench throughput`` (its own builder)."""
    from vllm_hpu_mm.bench.stats import RequestRecord, backend_result, build_report

    records = [RequestRecord(256, 0, 64, 0.5, 0.01, 1.0) for _ in range(4)]
    extra = {"startup_s": 12.0, "warmup_s": 7.5}
    results = [
        backend_result("vllm-hpu-mm", records, elapsed["vllm-hpu-mm"], extra),
        backend_result("hf", records, elapsed["hf"]),
    ]
    return build_report({"command": "x"}, results)


def test_ours_rows(b: ModuleType) -> None:
    rows = b.ours_rows(_our_report({"vllm-hpu-mm": 2.0, "hf": 4.0}), b.OURS_GRAPH)
    ours, hf = rows
    assert (ours.engine, hf.engine) == (b.OURS_GRAPH, b.HF_NAME)
    assert ours.requests_per_s == pytest.approx(2.0)
    assert ours.output_tokens_per_s == pytest.approx(128.0)
    assert (ours.startup_s, ours.warmup_s) == (12.0, 7.5)
    assert hf.requests_per_s == pytest.approx(1.0)
    assert (hf.startup_s, hf.warmup_s) == (None, None)
    assert b.token_mismatches(rows, b.Workload(num_prompts=4)) == []
    problems = b.token_mismatches(rows, b.Workload(num_prompts=4, output_len=32))
    assert len(problems) == 2 and "expected 1024 + 128" in problems[0]


# --- tables -------------------------------------------------------------------------


def _row(b: ModuleType, engine: str, rps: float, **kw: Any) -> Any:
    return b.Row(engine, rps, 64 * rps, 320 * rps, 256, 64, 1 / rps, **kw)


def test_main_table_ratios(b: ModuleType) -> None:
    rows = [
        _row(b, b.OURS_GRAPH, 0.8, startup_s=90.0, warmup_s=83.0),
        _row(b, b.HF_NAME, 2.0),
        _row(b, b.VLLM_CPU, 6.0, startup_s=30.0, warmup_s=10.0),
    ]
    lines = b.main_table(rows).splitlines()
    assert lines[0].startswith("| engine | requests/s | output tok/s | vs ")
    assert lines[2] == f"| {b.OURS_GRAPH} | 0.80 | 51.2 | 1.00x | 90.0 | 83.0 |"
    assert lines[3] == f"| {b.HF_NAME} | 2.00 | 128.0 | 2.50x | - | - |"
    assert lines[4] == f"| {b.VLLM_CPU} | 6.00 | 384.0 | 7.50x | 30.0 | 10.0 |"
    # no baseline row (it failed): no ratios
    assert "| - |" in b.main_table(rows[1:]).splitlines()[2]


def test_scaling_table(b: ModuleType) -> None:
    points = [
        b.ScalingPoint(
            128, 8, 16, _row(b, b.OURS_GRAPH, 1.0), _row(b, b.VLLM_CPU, 4.0)
        ),
        b.ScalingPoint(512, 8, 16, None, _row(b, b.VLLM_CPU, 2.0)),
    ]
    lines = b.scaling_table(points).splitlines()
    assert lines[2] == "| 128 | 8 | 16 | 64.0 | 256.0 | 0.25x |"
    assert lines[3] == "| 512 | 8 | 16 | - | 128.0 | - |"
    with_hf = [
        b.ScalingPoint(
            128, 32, 64, _row(b, b.OURS_GRAPH, 1.0), None, _row(b, b.HF_NAME, 0.5)
        )
    ]
    lines = b.scaling_table(with_hf).splitlines()
    assert lines[0].endswith("| HF tok/s | ours / HF |")
    assert lines[2] == "| 128 | 32 | 64 | 64.0 | - | - | 32.0 | 2.00x |"


def test_script_and_its_parts_stay_small() -> None:
    files = [SCRIPT, *sorted((ROOT / "benchmarks" / "vs_vllm_cpu_parts").glob("*.py"))]
    assert len(files) > 1
    lines = {f.name: len(f.read_text(encoding="utf-8").splitlines()) for f in files}
    assert max(lines.values()) <= 500, lines
