"""The activation probe for a GPU target, on CPU: it saves what the GPU's kernels save (dropout's
one-byte mask, flash attention's query/key/value, output and log-sum-exp) and counts the step's
working memory above the saved tensors (`LiveBytes`), as a device allocator would."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lightspeed as ls
from lightspeed.plan.gpu_kernels import LiveBytes
from lightspeed.plan.probe import probe_activations


class _Base(ls.LightningModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Dropout(_Base):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 128)

    def training_step(self, batch):
        return F.dropout(self.lin(batch), 0.1, True).float().sum()


class Attention(_Base):
    """One projection used as query, key and value, then attention with dropout."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def training_step(self, batch):
        x = self.lin(batch).view(batch.shape[0], 16, 2, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(x, x, x, dropout_p=0.1, is_causal=True)
        return out.float().sum()


def test_dropout_saves_a_one_byte_mask_for_a_gpu_and_its_dtype_on_cpu():
    batch = torch.randn(4, 64, dtype=torch.bfloat16)
    cpu = probe_activations(Dropout(), batch, "bf16-true", "cpu")
    gpu = probe_activations(Dropout(), batch, "bf16-true", "cuda")
    # per sample: 128 outputs; the CPU keeps bf16 noise (2 bytes each), the GPU a bool mask
    assert (cpu.per_sample, gpu.per_sample) == (256, 128)
    assert cpu.working_per_sample == 0 and gpu.working_per_sample > 0


def test_attention_with_dropout_is_probed_as_the_flash_kernel_saves_it():
    batch = torch.randn(4, 16, 16, dtype=torch.bfloat16)
    gpu = probe_activations(Attention(), batch, "bf16-true", "cuda")
    # per sample: the projection (16×16 bf16, query = key = value), the output (the same) and the
    # log-sum-exp (2 heads × 16 positions, fp32)
    assert gpu.per_sample == 16 * 16 * 2 + 16 * 16 * 2 + 2 * 16 * 4
    cpu = probe_activations(Attention(), batch, "bf16-true", "cpu")
    assert cpu.per_sample > 4 * gpu.per_sample  # the CPU's math fallback: fp32 attention matrices


def test_live_bytes_peaks_at_the_largest_gradient_beside_the_saved_tensors():
    net = torch.nn.Sequential(
        torch.nn.Linear(256, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 256)
    )
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    live = LiveBytes({p.untyped_storage()._cdata for p in net.parameters()})
    x = torch.randn(64, 256)
    with live:
        net(x).pow(2).sum().backward()
    mib = 2**20
    # saved: the hidden layer before and after GELU (1 MiB each); then the second layer's input
    # gradient (1 MiB) and weight gradient (4 MiB) at once, beside the output's gradient (64 KiB)
    assert 7 * mib <= live.peak <= 7 * mib + 128 * 1024
    assert live.live < 1024  # everything the step made is freed with it


class BiasedAttention(_Base):
    """Attention with dropout and a learned additive bias, laid out as T5's relative position bias
    reaches it with some transformers versions: permuted from [1, query, key, heads], so its last
    dimension's stride is the number of heads (`strided=True`), or made contiguous."""

    def __init__(self, strided: bool):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.bias = torch.nn.Parameter(torch.zeros(1, 16, 16, 2))
        self.strided = strided

    def training_step(self, batch):
        x = self.lin(batch).view(batch.shape[0], 16, 2, 8).transpose(1, 2)
        bias = self.bias.permute(0, 3, 1, 2)  # [1, heads, query, key], key's stride 2
        bias = bias * 1.0 if self.strided else bias.contiguous()
        out = F.scaled_dot_product_attention(x, x, x, attn_mask=bias, dropout_p=0.1)
        return out.float().sum()


def test_a_mask_a_gpu_kernel_refuses_is_probed_as_the_gpus_math_path():
    """A GPU refuses every fused kernel for a mask whose last stride is not 1 (torch's
    check_last_dim_stride_equals_1_dense) and runs its math path in fp32 with dropout's one-byte
    mask: T5's 0.31 GiB that the forecast missed on an H200. The CPU's kernels take such a mask."""
    batch = torch.randn(4, 16, 16, dtype=torch.bfloat16)
    fused = probe_activations(BiasedAttention(strided=False), batch, "bf16-true", "cuda")
    math_ = probe_activations(BiasedAttention(strided=True), batch, "bf16-true", "cuda")
    heads, n, d = 2, 16, 8
    # per sample on the math path: the scaled query and key and value in fp32, the fp32 softmax,
    # dropout's bool mask and the dropped fp32 matrix
    assert math_.per_sample == 3 * heads * n * d * 4 + 2 * heads * n * n * 4 + heads * n * n
    # a fused kernel: the projection (query = key = value) and the output in bf16, and the fp32
    # log-sum-exp (the CPU alone would have run its math path for a mask that needs a gradient)
    assert fused.per_sample == 2 * heads * n * d * 2 + heads * n * 4
