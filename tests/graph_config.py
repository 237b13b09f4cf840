"""The plugin settings the graph-mode e2e tests start their engines with."""

from __future__ import annotations

from typing import Any

import pytest


def compiled_with_buckets(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    buckets_yaml: str,
    execution: str = "auto",
) -> dict[str, Any]:
    """``additional_config`` for graph mode over the explicit buckets
    ``buckets_yaml`` (written to a bucket file named ``name``), no progress bar;
    ``execution`` as ``hpu_mm.execution`` (auto: dynamic on the CPU)."""
    path = tmp_path_factory.mktemp("buckets") / f"{name}.yaml"
    path.write_text(buckets_yaml)
    return {
        "hpu_mm": {
            "graph_mode": "compile",
            "execution": execution,
            "bucketing": {"strategy": "explicit", "file": str(path)},
            "warmup": {"progress_bar": False},
        }
    }


def image_engine_in_graph_mode(
    model_dir: str,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    buckets_yaml: str,
    max_num_batched_tokens: int,
    execution: str = "auto",
    **engine_args: Any,
) -> Any:
    """A vision-language model in graph mode over ``buckets_yaml``, float32 (HF
    parity), 4 sequences of up to 256 tokens, 2 images per prompt, on the
    execution plan ``execution``."""
    from vllm import LLM

    return LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=max_num_batched_tokens,
        limit_mm_per_prompt={"image": 2},
        seed=0,
        additional_config=compiled_with_buckets(
            tmp_path_factory, name, buckets_yaml, execution
        ),
        **engine_args,
    )
