"""Demo and test models, under the names of Lightning's `lightning.pytorch.demos`.

`lightspeed.demos` exports what Lightning's package does: the boring classes (BoringModel,
BoringDataModule, DemoModel; the rest are in `lightspeed.demos.boring_classes`), the LSTM and
transformer language models with their WikiText2 data (`demos.lstm`, `demos.transformer`).
MNIST and its DataModule are imported from `lightspeed.demos.mnist_datamodule`, as in Lightning.
`lightspeed.demos.gpt` holds the byte-level GPT of `lightspeed demo`.
"""

from .boring_classes import BoringDataModule, BoringModel, DemoModel
from .lstm import LightningLSTM, SequenceSampler, SimpleLSTM
from .transformer import LightningTransformer, Transformer, WikiText2

__all__ = [
    "BoringDataModule",
    "BoringModel",
    "DemoModel",
    "LightningLSTM",
    "LightningTransformer",
    "SequenceSampler",
    "SimpleLSTM",
    "Transformer",
    "WikiText2",
]
