"""Which optional packages are installed, under Lightning's flag names (`_RICH_AVAILABLE`, ...), so
code that guards an import with them runs unchanged. Read once, at import."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re


def module_available(name: str) -> bool:
    """Whether `import name` would find the module (dotted names: every parent must exist)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def version_at_least(package: str, minimum: str) -> bool:
    """Whether the installed distribution `package` has a version ≥ `minimum` (its leading
    numbers compared; a pre-release of `minimum` counts as it)."""
    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False

    def numbers(version: str) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3])

    return numbers(installed) >= numbers(minimum)


_RICH_AVAILABLE = module_available("rich")
_TQDM_AVAILABLE = module_available("tqdm")
_OMEGACONF_AVAILABLE = module_available("omegaconf")
_TORCHVISION_AVAILABLE = module_available("torchvision")
_TENSORBOARD_AVAILABLE = module_available("tensorboard")
_TENSORBOARDX_AVAILABLE = module_available("tensorboardX")
_TORCHMETRICS_GREATER_EQUAL_0_11 = version_at_least("torchmetrics", "0.11.0")
_TORCH_GREATER_EQUAL_2_4 = version_at_least("torch", "2.4.0")
_TORCH_GREATER_EQUAL_2_6 = version_at_least("torch", "2.6.0")
_TORCH_GREATER_EQUAL_2_8 = version_at_least("torch", "2.8.0")
