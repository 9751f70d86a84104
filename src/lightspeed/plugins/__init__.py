"""Lightning's `lightning.pytorch.plugins` names (`Trainer(plugins=...)`): precision plugins,
cluster environments, checkpoint IO and layer sync, each turned into the Trainer flag it stands
for (`resolve.plugin_flags`); docs/porting.md lists what is taken."""

from lightspeed.plugins.environments import (
    ClusterEnvironment,
    KubeflowEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    XLAEnvironment,
)
from lightspeed.plugins.io import (
    AsyncCheckpointIO,
    CheckpointIO,
    TorchCheckpointIO,
    XLACheckpointIO,
)
from lightspeed.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightspeed.plugins.precision import (
    BitsandbytesPrecision,
    DeepSpeedPrecision,
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
    TransformerEnginePrecision,
    XLAPrecision,
)

__all__ = [
    "AsyncCheckpointIO",
    "BitsandbytesPrecision",
    "CheckpointIO",
    "ClusterEnvironment",
    "DeepSpeedPrecision",
    "DoublePrecision",
    "FSDPPrecision",
    "HalfPrecision",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LayerSync",
    "LightningEnvironment",
    "MPIEnvironment",
    "MixedPrecision",
    "Precision",
    "SLURMEnvironment",
    "TorchCheckpointIO",
    "TorchElasticEnvironment",
    "TorchSyncBatchNorm",
    "TransformerEnginePrecision",
    "XLACheckpointIO",
    "XLAEnvironment",
    "XLAPrecision",
]
