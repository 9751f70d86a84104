"""`Closure`, at Lightning's path (`loops.optimization.automatic`)."""

from __future__ import annotations

from lightspeed.utilities.rank_zero import WarningCache

__all__ = ["Closure"]


class Closure:
    """The type of the closure Lightning passes to a Module's `optimizer_step` (training step,
    backward and zero_grad in one call). lightspeed's strategies own the optimizer step, so its
    loop builds none (a Module's `optimizer_step` override is warned about at fit start). What is
    used of it is the warning cache of "`training_step` returned `None`" (loop.loss_of): said once
    until `Closure.warning_cache.clear()`."""

    warning_cache = WarningCache()
