"""The device communicator of the plugin: vLLM's collectives over
``torch.distributed`` (hccl on Gaudi, nccl, gloo), with HPU lazy mode's graph
cut before each.

In lazy mode (``PT_HPU_LAZY_MODE=1``, the mode of HPU graphs) the ops of a
step accumulate into a graph that runs at ``mark_step``; tensor-parallel HPU
graphs need lazy collectives (``PT_HPU_ENABLE_LAZY_COLLECTIVES``), and a
collective issued on an uncut graph hits a bug of the bridge. The official
plugin cuts the graph before every collective (vllm-gaudi
``distributed/device_communicators/hpu_communicator.py``: ``htorch.core.
mark_step()`` before ``all_reduce`` and ``all_gather``, "a workaround for a
bug in Habana PT bridge"). ``device.mark_step`` is a no-op off HPU; on HPU in
eager mode the bridge ignores it.
"""

from __future__ import annotations

import torch
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)

from vllm_hpu_mm import device


class HpuMMCommunicator(DeviceCommunicatorBase):
    """``DeviceCommunicatorBase`` with ``device.mark_step()`` before each
    collective on the device group."""

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        device.mark_step()
        return super().all_reduce(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        device.mark_step()
        return super().all_gather(input_, dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        device.mark_step()
        return super().reduce_scatter(input_, dim)

    def gather(
        self, input_: torch.Tensor, dst: int = 0, dim: int = -1
    ) -> torch.Tensor | None:
        device.mark_step()
        return super().gather(input_, dst, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        device.mark_step()
        return super().broadcast(tensor, src)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        device.mark_step()
        super().send(tensor, dst)
