"""DeepSpeed ZeRO 1/2/3 with CPU/NVMe offload: the strategy (strategy.py), its config and the
checks of its arguments (config.py), its process group (group.py), its one engine (engine.py) or
one engine per manual optimizer (manual.py, multi.py), ZeRO-3 construction (zero3.py), checkpoint
shards (shards.py), the neutral checkpoint form written into an engine (portable.py), DeepSpeed's
compiled ops (ops.py), its quieted import (quiet.py), the engine's memory (measure.py) and
Lightning's `DeepSpeedStrategy` (lightning.py). No module outside this package imports
`deepspeed`."""

from lightspeed.strategies.deepspeed.lightning import DeepSpeedStrategy
from lightspeed.strategies.deepspeed.shards import full_state_dict
from lightspeed.strategies.deepspeed.strategy import DeepSpeed

__all__ = ["DeepSpeed", "DeepSpeedStrategy", "full_state_dict"]
