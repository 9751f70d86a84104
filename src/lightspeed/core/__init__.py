"""Where Lightning users look for the Module and the DataModule: `from lightspeed.core import
LightningModule, LightningDataModule` (Lightning's `lightning.pytorch.core` exports both). Loaded on
first use, so importing a submodule (`lightspeed.core.metrics`) does not import the Module."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "LightningModule":
        from lightspeed.core.module import LightningModule

        return LightningModule
    if name == "LightningDataModule":
        from lightspeed.core.datamodule import LightningDataModule

        return LightningDataModule
    raise AttributeError(f"module 'lightspeed.core' has no attribute {name!r}")
