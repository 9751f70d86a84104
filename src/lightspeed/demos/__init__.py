"""Demo and test models. `lightspeed.demos` exports the boring classes Lightning's
`lightning.pytorch.demos` exports (BoringModel, BoringDataModule, DemoModel); the rest are in
`lightspeed.demos.boring_classes`. `lightspeed.demos.gpt` holds the byte-level GPT of `lightspeed
demo`."""

from .boring_classes import BoringDataModule, BoringModel, DemoModel

__all__ = ["BoringDataModule", "BoringModel", "DemoModel"]
