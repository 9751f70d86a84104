"""The GPU's kernels as a CPU probe must count them: a probe runs the model's step on the CPU, where
dropout and attention save other tensors for backward than a GPU does, and where nothing counts the
memory a device's allocator would. `GpuKernels` runs dropout as the fused kernel and attention as
the GPU's kernel choice for it (`gpu_sdpa_fused`: a fused kernel, `FusedAttention`; else its math
path, `gpu_sdpa_math`); `LiveBytes` counts every storage an operation creates until it is freed,
as a device allocator does. Used by `lightspeed.plan.probe` for a GPU target.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class GpuKernels(TorchFunctionMode):
    """Runs a CPU probe's step as a GPU runs it where the two save different tensors for backward:
    dropout as the fused kernel (a one-byte mask, where the CPU keeps a noise tensor of the input's
    dtype), and attention as the GPU's kernel choice for it (`gpu_sdpa_fused`): what a fused kernel
    saves (`FusedAttention`: query, key, value, output and the log-sum-exp, where the CPU's own
    kernels may fall back to fp32 attention matrices), or, where the GPU refuses every fused
    kernel, its math path as the GPU runs it (`gpu_sdpa_math`). Only the bytes matter: the probe's
    outputs are thrown away."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.dropout:
            x, p, training, inplace = _dropout_args(*args, **kwargs)
            if training and 0 < p < 1 and not inplace and x.is_floating_point():
                return torch.native_dropout(x, p, True)[0]
        elif func is F.scaled_dot_product_attention:
            q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_args(*args, **kwargs)
            if not gpu_sdpa_fused(q, k, v, mask):
                return gpu_sdpa_math(q, k, v, mask, dropout_p, is_causal, scale, gqa)
            return FusedAttention.apply(q, k, v, mask, is_causal, scale, gqa)
        return func(*args, **kwargs)


class FusedAttention(torch.autograd.Function):
    """A GPU's fused attention kernel (flash, cuDNN, memory-efficient) as a probe sees it: it saves
    query, key, value, the output, the fp32 log-sum-exp and the mask, whatever kernel the CPU
    would take (its math fallback keeps fp32 attention matrices for a mask that needs a
    gradient); backward makes gradients of the inputs' shapes. Dropout happens inside the kernel,
    from a seed, and keeps nothing."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, gqa):  # type: ignore[override]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, _out, _lse, *mask = ctx.saved_tensors
        dmask = torch.zeros_like(mask[0]) if mask and ctx.needs_input_grad[3] else None
        return (
            torch.zeros_like(q),
            torch.zeros_like(k),
            torch.zeros_like(v),
            dmask,
            None,
            None,
            None,
        )


def _sdpa_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def gpu_sdpa_fused(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> bool:
    """Whether a CUDA GPU (sm80 or newer) runs this attention in a fused kernel (flash, cuDNN or
    memory-efficient) rather than its math path. torch's rules that refuse all three: a last
    dimension of query, key, value or the mask whose stride is not 1 (a mask permuted from
    [query, key, heads], as T5's relative position bias is); head dimensions that differ between
    query and key or are not a multiple of 8 (half precision) or 4 (fp32). The CPU's own kernels
    accept the first, which is where a CPU probe would otherwise count the fused kernel's bytes."""
    dense = (query, key, value) + ((mask,) if mask is not None and mask.size(-1) > 1 else ())
    if any(t.stride(-1) != 1 for t in dense):
        return False
    align = 8 if query.dtype in (torch.float16, torch.bfloat16) else 4
    head, value_head = query.size(-1), value.size(-1)
    return head == key.size(-1) and head % align == 0 and value_head % align == 0


def gpu_sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """Attention as torch's math path computes it on a GPU, so that autograd saves what it saves
    there: half-precision inputs in fp32 (unless `allow_fp16_bf16_reduction_math_sdp` is set), the
    scaled query and key, the fp32 softmax, dropout's one-byte mask and the dropped fp32 matrix,
    and value."""
    out_dtype = query.dtype
    if out_dtype in (torch.float16, torch.bfloat16) and not _math_reduces_in_half():
        query, key, value = query.float(), key.float(), value.float()
    if enable_gqa and key.size(-3) != query.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), dim=-3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), dim=-3)
    root = math.sqrt(scale if scale is not None else 1 / math.sqrt(query.size(-1)))
    scores = (query * root) @ (key.transpose(-2, -1) * root)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        weights = torch.native_dropout(weights, dropout_p, True)[0]
    return (weights @ value).to(out_dtype)


def _math_reduces_in_half() -> bool:
    allowed = getattr(torch._C, "_get_math_sdp_allow_fp16_bf16_reduction", None)
    return bool(allowed()) if allowed is not None else False


def _dropout_args(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> tuple[torch.Tensor, float, bool, bool]:
    return input, p, training, inplace


class LiveBytes(TorchDispatchMode):
    """The step's memory as a device allocator counts it, on the CPU: every tensor storage an
    operation creates is counted until it is freed (`weakref.finalize` on the storage, whose Python
    object lives as long as the storage does), and the largest total is `peak`. Weights are not
    counted, nor what is computed from weights alone (autocast's copies, transposes: `buffers`)."""

    def __init__(self, weights: set[int]):
        super().__init__()
        self.weights, self.counted = set(weights), set()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        derived = bool(inputs) and all(_key(t) in self.weights for t in inputs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage, key = t.untyped_storage(), _key(t)
            if key in self.counted or key in self.weights or not storage.nbytes():
                continue
            if derived:
                self.weights.add(key)
                continue
            self.counted.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.counted.discard(key)
        self.live -= nbytes


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
