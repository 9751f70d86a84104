"""Lightning's utility names, one home each: `from lightspeed.utilities import rank_zero_only`.

    rank_zero_only, rank_zero_info, rank_zero_warn   (utilities.rank_zero)
    MisconfigurationException                        (utilities.exceptions: lightspeed's ConfigError)
    seed_everything                                  (lightspeed.rng)
    CombinedLoader                                   (lightspeed.data: several training loaders as one)
    grad_norm                                        (utilities.grads)
"""

from ..data import CombinedLoader
from ..rng import seed_everything
from .exceptions import MisconfigurationException
from .grads import grad_norm
from .rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn

__all__ = ["CombinedLoader", "MisconfigurationException", "grad_norm", "rank_zero_debug", "rank_zero_info", "rank_zero_only", "rank_zero_warn",
           "seed_everything"]
