"""The real-weights model builder: finds the pinned GGUF file, recognises a
complete build (so ``make models`` is a no-op the second time), nothing more
(the conversion itself runs in ``make models`` and tests/e2e/test_real_model.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import real_model


def test_gguf_file_comes_from_the_pinned_package() -> None:
    path = real_model.gguf_path()
    assert path.name == real_model.GGUF_FILE
    assert path.stat().st_size > 80_000_000  # the 93 MB Q4_1 file, not a pointer


def test_a_stamped_build_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = tmp_path / real_model.NAME
    assert not real_model.is_built(model_dir)
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert not real_model.is_built(model_dir)  # no stamp: an interrupted build
    (model_dir / real_model.STAMP_FILE).write_text(json.dumps(real_model.stamp()))
    assert real_model.is_built(model_dir)
    assert real_model.build_real_model(tmp_path) == model_dir
    assert "exists" in capsys.readouterr().out
    (model_dir / real_model.STAMP_FILE).write_text(
        json.dumps({**real_model.stamp(), "build_version": 0})
    )
    assert not real_model.is_built(model_dir)  # older steps: rebuilt
