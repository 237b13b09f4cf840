"""Shared fixtures: the tiny offline models (built on first use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.hf_reference import hf_greedy

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO_ROOT / "models"

__all__ = ["MODELS_DIR", "REPO_ROOT", "hf_greedy"]


def _tiny_model_dir(name: str) -> str:
    """``models/<name>``, built with the repository's builder if missing."""
    from tools.build_tiny_models import build_tiny_model

    return str(build_tiny_model(MODELS_DIR, name))


@pytest.fixture(scope="session")
def tiny_llama_dir() -> str:
    """Path of the tiny Llama model (GQA, float32)."""
    return _tiny_model_dir("tiny-llama")


@pytest.fixture(scope="session")
def tiny_mistral_dir() -> str:
    """Path of the tiny Mistral model (16-token sliding window, float32)."""
    return _tiny_model_dir("tiny-mistral")


@pytest.fixture(scope="session")
def tiny_mllama_dir() -> str:
    """Path of the tiny Mllama model (4 tiles of 32x32, float32), built if missing."""
    return _tiny_model_dir("tiny-mllama")


@pytest.fixture(scope="session")
def tiny_llava_dir() -> str:
    """Path of the tiny LLaVA (CLIP tower as save_pretrained writes it, float32)."""
    return _tiny_model_dir("tiny-llava")


@pytest.fixture(scope="session")
def tiny_llava_released_dir() -> str:
    """The same LLaVA in the llava-hf layout (``vision_tower.vision_model.*``)."""
    return _tiny_model_dir("tiny-llava-released")


@pytest.fixture(scope="session")
def tiny_idefics3_dir() -> str:
    """Path of the tiny Idefics3 (SmolVLM architecture, float32)."""
    return _tiny_model_dir("tiny-idefics3")


# Modules that must not run at the same time as each other under pytest-xdist
# (``make test`` runs two workers): each starts a local Ray cluster, and two
# clusters on one host compete for Ray's fixed default ports.
_SERIAL_GROUPS = {
    "test_ray_pp": "ray",
    "test_ray_tp": "ray",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``make test`` runs two workers) a module's tests
    stay on one worker, so its shared engines start once; the modules of
    ``_SERIAL_GROUPS`` share a worker and run one after the other. (xdist's
    own ``loadgroup`` cannot do this under pytest 9: it renames test ids
    through an attribute pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _SERIAL_GROUPS.get(Path(module).stem, module)

    return ModuleScheduling(config, log)


_SUMMARY_KEY = "hpu_mm_summary"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """In an xdist worker: summary lines written by module fixtures torn down
    with this test (``Bf16Tally.report``) travel with its report."""
    from tests.hf_reference import PENDING_SUMMARIES

    try:
        return (yield)
    finally:
        while PENDING_SUMMARIES:
            item.user_properties.append((_SUMMARY_KEY, PENDING_SUMMARIES.pop(0)))


_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG.append(config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In the xdist controller: print the summary lines a worker sent."""
    if report.when != "teardown" or not _CONFIG or hasattr(_CONFIG[0], "workerinput"):
        return
    from tests.hf_reference import write_summary

    for key, line in report.user_properties:
        if key == _SUMMARY_KEY:
            write_summary(_CONFIG[0], str(line))
