"""Lightning's utility names, one home each: `from lightspeed.utilities import rank_zero_only`.

rank_zero_only, rank_zero_info, rank_zero_warn   (utilities.rank_zero)
MisconfigurationException                        (utilities.exceptions: lightspeed's ConfigError)
seed_everything                                  (lightspeed.runtime.rng)
CombinedLoader                                   (lightspeed.data.loaders: several training loaders
as one) grad_norm                                        (utilities.grads)
"""

from lightspeed.data.loaders import CombinedLoader
from lightspeed.runtime.rng import seed_everything
from lightspeed.utilities.exceptions import MisconfigurationException
from lightspeed.utilities.grads import grad_norm
from lightspeed.utilities.parameter_tying import find_shared_parameters, set_shared_parameters
from lightspeed.utilities.parsing import AttributeDict, is_picklable
from lightspeed.utilities.rank_zero import (
    rank_zero_debug,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)

__all__ = [
    "AttributeDict",
    "CombinedLoader",
    "MisconfigurationException",
    "find_shared_parameters",
    "grad_norm",
    "is_picklable",
    "rank_zero_debug",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "seed_everything",
    "set_shared_parameters",
]
