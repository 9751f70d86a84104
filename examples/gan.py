"""A GAN with manual optimization: a generator and a discriminator, each with its own optimizer,
stepped by hand.
    python examples/gan.py --devices 2 --strategy deepspeed_stage_2
    python examples/gan.py --devices 2 --strategy deepspeed_stage_2 \
        --ckpt_path checkpoints/last.ckpt   # resume

Under DeepSpeed each optimizer gets its own engine; the script is the same under every strategy.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L
from lightspeed.callbacks import ModelCheckpoint


class Generator(nn.Module):
    def __init__(self, latent_dim: int, img_shape: tuple):
        super().__init__()
        self.img_shape = img_shape
        self.net = nn.Sequential(
            nn.Linear(latent_dim, 128), nn.LeakyReLU(0.2), nn.Linear(128, 28 * 28), nn.Tanh()
        )

    def forward(self, z):
        return self.net(z).view(z.shape[0], *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(28 * 28, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))

    def forward(self, img):
        return self.net(img.flatten(1))


class GAN(L.LightningModule):
    def __init__(self, latent_dim: int = 32, lr: float = 2e-4):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim, (1, 28, 28))
        self.discriminator = Discriminator()

    def forward(self, z):
        return self.generator(z)

    def training_step(self, batch):
        imgs, z = (
            # the noise comes with the batch, so every strategy and a resume see the same samples
            batch
        )
        opt_g, opt_d = self.optimizers()
        real = torch.ones(imgs.size(0), 1).type_as(imgs)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)

        # generator: make the discriminator call its samples real
        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z)), real)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        # discriminator: tell real images from the generator's
        self.toggle_optimizer(opt_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(imgs), real)
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        lr = self.hparams.lr
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(0.5, 0.999))
        return [opt_g, opt_d]


def images_and_noise(n: int, latent_dim: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    imgs = torch.rand(n, 1, 28, 28, generator=g) * 2 - 1  # the range of Tanh, as normalised MNIST
    return DataLoader(TensorDataset(imgs, torch.randn(n, latent_dim, generator=g)), batch_size=16)


def main(args):
    L.seed_everything(7)
    model = GAN()
    checkpoint = ModelCheckpoint(
        dirpath="checkpoints", every_n_train_steps=args.save_every, save_last=True, save_top_k=-1
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        log_every_n_steps=1,
        callbacks=[checkpoint],
    )
    trainer.fit(model, images_and_noise(256, model.hparams.latent_dim), ckpt_path=args.ckpt_path)
    if trainer.is_global_zero:
        print(f"result: d_loss={float(trainer.callback_metrics['d_loss']):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument(
        "--accelerator", default="auto", help="cpu, gpu or auto (a GPU when there is one)"
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--save_every", type=int, default=4)
    parser.add_argument("--ckpt_path", default=None)
    main(parser.parse_args())
