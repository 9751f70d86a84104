"""Lightning's cluster environments. lightspeed reads the launch environment itself, once
(`runtime.launch.read_dist_info`: torchrun, the deepspeed launcher, SLURM's srun, its own
spawner), so an environment here is a statement of where the job runs, and SLURM's carries the
requeue settings (`plugins.resolve`).
"""

from __future__ import annotations

import signal


class ClusterEnvironment:
    """Base class. A subclass of your own is refused by the Trainer: its methods are not read."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class LightningEnvironment(ClusterEnvironment):
    """Processes started by the Trainer itself, or by torchrun's variables."""


class TorchElasticEnvironment(ClusterEnvironment):
    """torchrun / torch.distributed.run."""


class KubeflowEnvironment(ClusterEnvironment):
    """Kubeflow's PyTorchJob (MASTER_ADDR, WORLD_SIZE and RANK, as torchrun's)."""


class SLURMEnvironment(ClusterEnvironment):
    """srun. `auto_requeue=False`: a preempted job saves and exits without `scontrol requeue`;
    `requeue_signal`: the signal SLURM sends before the time limit (SIGUSR1 unless given)."""

    def __init__(
        self, auto_requeue: bool = True, requeue_signal: signal.Signals | None = None
    ) -> None:
        self.auto_requeue = auto_requeue
        self.requeue_signal = requeue_signal


class LSFEnvironment(ClusterEnvironment):
    """IBM LSF's jsrun: not read (refused by the Trainer)."""


class MPIEnvironment(ClusterEnvironment):
    """mpirun's OMPI_* variables: not read (refused by the Trainer)."""


class XLAEnvironment(ClusterEnvironment):
    """TPU pods: not read (refused by the Trainer)."""


READ = (LightningEnvironment, TorchElasticEnvironment, KubeflowEnvironment, SLURMEnvironment)
