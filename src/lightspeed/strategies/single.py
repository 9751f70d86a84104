"""One process, one device: no wrapping, just precision and the optimizer step."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import lightspeed.strategies.lightning as lightning
from lightspeed.checkpoint.io import load_replicated, save_replicated
from lightspeed.checkpoint.layouts import Portable, optimizer_param_names, write_torch
from lightspeed.errors import ConfigError
from lightspeed.perf.kernels import apply_compile, build_optimizers_fast
from lightspeed.perf.precision import Precision, StepGate, optimizer_step
from lightspeed.runtime.launch import DistInfo
from lightspeed.runtime.memory import measure_module
from lightspeed.specs import RunSpec, StepStats
from lightspeed.strategies.common import checkpoint_layout, fork_of, options_of, sampler_kwargs


@dataclass
class SingleDevice:
    """The strategy for `devices=1`."""

    name: str = "single"
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        # SingleDeviceStrategy(device=...): checked against the run's device at connect
        self.wanted: torch.device | None = None
        self.dist: DistInfo | None = None
        self.device: Any = None  # a torch.device, once connected
        self.module: Any = None  # the user's Module, once set up
        self.is_fork = False

    # What others may read (strategies/base.py), and Lightning's names for it.
    distributed_sampler_kwargs = sampler_kwargs

    @property
    def model(self) -> Any:
        return self.module

    @property
    def layout(self) -> str | None:
        return checkpoint_layout(self)

    root_device, lightning_module = lightning.root_device, lightning.lightning_module
    world_size, global_rank = lightning.world_size, lightning.global_rank
    local_rank, is_global_zero = lightning.local_rank, lightning.is_global_zero
    barrier, broadcast, reduce = lightning.COLLECTIVES

    def measure(self) -> dict[str, int]:
        return measure_module(self.module, self.optimizers)

    def settings(self) -> dict[str, Any]:
        return options_of(self)

    def fork(self) -> SingleDevice:
        return fork_of(self)

    def check(self, spec: RunSpec) -> None:
        pass  # one device honours every flag

    def connect(self, spec: RunSpec, dist_info: DistInfo, device: torch.device) -> None:
        wanted = self.wanted
        if wanted is not None and (
            wanted.type != device.type or (wanted.index or 0) != (device.index or 0)
        ):
            raise ConfigError(
                f"SingleDeviceStrategy(device={str(wanted)!r}) but this process runs on {device} "
                f"(the Trainer's accelerator): pass accelerator="
                f"{'gpu' if wanted.type == 'cuda' else 'cpu'!r}"
                + (", and choose the GPU with CUDA_VISIBLE_DEVICES" if wanted.index else "")
                + "."
            )
        self.spec, self.dist, self.device = spec, dist_info, device
        self.precision = Precision(spec.precision, device.type)
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def configure_model(self, module) -> None:
        module.configure_model()

    def setup(self, module, build_optimizers, micro_batch_size=None) -> None:
        self.module = self.precision.convert_module(module.to(self.device))
        if self.spec.compile:
            apply_compile(
                module, options=self.spec.compile, whole=True
            )  # no hook between blocks to keep
        if build_optimizers is not None:
            self.optimizers, self.schedulers = build_optimizers_fast(
                build_optimizers, self.spec, backend="torch", device_type=self.device.type
            )

    def forward(self, step, *args, sync_grads: bool = True):
        with self.precision.autocast():  # one process: there is no gradient to synchronise
            return step(*args)

    def backward(self, loss, **options) -> None:
        self.precision.backward(loss, **options)

    def step(self, should_step: StepGate | None = None) -> StepStats:
        return optimizer_step(self.optimizers, self.precision, self.spec, should_step=should_step)

    def save(self, path: Path) -> None:
        save_replicated(
            path,
            self.module,
            self.optimizers,
            {
                "precision": self.precision.state_dict(),
                "param_names": optimizer_param_names(self.module, self.optimizers),
            },
        )  # read on other strategies

    def load(
        self, path: Path, with_optimizer: bool = True, portable: Portable | None = None
    ) -> None:
        if (
            portable is not None
        ):  # another strategy's checkpoint, in the neutral form (strategies/portable.py)
            write_torch(portable, self.module, self.optimizers, with_optimizer, path)
            self.precision.load_state_dict(portable.get("precision", {}))
            return
        state = load_replicated(path, self.module, self.optimizers, with_optimizer)
        self.precision.load_state_dict(state.get("precision", {}))

    def teardown(self) -> None:
        pass  # nothing was started; the module is the user's, untouched


class SingleDeviceStrategy(abc.ABC):
    """Lightning's `SingleDeviceStrategy(device=...)`: returns a `SingleDevice`, and every
    SingleDevice is an instance. The device comes from the Trainer's `accelerator`; a `device` that
    names another family, or a GPU other than the process's own, is a ConfigError at setup, as are
    Lightning's plugin keywords (`checkpoint_io`, `precision_plugin`: use `precision=`)."""

    def __new__(  # type: ignore[misc]
        cls,
        device: Any = "cpu",
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> SingleDevice:
        for key, value in (
            ("accelerator", accelerator),
            ("checkpoint_io", checkpoint_io),
            ("precision_plugin", precision_plugin),
        ):
            if value is not None:
                raise ConfigError(
                    f"SingleDeviceStrategy({key}={value!r}) is not supported: give the Trainer "
                    "accelerator= and precision=; checkpoints are written by the strategy itself."
                )
        try:
            wanted = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(
                f"SingleDeviceStrategy(device={device!r}) is not valid: expected 'cpu', 'cuda' or "
                "'cuda:N'."
            ) from e
        strategy = SingleDevice()
        strategy.wanted = wanted
        return strategy


SingleDeviceStrategy.register(SingleDevice)
