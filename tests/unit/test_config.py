"""vllm_hpu_mm.config: defaults, sources and precedence, every error, round trips."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from vllm_hpu_mm.config import (
    CONFIGS_DIR,
    BucketingConfig,
    ConfigError,
    ExplicitBuckets,
    HpuMMConfig,
    MemoryConfig,
    WarmupConfig,
    describe_keys,
    load_explicit_buckets,
    load_plugin_config,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_BUCKETS = REPO / "configs" / "buckets-example.yaml"


def inline(**hpu_mm: Any) -> HpuMMConfig:
    return HpuMMConfig.from_additional_config({"hpu_mm": hpu_mm})


def error_of(**hpu_mm: Any) -> str:
    with pytest.raises(ConfigError) as info:
        inline(**hpu_mm)
    return str(info.value)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------
# Defaults and inline values
# --------------------------------------------------------------------------


def test_defaults() -> None:
    cfg = HpuMMConfig()
    assert cfg.graph_mode == "auto"
    assert cfg.config_file is None
    assert cfg.bucketing == BucketingConfig()
    assert cfg.bucketing.strategy == "prior"
    assert cfg.bucketing.file is None
    assert cfg.bucketing.buckets is None
    assert cfg.bucketing.prefill_min_tokens == 32
    assert cfg.bucketing.prefill_step_tokens == 128
    assert cfg.bucketing.decode_min_batch == 1
    assert cfg.bucketing.decode_step_batch == 8
    assert cfg.bucketing.block_step == 16
    assert cfg.bucketing.fallback_max_pad_ratio == 2.0
    assert cfg.warmup == WarmupConfig(skip=False, progress_bar=True)
    assert cfg.memory == MemoryConfig(graph_reserve_fraction=0.10)


@pytest.mark.parametrize(
    "additional_config",
    [None, {}, {"hpu_mm": None}, {"hpu_mm": {}}, {"other_plugin": {"x": 1}}, object()],
)
def test_no_settings_give_defaults(additional_config: Any) -> None:
    assert HpuMMConfig.from_additional_config(additional_config) == HpuMMConfig()


def test_inline_overrides() -> None:
    cfg = HpuMMConfig.from_additional_config(
        {
            "hpu_mm": {
                "graph_mode": "eager",
                "warmup": {"skip": True},
                "bucketing": {"strategy": "linear", "block_step": 32},
                "memory": {"graph_reserve_fraction": 0.25},
            },
            "gdn_prefill_backend": "ignored: belongs to vLLM",
        }
    )
    assert cfg.graph_mode == "eager"
    assert cfg.warmup.skip is True
    assert cfg.warmup.progress_bar is True  # untouched sibling keeps its default
    assert cfg.bucketing.strategy == "linear"
    assert cfg.bucketing.block_step == 32
    assert cfg.bucketing.prefill_min_tokens == 32
    assert cfg.memory.graph_reserve_fraction == 0.25


def test_int_accepted_for_float() -> None:
    cfg = inline(bucketing={"fallback_max_pad_ratio": 3})
    assert cfg.bucketing.fallback_max_pad_ratio == 3.0
    assert isinstance(cfg.bucketing.fallback_max_pad_ratio, float)


def test_load_plugin_config_reads_vllm_config_and_caches_nothing() -> None:
    eager = SimpleNamespace(additional_config={"hpu_mm": {"graph_mode": "eager"}})
    comp = SimpleNamespace(additional_config={"hpu_mm": {"graph_mode": "compile"}})
    assert load_plugin_config(eager).graph_mode == "eager"
    assert load_plugin_config(comp).graph_mode == "compile"
    assert load_plugin_config(SimpleNamespace(additional_config=None)) == HpuMMConfig()
    assert load_plugin_config(object()) == HpuMMConfig()


def test_frozen() -> None:
    cfg = HpuMMConfig()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.graph_mode = "eager"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        cfg.bucketing.block_step = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        cfg.new_attribute = 1  # type: ignore[attr-defined]
    assert hash(cfg) == hash(HpuMMConfig())


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError, match=r"hpu_mm\.graph_mode = 'bogus'") as info:
        HpuMMConfig(graph_mode="bogus")  # type: ignore[arg-type]
    assert "set in Python code" in str(info.value)
    with pytest.raises(ConfigError, match=r"hpu_mm\.warmup\.skip"):
        WarmupConfig().replace(skip="no")
    with pytest.raises(ConfigError, match=r"hpu_mm\.bucketing\.strategy = 'expo'"):
        HpuMMConfig(bucketing={"strategy": "expo"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"hpu_mm\.bucketing = \[\] .* mapping"):
        HpuMMConfig(bucketing=[])  # type: ignore[arg-type]


def test_module_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys, vllm_hpu_mm.config; "
        "bad = {'vllm', 'torch'} & {m.split('.')[0] for m in sys.modules}; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# --------------------------------------------------------------------------
# Config files and precedence
# --------------------------------------------------------------------------


def test_file_then_inline_precedence(tmp_path: Path) -> None:
    path = write(
        tmp_path / "mine.yaml",
        "graph_mode: compile\n"
        "bucketing:\n  strategy: linear\n  block_step: 64\n"
        "warmup:\n  skip: true\n",
    )
    cfg = inline(
        config_file=str(path),
        graph_mode="eager",
        bucketing={"block_step": 8},
    )
    assert cfg.graph_mode == "eager"  # inline wins
    assert cfg.bucketing.block_step == 8  # inline wins, key by key
    assert cfg.bucketing.strategy == "linear"  # from the file
    assert cfg.warmup.skip is True  # from the file
    assert cfg.config_file == str(path.resolve())


def test_relative_config_file_tries_cwd_then_configs_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    from_repo = inline(config_file="default.yaml")
    assert from_repo.config_file == str((CONFIGS_DIR / "default.yaml").resolve())
    write(tmp_path / "default.yaml", "graph_mode: compile\n")
    from_cwd = inline(config_file="default.yaml")
    assert from_cwd.graph_mode == "compile"
    assert from_cwd.config_file == str((tmp_path / "default.yaml").resolve())


def test_default_yaml_spells_out_the_defaults() -> None:
    cfg = inline(config_file="default.yaml")
    assert cfg.replace(config_file=None) == HpuMMConfig()


def test_file_may_wrap_settings_in_hpu_mm_and_may_be_empty(tmp_path: Path) -> None:
    wrapped = write(tmp_path / "w.yaml", "hpu_mm:\n  graph_mode: eager\n")
    assert inline(config_file=str(wrapped)).graph_mode == "eager"
    empty = write(tmp_path / "e.yaml", "# nothing\n")
    assert inline(config_file=str(empty)).replace(config_file=None) == HpuMMConfig()


def test_yaml_booleans_are_yaml_1_2(tmp_path: Path) -> None:
    off = write(tmp_path / "off.yaml", "bucketing:\n  strategy: off\n")
    assert inline(config_file=str(off)).bucketing.strategy == "off"
    yes = write(tmp_path / "yes.yaml", "warmup:\n  skip: yes\n")
    with pytest.raises(ConfigError, match=r"hpu_mm\.warmup\.skip = 'yes'"):
        inline(config_file=str(yes))


def test_explicit_buckets_file() -> None:
    cfg = inline(bucketing={"strategy": "explicit", "file": "buckets-example.yaml"})
    assert cfg.bucketing.file == str(EXAMPLE_BUCKETS.resolve())
    buckets = cfg.bucketing.buckets
    assert isinstance(buckets, ExplicitBuckets)
    assert buckets == load_explicit_buckets(EXAMPLE_BUCKETS)
    for values in (buckets.prefill_tokens, buckets.decode_batch, buckets.blocks):
        assert values and list(values) == sorted(set(values))
        assert all(isinstance(v, int) and v > 0 for v in values)


def test_explicit_buckets_are_sorted_and_deduplicated(tmp_path: Path) -> None:
    path = write(
        tmp_path / "b.yaml",
        "prefill_tokens: [512, 128, 128]\ndecode_batch: [4, 1]\nblocks: [16]\n",
    )
    buckets = load_explicit_buckets(path)
    assert buckets.prefill_tokens == (128, 512)
    assert buckets.decode_batch == (1, 4)


def test_bucket_file_relative_to_the_config_file(tmp_path: Path) -> None:
    sub = tmp_path / "elsewhere"
    sub.mkdir()
    write(sub / "b.yaml", "prefill_tokens: [64]\ndecode_batch: [2]\nblocks: [8]\n")
    main = write(
        sub / "main.yaml", "bucketing:\n  strategy: explicit\n  file: b.yaml\n"
    )
    cfg = inline(config_file=str(main))
    assert cfg.bucketing.buckets is not None
    assert cfg.bucketing.buckets.prefill_tokens == (64,)


def test_file_ignored_unless_explicit(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm_hpu_mm.config"):
        cfg = inline(bucketing={"file": "does-not-matter.yaml"})
    assert cfg.bucketing.buckets is None
    assert "is ignored" in caplog.text


# --------------------------------------------------------------------------
# Errors: each kind names the key, the value, the source and what is allowed
# --------------------------------------------------------------------------


def test_bad_choice() -> None:
    msg = error_of(bucketing={"strategy": "expo"})
    assert (
        "hpu_mm.bucketing.strategy = 'expo' (from --additional-config) is not one "
        "of 'prior', 'exponential', 'linear', 'explicit', 'off'"
    ) in msg
    assert "did you mean 'exponential'?" in msg
    assert "how bucket sizes are generated" in msg  # the why


def test_bad_choice_of_wrong_type() -> None:
    msg = error_of(graph_mode=1)
    assert "hpu_mm.graph_mode = 1" in msg
    assert "is not one of 'auto', 'eager', 'compile'" in msg


def test_unknown_key_suggests() -> None:
    msg = error_of(bucketing={"stratgy": "linear"})
    assert "hpu_mm.bucketing.stratgy" in msg
    assert "(from --additional-config)" in msg
    assert "not a known key" in msg
    assert "did you mean 'strategy'?" in msg
    assert "Known keys of hpu_mm.bucketing: strategy, file" in msg


def test_unknown_key_without_close_match_lists_known_keys() -> None:
    msg = error_of(zzz=1)
    assert "hpu_mm.zzz" in msg and "did you mean" not in msg
    assert "graph_mode, execution, graph_attention, bucketing, warmup" in msg


def test_misspelled_root_key() -> None:
    with pytest.raises(ConfigError, match="did you mean 'hpu_mm'"):
        HpuMMConfig.from_additional_config({"hpu-mm": {"graph_mode": "eager"}})


@pytest.mark.parametrize(
    ("hpu_mm", "key", "allowed"),
    [
        ({"warmup": {"skip": 1}}, "hpu_mm.warmup.skip = 1", "true or false"),
        ({"warmup": {"skip": "true"}}, "hpu_mm.warmup.skip = 'true'", "true or false"),
        ({"bucketing": {"block_step": True}}, "block_step = True", "an integer"),
        ({"bucketing": {"block_step": 2.0}}, "block_step = 2.0", "an integer"),
        ({"bucketing": {"block_step": "16"}}, "block_step = '16'", "an integer"),
        (
            {"bucketing": {"fallback_max_pad_ratio": False}},
            "fallback_max_pad_ratio = False",
            "a number",
        ),
        ({"bucketing": {"file": 3}}, "hpu_mm.bucketing.file = 3", "a string or null"),
        ({"bucketing": []}, "hpu_mm.bucketing = []", "mapping"),
        ({"config_file": 5}, "hpu_mm.config_file = 5", "a string"),
    ],
)
def test_wrong_types(hpu_mm: dict[str, Any], key: str, allowed: str) -> None:
    msg = error_of(**hpu_mm)
    assert key in msg
    assert allowed in msg
    assert "(from --additional-config)" in msg


def test_bool_is_not_a_number_explained() -> None:
    assert "true/false is not a number" in error_of(bucketing={"block_step": False})
    assert "not a number" not in error_of(bucketing={"file": True})  # a string


def test_section_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"hpu_mm = \[1\] .* mapping"):
        HpuMMConfig.from_additional_config({"hpu_mm": [1]})


@pytest.mark.parametrize(
    "key",
    [
        "prefill_min_tokens",
        "prefill_step_tokens",
        "decode_min_batch",
        "decode_step_batch",
        "block_step",
    ],
)
def test_positive_ints(key: str) -> None:
    msg = error_of(bucketing={key: 0})
    assert f"hpu_mm.bucketing.{key} = 0 (from --additional-config)" in msg
    assert ">= 1" in msg


def test_pad_ratio_range_and_finiteness() -> None:
    assert ">= 1.0" in error_of(bucketing={"fallback_max_pad_ratio": 0.5})
    assert "finite" in error_of(bucketing={"fallback_max_pad_ratio": float("inf")})
    assert "finite" in error_of(bucketing={"fallback_max_pad_ratio": float("nan")})


def test_explicit_needs_file() -> None:
    msg = error_of(bucketing={"strategy": "explicit"})
    assert "hpu_mm.bucketing.strategy = 'explicit' (from --additional-config)" in msg
    assert "needs hpu_mm.bucketing.file" in msg


def test_explicit_file_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    msg = error_of(bucketing={"strategy": "explicit", "file": "nope.yaml"})
    assert "hpu_mm.bucketing.file = 'nope.yaml' (from --additional-config)" in msg
    assert str(tmp_path / "nope.yaml") in msg
    assert str(CONFIGS_DIR / "nope.yaml") in msg


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("prefill_tokens: [1\n", "not valid YAML"),
        ("- 1\n- 2\n", "mapping of bucket lists"),
        (
            "prefill_tokens: [64]\ndecode_batch: [1]\n",
            "missing required key(s): blocks",
        ),
        (
            "prefill_tokens: [64]\ndecode_batch: [1]\nblocks: [8]\nblock: [1]\n",
            "did you mean 'blocks'?",
        ),
        ("prefill_tokens: [0]\ndecode_batch: [1]\nblocks: [8]\n", "prefill_tokens = "),
        ("prefill_tokens: []\ndecode_batch: [1]\nblocks: [8]\n", "must not be empty"),
        ("prefill_tokens: 64\ndecode_batch: [1]\nblocks: [8]\n", "list of integers"),
        (
            "prefill_tokens: [64]\nprefill_tokens: [8]\n"
            "decode_batch: [1]\nblocks: [8]\n",
            "duplicate key 'prefill_tokens'",
        ),
    ],
)
def test_explicit_file_must_parse(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path / "buckets.yaml", text)
    msg = error_of(bucketing={"strategy": "explicit", "file": str(path)})
    assert expected in msg
    assert str(path) in msg or "hpu_mm.bucketing.file" in msg


def test_missing_config_file_names_paths_tried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    msg = error_of(config_file="missing.yaml")
    assert "hpu_mm.config_file = 'missing.yaml' (from --additional-config)" in msg
    assert "names no file; tried" in msg
    assert str(tmp_path / "missing.yaml") in msg
    assert str(CONFIGS_DIR / "missing.yaml") in msg


def test_errors_in_a_file_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.yaml", "bucketing:\n  block_step: -4\n")
    msg = error_of(config_file=str(path))
    assert f"hpu_mm.bucketing.block_step = -4 (from {path.resolve()})" in msg
    unknown = write(tmp_path / "unknown.yaml", "warmup:\n  skp: true\n")
    msg = error_of(config_file=str(unknown))
    assert f"hpu_mm.warmup.skp (from {unknown.resolve()})" in msg
    assert "did you mean 'skip'?" in msg


def test_inline_fix_overrides_a_bad_file_value(tmp_path: Path) -> None:
    path = write(tmp_path / "bad.yaml", "bucketing:\n  block_step: -4\n")
    assert (
        inline(config_file=str(path), bucketing={"block_step": 4}).bucketing.block_step
        == 4
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("graph_mode: [eager\n", "is not valid YAML"),
        ("- eager\n", "must hold a mapping of settings"),
        ("config_file: other.yaml\n", "config files do not nest"),
        ("graph_mode: a\ngraph_mode: b\n", "duplicate key 'graph_mode'"),
    ],
)
def test_bad_config_file(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path / "c.yaml", text)
    msg = error_of(config_file=str(path))
    assert "hpu_mm.config_file" in msg
    assert expected in msg


def test_error_is_a_value_error_with_key() -> None:
    with pytest.raises(ValueError) as info:
        inline(warmup={"progress_bar": "no"})
    assert isinstance(info.value, ConfigError)
    assert info.value.key == "hpu_mm.warmup.progress_bar"


# --------------------------------------------------------------------------
# Round trips, docs, properties
# --------------------------------------------------------------------------


def test_round_trip_defaults_and_examples(tmp_path: Path) -> None:
    for cfg in (
        HpuMMConfig(),
        inline(config_file="default.yaml", graph_mode="compile"),
        inline(bucketing={"strategy": "explicit", "file": "buckets-example.yaml"}),
    ):
        data = cfg.to_dict()
        again = HpuMMConfig.from_mapping(data, source="a test")
        assert again == cfg
        assert again.to_dict() == data
        assert again.bucketing.buckets == cfg.bucketing.buckets


def test_to_dict_is_plain() -> None:
    data = HpuMMConfig().to_dict()
    assert data["bucketing"]["strategy"] == "prior"
    assert data["warmup"] == {
        "skip": False,
        "progress_bar": True,
        "compile_backend": "auto",
        "compile_cache_dir": None,
    }
    assert "buckets" not in data["bucketing"]  # derived, not a setting


def test_docs_cover_every_key() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    keys = list(describe_keys())
    assert len(keys) == 24
    for info in keys:
        assert f"`{info.key}`" in doc, info.key
    for info in describe_keys(ExplicitBuckets):
        assert f"`{info.key}`" in doc, info.key


POSITIVE_INTS = [
    ("bucketing", "prefill_min_tokens"),
    ("bucketing", "prefill_step_tokens"),
    ("bucketing", "decode_min_batch"),
    ("bucketing", "decode_step_batch"),
    ("bucketing", "block_step"),
    ("bucketing", "vision_min_patches"),
]

positive = st.integers(min_value=1, max_value=1 << 20)
bucketing_dicts = st.fixed_dictionaries(
    {},
    optional={
        "strategy": st.sampled_from(["prior", "exponential", "linear", "off"]),
        "prefill_min_tokens": positive,
        "prefill_step_tokens": positive,
        "decode_min_batch": positive,
        "decode_step_batch": positive,
        "block_step": positive,
        "fallback_max_pad_ratio": st.one_of(
            st.integers(min_value=1, max_value=100),
            st.floats(min_value=1.0, max_value=1e6, allow_nan=False),
        ),
    },
) | st.just({"strategy": "explicit", "file": str(EXAMPLE_BUCKETS)})
hpu_mm_dicts = st.fixed_dictionaries(
    {},
    optional={
        "graph_mode": st.sampled_from(["auto", "eager", "compile"]),
        "bucketing": bucketing_dicts,
        "warmup": st.fixed_dictionaries(
            {}, optional={"skip": st.booleans(), "progress_bar": st.booleans()}
        ),
        "memory": st.fixed_dictionaries(
            {},
            optional={
                "graph_reserve_fraction": st.floats(min_value=0.0, max_value=0.9)
            },
        ),
    },
)


@settings(max_examples=200, deadline=None)
@given(hpu_mm_dicts)
def test_property_valid_dicts_round_trip(data: dict[str, Any]) -> None:
    cfg = HpuMMConfig.from_mapping(data, source="hypothesis")
    again = HpuMMConfig.from_mapping(cfg.to_dict(), source="round trip")
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    for section, values in data.items():  # every given value was kept
        if isinstance(values, dict):
            for name, value in values.items():
                got = getattr(getattr(cfg, section), name)
                assert got == value or name == "file"
        else:
            assert getattr(cfg, section) == values


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(POSITIVE_INTS), st.integers(max_value=0))
def test_property_non_positive_ints_are_rejected(
    where: tuple[str | None, str], value: int
) -> None:
    section, name = where
    data: dict[str, Any] = {section: {name: value}} if section else {name: value}
    key = f"hpu_mm.{section}.{name}" if section else f"hpu_mm.{name}"
    with pytest.raises(ConfigError) as info:
        HpuMMConfig.from_mapping(data, source="hypothesis")
    assert f"{key} = {value} (from hypothesis)" in str(info.value)
    assert ">= 1" in str(info.value)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(POSITIVE_INTS),
    st.one_of(st.booleans(), st.text(max_size=5), st.floats(), st.none()),
)
def test_property_non_ints_are_rejected(
    where: tuple[str | None, str], value: Any
) -> None:
    section, name = where
    data: dict[str, Any] = {section: {name: value}} if section else {name: value}
    with pytest.raises(ConfigError, match="must be an integer"):
        HpuMMConfig.from_mapping(data, source="hypothesis")


# --------------------------------------------------------------------------
# Settings that changed: refused graph mode, removed key, the new memory key
# --------------------------------------------------------------------------


def test_captured_graphs_are_refused_at_validation(tmp_path: Path) -> None:
    msg = error_of(graph_mode="graphs")
    assert "hpu_mm.graph_mode = 'graphs' (from --additional-config)" in msg
    assert "not implemented" in msg  # why
    assert "Allowed: 'auto', 'eager', 'compile'" in msg  # what is allowed
    path = write(tmp_path / "g.yaml", "graph_mode: graphs\n")
    assert f"(from {path.resolve()})" in error_of(config_file=str(path))
    with pytest.raises(ConfigError, match="not implemented"):
        HpuMMConfig(graph_mode="graphs")  # type: ignore[arg-type]


def test_removed_encoder_cache_key_says_why() -> None:
    msg = error_of(mm_encoder_cache_items=64)
    assert "hpu_mm.mm_encoder_cache_items (from --additional-config)" in msg
    assert "removed" in msg and "scheduler" in msg


def test_removed_pixel_limit_key_names_vllms_variable() -> None:
    msg = error_of(mm_max_image_pixels=1024)
    assert "hpu_mm.mm_max_image_pixels (from --additional-config)" in msg
    assert "removed" in msg and "VLLM_MAX_IMAGE_PIXELS" in msg


@pytest.mark.parametrize(
    ("value", "expected"),
    [(-0.1, ">= 0.0"), (0.95, "<= 0.9"), (float("nan"), "finite"), ("0.1", "number")],
)
def test_graph_reserve_fraction_range(value: Any, expected: str) -> None:
    msg = error_of(memory={"graph_reserve_fraction": value})
    assert f"hpu_mm.memory.graph_reserve_fraction = {value!r}" in msg
    assert expected in msg


def test_graph_reserve_fraction_bounds_are_inclusive() -> None:
    assert (
        inline(memory={"graph_reserve_fraction": 0}).memory.graph_reserve_fraction == 0
    )
    assert inline(memory={"graph_reserve_fraction": 0.9}).memory == MemoryConfig(
        graph_reserve_fraction=0.9
    )


def test_committed_docs_are_the_generated_ones() -> None:
    from vllm_hpu_mm.tools import gen_config_docs

    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    stale = "docs/configuration.md is stale: run the generator"
    assert committed == gen_config_docs.render(), stale
    assert gen_config_docs.main(["--check"]) == 0
