"""`DeviceStatsMonitor`: the device's statistics (CUDA: torch's allocator counters; CPU: memory, CPU
and swap use in percent) sent to the loggers at the start and end of each training, validation and
test batch, on the steps the Trainer logs (`log_every_n_steps`).

    Trainer(callbacks=[DeviceStatsMonitor()], logger=CSVLogger("logs"))

Keys are `DeviceStatsMonitor.<hook>/<statistic>`, as in Lightning. `cpu_stats=True` adds the host's
statistics beside a GPU's (prefixed `cpu_` already); `False` leaves them out on a CPU run too."""

from __future__ import annotations

from typing import Any

from lightspeed.accelerators import CPUAccelerator, accelerator_for
from lightspeed.callbacks.callback import Callback, Module, Trainer
from lightspeed.errors import ConfigError


class DeviceStatsMonitor(Callback):
    def __init__(self, cpu_stats: bool | None = None) -> None:
        self.cpu_stats = cpu_stats

    def setup(self, trainer: Trainer, module: Module, stage: str) -> None:
        if stage == "fit" and not trainer.loggers:
            raise ConfigError(
                "DeviceStatsMonitor sends its statistics to the loggers, and this Trainer has none "
                "(logger=False): give it a logger, or leave the callback out."
            )

    def _log(self, trainer: Trainer, hook: str) -> None:
        if not trainer.loggers or not trainer.is_log_step:
            return
        device = trainer.device
        on_cpu = device.type == "cpu"
        stats: dict[str, Any] = {}
        if not on_cpu or self.cpu_stats is not False:
            stats.update(accelerator_for(device.type).get_device_stats(device))
        if self.cpu_stats and not on_cpu:
            stats.update(CPUAccelerator().get_device_stats(device))
        numbers = {
            f"{type(self).__qualname__}.{hook}/{k}": float(v)
            for k, v in stats.items()
            if isinstance(v, int | float)
        }
        if numbers:
            trainer.log_metrics(numbers)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._log(trainer, "on_train_batch_start")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._log(trainer, "on_train_batch_end")

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self._log(trainer, "on_validation_batch_start")

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self._log(trainer, "on_validation_batch_end")

    def on_test_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self._log(trainer, "on_test_batch_start")

    def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self._log(trainer, "on_test_batch_end")
