"""The tiny-model builder: plain ``save_pretrained`` output, the released layouts,
stamps, and the reload check that guards every build."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import MODELS_DIR
from tools import build_tiny_models as btm
from tools import tiny_model_specs as specs

# The published Llama-3.2-Vision layout (and what save_pretrained writes).
MLLAMA_PUBLISHED = (
    "language_model.model.",
    "language_model.lm_head.",
    "vision_model.",
    "multi_modal_projector.",
)


@pytest.fixture(scope="module")
def built() -> dict[str, Path]:
    return btm.build_tiny_models(MODELS_DIR)


def _tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for file in btm.weight_files(model_dir):
        out.update(load_file(str(file)))
    return out


def test_builders_are_not_in_the_installed_package() -> None:
    import importlib.util

    assert importlib.util.find_spec("vllm_hpu_mm.tools.build_tiny_models") is None
    assert importlib.util.find_spec("vllm_hpu_mm.tools.tiny_model_specs") is None
    assert Path(btm.__file__).parent.name == "tools"  # the repository's tools/


def test_every_spec_is_built_and_stamped(built: dict[str, Path]) -> None:
    assert set(built) == {s.name for s in specs.SPECS}
    for name, model_dir in built.items():
        stamp = json.loads((model_dir / btm.STAMP_FILE).read_text())
        assert stamp == btm.stamp(btm.model_specs()[name])
        assert btm.is_built(model_dir, btm.model_specs()[name])


def test_a_second_build_keeps_the_files(built: dict[str, Path]) -> None:
    weights = built["tiny-llama"] / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert btm.build_tiny_model(MODELS_DIR, "tiny-llama") == built["tiny-llama"]
    assert weights.stat().st_mtime_ns == before


def test_a_stale_stamp_rebuilds(tmp_path: Path) -> None:
    spec = btm.model_specs()["tiny-llama"]
    model_dir = btm.build_tiny_model(tmp_path, "tiny-llama")
    stale = {**btm.stamp(spec), "model_version": spec.version - 1}
    (model_dir / btm.STAMP_FILE).write_text(json.dumps(stale))
    assert not btm.is_built(model_dir, spec)
    btm.build_tiny_model(tmp_path, "tiny-llama")
    assert btm.is_built(model_dir, spec)


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-idefics3", "tiny-mllama"])
def test_checkpoint_is_what_save_pretrained_writes(
    built: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """No renaming of our own: a fresh save_pretrained has the same tensors."""
    import torch

    _, model = btm.init_model(btm.model_specs()[name])
    model.save_pretrained(tmp_path)
    want, got = _tensors(tmp_path), _tensors(built[name])
    assert set(want) == set(got)
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_mllama_is_saved_in_the_published_layout(built: dict[str, Path]) -> None:
    names = btm.checkpoint_names(built["tiny-mllama"])
    assert all(n.startswith(MLLAMA_PUBLISHED) for n in names)
    assert all(any(n.startswith(p) for n in names) for p in MLLAMA_PUBLISHED)
    assert "language_model.lm_head.weight" in names


def test_llava_layouts(built: dict[str, Path]) -> None:
    """save_pretrained: a flat CLIP tower; released: ``vision_tower.vision_model``."""
    import torch

    flat = _tensors(built["tiny-llava"])
    released = _tensors(built["tiny-llava-released"])
    assert "vision_tower.embeddings.patch_embedding.weight" in flat
    assert not any(n.startswith("vision_tower.vision_model.") for n in flat)
    renamed = {
        n.replace("vision_tower.", "vision_tower.vision_model.", 1): t
        for n, t in flat.items()
    }
    assert set(renamed) == set(released)
    assert all(torch.equal(renamed[n], released[n]) for n in released)


def test_idefics3_module_names_are_its_layout(built: dict[str, Path]) -> None:
    prefixes = ("model.vision_model.", "model.connector.", "model.text_model.")
    names = btm.checkpoint_names(built["tiny-idefics3"])
    assert all(n.startswith((*prefixes, "lm_head.")) for n in names)


def test_convert_layout_renames_shards_and_index(tmp_path: Path) -> None:
    """A sharded save_pretrained checkpoint (as published ones are) converts
    whole, and transformers still loads it cleanly."""
    spec = btm.model_specs()["tiny-llava-released"]
    btm.save_tiny_model(spec, tmp_path, max_shard_size="100KB")
    files = btm.weight_files(tmp_path)
    assert len(files) > 1
    index = json.loads((tmp_path / btm.INDEX_FILE).read_text())["weight_map"]
    assert sorted(index) == btm.checkpoint_names(tmp_path)
    assert any(n.startswith("vision_tower.vision_model.") for n in index)
    assert not any(
        n.startswith("vision_tower.") and ".vision_model." not in n for n in index
    )


def test_verify_rejects_a_checkpoint_transformers_does_not_load(tmp_path: Path) -> None:
    spec = btm.model_specs()["tiny-llama"]
    btm.save_tiny_model(spec, tmp_path)
    _, model = btm.init_model(spec)
    btm.convert_layout(tmp_path, (("model.norm.", "model.final_norm."),))
    with pytest.raises(AssertionError, match="did not load cleanly"):
        btm.verify(tmp_path, spec, model)


def test_unknown_model_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model 'tiny-nope'"):
        btm.build_tiny_model(tmp_path, "tiny-nope")


def test_cli_builds_only_what_it_is_asked(tmp_path: Path) -> None:
    assert btm.main(["--out", str(tmp_path), "--only", "tiny-mistral"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-mistral"]
