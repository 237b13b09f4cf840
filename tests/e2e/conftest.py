"""End-to-end fixtures shared by every module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module", autouse=True)
def fresh_metrics_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh prometheus_client multiprocess directory per test module.

    The plugin's counters live in the engine processes and reach the tests through
    the files of PROMETHEUS_MULTIPROC_DIR, which outlive those processes. Each
    module starts its own engines and asserts on absolute counts (compilations at
    warmup, encoder runs), so it must not read the files of an earlier module's
    engines. Engines started in the module inherit the directory.
    """
    path = tmp_path_factory.mktemp("prometheus")
    old = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = old
