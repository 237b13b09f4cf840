"""Shared fixtures: the tiny offline models (built on first use)."""

from __future__ import annotations

from pathlib import Path

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
