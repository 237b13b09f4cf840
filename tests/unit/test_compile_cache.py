"""Where graph mode keeps torch.compile's on-disk caches
(``hpu_mm.warmup.compile_cache_dir``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from vllm_hpu_mm.worker.graphs import default_compile_cache_dir, use_compile_cache


def test_configured_directory_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "env"))
    got = use_compile_cache(str(tmp_path / "mine"))
    assert got == str(tmp_path / "mine") and Path(got).is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == got


def test_users_environment_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "env"))
    assert use_compile_cache(None) == str(tmp_path / "env")


@pytest.mark.parametrize("torch_wrote_its_default", [False, True])
def test_default_is_the_users_cache_not_the_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_wrote_its_default: bool
) -> None:
    # Torch puts its /tmp default into the environment when it first resolves
    # the directory: that value is not a choice of the user's.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if torch_wrote_its_default:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    else:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    got = use_compile_cache(None)
    assert got == str(tmp_path / "xdg" / "vllm-hpu-mm" / "torch-compile")
    assert got == default_compile_cache_dir()
