"""The device families at Lightning's path (`lightning.pytorch.accelerators`): `trainer.accelerator`
is a `CPUAccelerator` or a `CUDAAccelerator`, and code written for Lightning asks these classes what
the machine has (`CUDAAccelerator.is_available()`, `.auto_device_count()`) or for a device's
statistics (`trainer.accelerator.get_device_stats(device)`, as a device-stats callback does).

They describe; they do not place anything: the strategy moves the model and the batches. MPS, XLA
(TPU), HPU and IPU are not planned (docs/porting.md)."""

from __future__ import annotations

import os
from typing import Any

import psutil
import torch


class Accelerator:
    """A device family. Every method is a question about the machine; `setup_device` and `teardown`
    exist for code that calls them and do what the family needs (select the CUDA device)."""

    @staticmethod
    def name() -> str:
        raise NotImplementedError

    @staticmethod
    def is_available() -> bool:
        raise NotImplementedError

    @staticmethod
    def auto_device_count() -> int:
        raise NotImplementedError

    def setup_device(self, device: torch.device) -> None:
        """Nothing to prepare for this family."""

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        raise NotImplementedError

    def teardown(self) -> None:
        """Nothing to release for this family."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CPUAccelerator(Accelerator):
    """The host's cores; `devices` counts processes (ranks), each on a share of the cores."""

    @staticmethod
    def name() -> str:
        return "cpu"

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def auto_device_count() -> int:
        return 1  # one rank unless `devices` asks for more

    @staticmethod
    def parse_devices(devices: int | str) -> int:
        count = int(devices)
        if count < 1:
            raise ValueError(f"devices={devices!r} is not valid for the CPU: expected an int >= 1.")
        return count

    @staticmethod
    def get_parallel_devices(devices: int | str) -> list[torch.device]:
        return [torch.device("cpu")] * CPUAccelerator.parse_devices(devices)

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        """The host's memory, CPU and swap use, in percent."""
        return {
            "cpu_vm_percent": psutil.virtual_memory().percent,
            "cpu_percent": psutil.cpu_percent(),
            "cpu_swap_percent": psutil.swap_memory().percent,
        }


class CUDAAccelerator(Accelerator):
    """NVIDIA GPUs through torch.cuda."""

    @staticmethod
    def name() -> str:
        return "cuda"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def auto_device_count() -> int:
        return torch.cuda.device_count()

    @staticmethod
    def parse_devices(devices: int | str | list[int]) -> list[int] | None:
        """GPU indices: a count takes the first ones, a list or "0,2" names them, -1 or "-1"
        means all; 0 means none (None)."""
        if isinstance(devices, str):
            devices = (
                [int(d) for d in devices.split(",") if d.strip()]
                if "," in devices
                else int(devices)
            )
        if isinstance(devices, int):
            if devices == 0:
                return None
            devices = list(range(torch.cuda.device_count() if devices == -1 else devices))
        return list(devices)

    @staticmethod
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("cuda", i) for i in devices]

    def setup_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDAAccelerator.setup_device({device}): not a CUDA device.")
        torch.cuda.set_device(device)

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        """torch's allocator statistics for `device` (`torch.cuda.memory_stats`)."""
        return torch.cuda.memory_stats(device)

    def teardown(self) -> None:
        torch.cuda.empty_cache()


def accelerator_for(device_type: str) -> Accelerator:
    """The family of a run's device type ("cpu" or "cuda")."""
    return CUDAAccelerator() if device_type == "cuda" else CPUAccelerator()


# Lightning's `find_usable_cuda_devices(n)` is a question of the same kind.
def find_usable_cuda_devices(num_devices: int = -1) -> list[int]:
    """The first `num_devices` visible GPU indices (-1: all). Raises ValueError when fewer exist."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wanted = visible if num_devices == -1 else num_devices
    if wanted > visible:
        raise ValueError(
            f"find_usable_cuda_devices({num_devices}): {visible} CUDA GPU(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})."
        )
    return list(range(wanted))


__all__ = [
    "Accelerator",
    "CPUAccelerator",
    "CUDAAccelerator",
    "accelerator_for",
    "find_usable_cuda_devices",
]
