"""One process, one device: no wrapping, just precision and the optimizer step."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightspeed.checkpoint.io import load_replicated, save_replicated
from lightspeed.checkpoint.layouts import Portable, optimizer_param_names, write_torch
from lightspeed.perf.kernels import apply_compile, build_optimizers_fast
from lightspeed.perf.precision import Precision, StepGate, optimizer_step
from lightspeed.runtime.launch import DistInfo
from lightspeed.specs import RunSpec, StepStats


@dataclass
class SingleDevice:
    """The strategy for `devices=1`."""

    name: str = "single"
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)

    def check(self, spec: RunSpec) -> None:
        pass  # one device honours every flag

    def connect(self, spec: RunSpec, dist_info: DistInfo, device: torch.device) -> None:
        self.spec, self.device = spec, device
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

    def backward(self, loss) -> None:
        self.precision.backward(loss)

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
