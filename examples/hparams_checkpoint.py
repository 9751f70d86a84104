"""save_hyperparameters and load_from_checkpoint: the module records its init arguments,
ModelCheckpoint keeps the best epoch by validation loss, and `load_from_checkpoint` rebuilds the
module from the checkpoint alone.
    python examples/hparams_checkpoint.py --devices 2 --strategy deepspeed_stage_3
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L
from lightspeed.callbacks import ModelCheckpoint


class TextClassifier(L.LightningModule):
    """Bag-of-embeddings over token ids, then a linear layer."""

    def __init__(
        self,
        vocab: int = 100,
        width: int = 32,
        classes: int = 3,
        lr: float = 0.05,
        note: str = "demo",
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["note"])
        self.embed = nn.EmbeddingBag(vocab, width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.embed(tokens))

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = F.cross_entropy(self(tokens), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        self.log("val_loss", F.cross_entropy(self(tokens), labels), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def sentences(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (n, 12), generator=g)
    return DataLoader(TensorDataset(tokens, tokens[:, 0] % 3), batch_size=16)


def main(args):
    L.seed_everything(11)
    model = TextClassifier(width=24, lr=0.1)
    checkpoint = ModelCheckpoint(
        monitor="val_loss", mode="min", save_top_k=1, filename="{epoch}-{val_loss:.3f}"
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
        callbacks=[checkpoint],
    )
    trainer.fit(model, sentences(128, 0), sentences(32, 1))
    best_score = trainer.validate(model, sentences(32, 1), ckpt_path="best")[0][
        "val_loss"
    ]  # the best weights again

    best = TextClassifier.load_from_checkpoint(checkpoint.best_model_path)
    best.eval()
    tokens, _ = next(iter(sentences(4, 2)))
    with torch.no_grad():
        logits = best(tokens)
    if trainer.is_global_zero:
        print(
            f"best checkpoint: {checkpoint.best_model_path} (val_loss "
            f"{float(checkpoint.best_model_score):.4f}, "
            f"validated again: {best_score:.4f})"
        )
        print(f"hparams: {dict(best.hparams)}; logits {tuple(logits.shape)}")
        print(f"result: width={best.hparams.width}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument(
        "--accelerator", default="auto", help="cpu, gpu or auto (a GPU when there is one)"
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_epochs", type=int, default=2)
    main(parser.parse_args())
