"""DeepSpeed ZeRO 1/2/3 with CPU/NVMe offload: the strategy (strategy.py), its config (config.py),
ZeRO-3 construction (zero3.py), one engine per manual optimizer (manual.py, multi.py), the neutral
checkpoint form written into an engine (portable.py), DeepSpeed's compiled ops (ops.py), the
engine's memory (measure.py) and Lightning's `DeepSpeedStrategy` (lightning.py). No
module outside this package imports `deepspeed`."""

from lightspeed.strategies.deepspeed.lightning import DeepSpeedStrategy
from lightspeed.strategies.deepspeed.strategy import DeepSpeed, full_state_dict

__all__ = ["DeepSpeed", "DeepSpeedStrategy", "full_state_dict"]
