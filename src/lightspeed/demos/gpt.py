"""A byte-level GPT, trained on the local Python standard library's source files (no download
needed).

    lightspeed demo                                   # 2 CPU ranks, the default strategy, the small
    model lightspeed demo --strategy deepspeed_stage_3 --devices 2 --max-steps 100

The model is nanoGPT's shape: token + position embeddings, pre-norm blocks of causal self-attention
and an MLP, a final norm and an LM head whose weight is tied to the token embedding.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from lightspeed.core.module import Module


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


SIZES = {
    "tiny": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "medium": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
    # The GPU benchmark's model: ~1.34B parameters at d=2048, 24 layers, seq 1024, vocab 32000.
    "1.3b": GPTConfig(
        vocab_size=32000, block_size=1024, n_layer=24, n_head=16, n_embd=2048, bias=False
    ),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # Heads are counted from the tensors, not from n_head: under tensor parallelism each rank
        # computes its share of the heads (strategies/tensor_parallel.py).
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.view(B, T, -1, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # Flash/efficient attention where the device has it; the causal mask is built in.
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights count once

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int = 40
    ):
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1, :] / temperature
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), 1)], dim=1)
        return idx


class GPTModule(Module):
    """The Lightning-style wrapper: the model is built in `configure_model`, so ZeRO-3/FSDP can
    shard it."""

    def __init__(
        self, cfg: GPTConfig, lr: float = 3e-3, weight_decay: float = 0.1, warmup_steps: int = 0
    ):
        super().__init__()
        self.cfg, self.lr, self.weight_decay, self.warmup_steps = (
            cfg,
            lr,
            weight_decay,
            warmup_steps,
        )
        self.model: GPT | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        assert self.model is not None  # built by configure_model, which the Trainer calls first
        return self.model(idx)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.lr,
            betas=(0.9, 0.95),
        )
        if not self.warmup_steps:
            return opt
        warmup = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / self.warmup_steps)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def stdlib_corpus(max_bytes: int = 4_000_000) -> np.ndarray:
    """The default corpus: bytes of the local Python standard library's .py files, in a fixed
    order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"\n".join(chunks)[:max_bytes], dtype=np.uint8)


class ByteWindows(Dataset):
    """Non-overlapping (input, target) windows of `block_size` bytes; the target is the input
    shifted by one."""

    def __init__(self, data: np.ndarray, block_size: int):
        self.data = torch.from_numpy(data.astype(np.int64))
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int):
        chunk = self.data[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class RandomTokens(Dataset):
    """Random token sequences for benchmarks: same shapes as text, no I/O."""

    def __init__(self, vocab_size: int, block_size: int, length: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (length, block_size + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i, :-1], self.tokens[i, 1:]
