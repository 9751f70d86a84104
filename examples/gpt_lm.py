"""A GPT-style causal language model on random tokens: embeddings, a stack of pre-norm transformer
blocks with a causal mask, and a linear output head. Layers are built in `configure_model`, so
sharded strategies (FSDP, DeepSpeed stage 3) can create them directly in their shards.
    python examples/gpt_lm.py --devices 2 --strategy fsdp
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightspeed as L


class RandomTokens(Dataset):
    def __init__(self, vocab: int, length: int, n: int):
        self.data = torch.randint(
            0, vocab, (n, length + 1), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


class GPT(L.LightningModule):
    def __init__(
        self, vocab: int = 256, width: int = 64, depth: int = 2, heads: int = 4, context: int = 32
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = None

    def configure_model(self):
        if self.model is not None:
            return
        h = self.hparams
        blocks = [
            nn.TransformerEncoderLayer(
                h.width, h.heads, 4 * h.width, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(h.depth)
        ]
        self.model = nn.ModuleDict(
            dict(
                tok=nn.Embedding(h.vocab, h.width),
                pos=nn.Embedding(h.context, h.width),
                blocks=nn.ModuleList(blocks),
                norm=nn.LayerNorm(h.width),
                head=nn.Linear(h.width, h.vocab, bias=False),
            )
        )

    def forward(self, idx):
        m = self.model
        x = m.tok(idx) + m.pos(torch.arange(idx.shape[1], device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        for block in m.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return m.head(m.norm(x))

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        loss = F.cross_entropy(self(idx).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def main(args):
    L.seed_everything(0)
    model = GPT(context=args.context)
    data = DataLoader(RandomTokens(256, args.context, 128), batch_size=8, shuffle=True)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        gradient_clip_val=1.0,
    )
    trainer.fit(model, data)
    if trainer.is_global_zero:
        print(f"result: train_loss={float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument(
        "--accelerator", default="auto", help="cpu, gpu or auto (a GPU when there is one)"
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--context", type=int, default=32)
    main(parser.parse_args())
