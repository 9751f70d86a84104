"""A sequence classifier on torch's nn.TransformerEncoder, built in configure_model (how large
models are built for ZeRO-3 and FSDP: sharded as they are created). nn.TransformerEncoder
deep-copies its layer num_layers times.
    python examples/transformer_encoder.py --devices 2 --strategy deepspeed_stage_3
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L

VOCAB, CLASSES, LENGTH = 64, 4, 16


class Classifier(L.LightningModule):
    def __init__(self, d_model: int = 32, layers: int = 2, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self):
        d = self.hparams.d_model
        self.embed = nn.Embedding(VOCAB, d)
        layer = nn.TransformerEncoderLayer(
            d, nhead=4, dim_feedforward=2 * d, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, self.hparams.layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, CLASSES)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = F.cross_entropy(self(tokens), labels)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def sequences(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    labels = tokens[:, 0] % CLASSES  # learnable: the class is in the first token
    return DataLoader(TensorDataset(tokens, labels), batch_size=8)


def main(args):
    L.seed_everything(7)
    model = Classifier()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        log_every_n_steps=1,
        enable_checkpointing=False,
    )
    trainer.fit(model, sequences(256))
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
    main(parser.parse_args())
