"""One process, one device: no wrapping, just precision and the optimizer step."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint_io import load_replicated, save_replicated
from ..precision import Precision, build_clip_fn
from .base import RunSpec


@dataclass
class SingleDevice:
    """The strategy for `devices=1`."""

    name: str = "single"
    is_manual_optimization_supported: bool = True
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)

    def connect(self, spec: RunSpec) -> None:
        self.spec = spec
        self.precision = Precision(spec)
        if spec.device.type == "cuda":
            torch.cuda.set_device(spec.device)

    def configure_model(self, module) -> None:
        module.configure_model()

    def setup(self, module, build_optimizers) -> None:
        self.module = self.precision.convert_module(module.to(self.spec.device))
        if build_optimizers is not None:
            self.optimizers, self.schedulers = build_optimizers()
        self.clip_fn = build_clip_fn(self.spec)

    def forward(self, step, *args):
        with self.precision.autocast():
            return step(*args)

    def set_grad_sync(self, is_boundary: bool) -> None:
        pass  # one process: there is nothing to synchronise

    def backward(self, loss) -> None:
        self.precision.backward(loss)

    def step(self):
        return self.precision.step(self.optimizers, self.clip_fn)

    def save(self, path: Path) -> None:
        if self.spec.dist.is_global_zero:
            save_replicated(path, self.module, self.optimizers, {"precision": self.precision.state_dict()})

    def load(self, path: Path, with_optimizer: bool = True) -> None:
        state = load_replicated(path, self.module, self.optimizers, with_optimizer)
        self.precision.load_state_dict(state.get("precision", {}))

    def teardown(self) -> None:
        pass
