"""Lightning's precision plugins, as names for a `Trainer(precision=...)` value.

    Trainer(plugins=[MixedPrecision("bf16-mixed", "cuda")])   # as Trainer(precision="bf16-mixed")

The strategy owns precision here (DeepSpeed's engine casts and scales itself), so a plugin carries
only its precision string; `plugins.resolve` turns it into the flag. A plugin whose work cannot be
a flag (bitsandbytes' quantized layers, Transformer Engine, XLA) is refused there, naming it.
"""

from __future__ import annotations

from typing import Any


class Precision:
    """Full fp32 precision ("32-true"); the base of the others."""

    precision: str = "32-true"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r})"


class MixedPrecision(Precision):
    """Autocast to bf16 or fp16 over fp32 weights ("bf16-mixed", "16-mixed")."""

    def __init__(self, precision: str, device: str = "cuda", scaler: Any = None) -> None:
        self.precision, self.device, self.scaler = precision, device, scaler


class HalfPrecision(Precision):
    """Weights and compute in bf16 ("bf16-true")."""

    def __init__(self, precision: str = "16-true") -> None:
        self.precision = precision


class DoublePrecision(Precision):
    """fp64 weights ("64-true")."""

    precision = "64-true"


class DeepSpeedPrecision(Precision):
    """DeepSpeed's precision; here the same flag any strategy takes."""

    def __init__(self, precision: str) -> None:
        self.precision = precision


class FSDPPrecision(Precision):
    """FSDP's mixed precision; here the same flag any strategy takes."""

    def __init__(self, precision: str, scaler: Any = None) -> None:
        self.precision, self.scaler = precision, scaler


class BitsandbytesPrecision(Precision):
    """Quantized Linear layers through bitsandbytes: not provided (refused by the Trainer)."""

    def __init__(self, mode: str, *args: Any, **kwargs: Any) -> None:
        self.precision = f"bitsandbytes-{mode}"


class TransformerEnginePrecision(Precision):
    """NVIDIA Transformer Engine's fp8: not provided (refused by the Trainer)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.precision = "transformer-engine"


class XLAPrecision(Precision):
    """TPU precision: not provided (refused by the Trainer)."""

    def __init__(self, precision: str = "32-true") -> None:
        self.precision = precision


NOT_PROVIDED = (BitsandbytesPrecision, TransformerEnginePrecision, XLAPrecision)
