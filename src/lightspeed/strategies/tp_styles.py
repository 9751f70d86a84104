"""The tensor-parallel styles a plan may name (`STYLES`, Hugging Face's names plus
`fused_colwise`): torch's ColwiseParallel and RowwiseParallel, extended to Hugging Face's Conv1D
(GPT-2's transposed Linear), and `FusedColwise`, which splits a fused q/k/v projection per chunk.
`SPLIT_DIM` says which features of the weight each style splits, for the checks in
strategies/tensor_parallel.py, which applies the styles.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a Linear whose weight is stored transposed, (in, out)."""
    weight = getattr(module, "weight", None)
    return isinstance(getattr(module, "nf", None), int) and getattr(weight, "ndim", 0) == 2


def _partition(placements: dict[str, Any]) -> Callable[[str, nn.Module, DeviceMesh], None]:
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # distribute_module visits submodules too; a projection's are its own only
            return
        for key, param in list(module.named_parameters(recurse=False)):
            local = distribute_tensor(param, mesh, [placements[key]], src_data_rank=None)
            module.register_parameter(key, nn.Parameter(local, param.requires_grad))

    return partition


def _hook(fn: Callable[..., Any]) -> Any:
    """torch's styles pass these partials to `distribute_module`, whose annotation says hooks
    return None; they return the converted inputs."""
    return fn


class Colwise(ColwiseParallel):
    """torch's ColwiseParallel (output features split), for HF's Conv1D as well as nn.Linear."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module,
            device_mesh,
            _partition({"weight": Shard(1), "bias": Shard(0)}),
            _hook(partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Rowwise(RowwiseParallel):
    """torch's RowwiseParallel (input features split, outputs summed), for HF's Conv1D too."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            _partition({"weight": Shard(0), "bias": Replicate()}),
            _hook(partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class FusedColwise(Colwise):
    """A fused projection (GPT's `qkv`, GPT-2's `c_attn`: q, k and v side by side) split per chunk:
    each rank returns its share of every chunk, `[q_r, k_r, v_r]`, so `.chunk(3, -1)` of the local
    output gives its heads of q, k and v. The weight is split as a plain colwise one (contiguous
    rows, any DCP layout); the output is regrouped with one all-gather forward and one backward,
    which separate q/k/v projections (Llama's) do not pay."""

    def __init__(self, chunks: int = 3) -> None:
        super().__init__()
        self.chunks = chunks

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.use_local_output = False  # the parent's output hook hands the DTensor on
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(self._per_chunk)
        return module

    def _per_chunk(self, module: nn.Module, inputs: Any, output: DTensor) -> torch.Tensor:
        parts: list[Any] = list(output.chunk(self.chunks, dim=-1))  # DTensors
        return torch.cat([p.redistribute(placements=[Shard(-1)]).to_local() for p in parts], -1)


# The names a plan may use: Hugging Face's (`tp_plan` values) and lightspeed's `fused_colwise`.
STYLES: dict[str, Callable[[], Any]] = {
    "colwise": Colwise,
    "rowwise": Rowwise,
    "colwise_rep": lambda: Colwise(output_layouts=Replicate()),
    "colwise_gather_output": lambda: Colwise(output_layouts=Replicate()),
    "rowwise_rep": lambda: Rowwise(input_layouts=Replicate()),
    "rowwise_split_input": lambda: Rowwise(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "fused_colwise": FusedColwise,
    "replicate": lambda: None,
}
# The dimension of a Linear's or Embedding's `weight` each style splits (HF's Conv1D: the other).
SPLIT_DIM = {"colwise": 0, "colwise_rep": 0, "colwise_gather_output": 0, "fused_colwise": 0}
SPLIT_DIM |= {"rowwise": 1, "rowwise_rep": 1, "rowwise_split_input": 1, "embedding_rowwise": 0}
