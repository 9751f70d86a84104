"""Lightning's model summary: one row per layer (name, type, parameters, train/eval mode, FLOPs and,
given `example_input_array`, the input and output shapes), and the totals under it.

    >>> print(summarize(model, max_depth=2))       # or ModelSummary(model, max_depth=2)

Shapes and FLOPs come from one forward pass of `model.example_input_array` (in eval mode, without
gradients; every module's mode is put back afterwards). Parameter counts are of the whole model,
also when it is sharded: ZeRO-3 leaves an empty local tensor and the full count in `ds_numel`,
FSDP2's DTensors report their global size. A lazy layer's uninitialised parameters count 0, with
a warning.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter
from torch.utils.flop_counter import FlopCounterMode

UNKNOWN_SIZE = "?"  # a layer the example forward did not reach, or an input without a shape
NOT_APPLICABLE = "n/a"  # the columns of the row of parameters that no layer holds
LEFTOVER_PARAMS_NAME = "other params"
_UNITS = (" ", "K", "M", "B", "T")
_BITS = {"64": 64, "32": 32, "16": 16, "bf16": 16, "16-true": 16, "bf16-true": 16}
_BITS.update({"32-true": 32, "64-true": 64})
_warned_lazy: list[bool] = []


def parse_batch_shape(batch: Any) -> str | list:
    """The shape of a tensor as a list, of a list/tuple as a list of shapes, else UNKNOWN_SIZE."""
    if hasattr(batch, "shape"):
        return list(batch.shape)
    if isinstance(batch, (list, tuple)):
        return [parse_batch_shape(item) for item in batch]
    return UNKNOWN_SIZE


def numel(param: torch.Tensor) -> int:
    """How many values `param` holds in the whole model: ZeRO-3's `ds_numel` for its empty local
    shard, 0 for an uninitialised lazy parameter."""
    if isinstance(param, UninitializedParameter) and not hasattr(param, "device_mesh"):
        if _warned_lazy:
            return 0
        _warned_lazy.append(True)  # once per process, as Lightning's warning cache
        warnings.warn(
            "The total number of parameters detected may be inaccurate because the model contains "
            "an instance of `UninitializedParameter`. To get an accurate number, set "
            "`self.example_input_array` in your LightningModule.",
            stacklevel=3,
        )
        return 0
    return int(getattr(param, "ds_numel", param.numel()))


def class_name(module: nn.Module) -> str:
    """The user's class name: FSDP2's `fully_shard` swaps a module's class for a subclass named
    FSDP<Name>."""
    cls = type(module)
    if len(cls.__bases__) == 2 and cls.__bases__[0].__name__ == "FSDPModule":
        return cls.__bases__[1].__name__
    return cls.__name__


class LayerSummary:
    """One layer: its type, parameter count, mode, and the input and output shapes of the first
    forward pass after it was created (a hook that removes itself records them)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._in_size: str | list | None = None
        self._out_size: str | list | None = None
        self._hook_handle = None
        if not isinstance(module, torch.jit.ScriptModule):  # scripted modules take no hooks
            self._hook_handle = module.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = (*args, *(kwargs or {}).values())
        self._in_size = parse_batch_shape(inputs[0] if len(inputs) == 1 else inputs)
        self._out_size = parse_batch_shape(out)
        self.detach_hook()  # a module called again (a recurrent block) keeps its first shapes

    def detach_hook(self) -> None:
        if self._hook_handle is not None:
            self._hook_handle.remove()

    def __del__(self) -> None:
        self.detach_hook()

    @property
    def in_size(self) -> str | list:
        return self._in_size or UNKNOWN_SIZE

    @property
    def out_size(self) -> str | list:
        return self._out_size or UNKNOWN_SIZE

    @property
    def layer_type(self) -> str:
        return class_name(self._module)

    @property
    def num_parameters(self) -> int:
        return sum(numel(p) for p in self._module.parameters())

    @property
    def training(self) -> bool:
        return self._module.training


class ModelSummary:
    """The summary of `model` down to `max_depth` (1: its children, -1: every module, 0: none).
    `str(summary)` is the table; the properties are its columns and totals.

    Raises ValueError for a `max_depth` other than -1, 0 or a positive integer."""

    def __init__(self, model: nn.Module, max_depth: int = 1) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(f"`max_depth` can be -1, 0 or > 0, got {max_depth}.")
        self._model, self._max_depth = model, max_depth
        self._flop_counter = FlopCounterMode(display=False, depth=max_depth + 1)
        self._layer_summary = self.summarize()
        trainer = getattr(model, "_trainer", None)
        precision = str(getattr(trainer, "precision", "32-true")) if trainer else "32-true"
        if precision not in _BITS:
            warnings.warn(
                f"Precision {precision} is not supported by the model summary. Estimated model "
                "size in MB will not be accurate. Using 32 bits instead.",
                stacklevel=2,
            )
        self._precision_megabytes = _BITS.get(precision, 32) / 8 * 1e-6

    @property
    def named_modules(self) -> list[tuple[str, nn.Module]]:
        if self._max_depth == 0:
            return []
        if self._max_depth == 1:
            return list(self._model.named_children())
        return list(self._model.named_modules())[1:]  # the model itself is not a row

    def summarize(self) -> dict[str, LayerSummary]:
        """The layers' summaries by name, after the example forward (when there is an input)."""
        layers = {name: LayerSummary(module) for name, module in self.named_modules}
        if getattr(self._model, "example_input_array", None) is not None:
            self._forward_example_input()
        for layer in layers.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            layers = {k: v for k, v in layers.items() if k.count(".") < self._max_depth}
        return layers

    def _forward_example_input(self) -> None:
        model, example = self._model, self._model.example_input_array
        params = next(model.parameters(), None)
        device = params.device if params is not None else torch.device("cpu")
        hooks = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
        if all(callable(getattr(model, h, None)) for h in hooks):  # a LightningModule's
            before, move, after = (getattr(model, h) for h in hooks)
            example = after(move(before(example, 0), device, 0), 0)
        modes = [(m, m.training) for m in model.modules()]
        scripted = any(isinstance(m, torch.jit.ScriptModule) for m in model.modules())
        counting = contextlib.nullcontext() if scripted else self._flop_counter
        model.eval()
        try:
            with torch.no_grad(), counting:
                if isinstance(example, (list, tuple)):
                    model(*example)
                elif isinstance(example, dict):
                    model(**example)
                else:
                    model(example)
        except Exception as exc:
            if getattr(model, "_trainer", None) is None:
                raise
            # At fit start the summary must not stop training: the example may not suit the
            # precision the strategy set up (bf16 weights, fp32 input).
            warnings.warn(
                f"The model summary's forward of example_input_array failed ({exc!r}): its input "
                "and output sizes show as '?'.",
                stacklevel=2,
            )
        finally:
            for module, training in modes:
                module.training = training

    # ------------------------------------------------------------------ columns
    @property
    def layer_names(self) -> list[str]:
        return list(self._layer_summary)

    @property
    def layer_types(self) -> list[str]:
        return [layer.layer_type for layer in self._layer_summary.values()]

    @property
    def in_sizes(self) -> list:
        return [layer.in_size for layer in self._layer_summary.values()]

    @property
    def out_sizes(self) -> list:
        return [layer.out_size for layer in self._layer_summary.values()]

    @property
    def param_nums(self) -> list[int]:
        return [layer.num_parameters for layer in self._layer_summary.values()]

    @property
    def training_modes(self) -> list[bool]:
        return [layer.training for layer in self._layer_summary.values()]

    @property
    def flop_counts(self) -> dict[str, dict[Any, int]]:
        counts = self._flop_counter.get_flop_counts()
        root = type(self._model).__name__
        return {name: counts.get(f"{root}.{name}", {}) for name in self.layer_names}

    # ------------------------------------------------------------------ totals
    @property
    def total_training_modes(self) -> dict[str, int]:
        modes = [m.training for m in list(self._model.modules())[1:]]
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def total_parameters(self) -> int:
        return sum(numel(p) for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return sum(numel(p) for p in self._model.parameters() if p.requires_grad)

    @property
    def total_layer_params(self) -> int:
        return sum(self.param_nums)

    @property
    def model_size(self) -> float:
        """The parameters' size in MB at the Trainer's precision (32 bits without a Trainer)."""
        return self.total_parameters * self._precision_megabytes

    @property
    def total_flops(self) -> int:
        return self._flop_counter.get_total_flops()

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        """The table's columns as (header, cells), every cell a string; a last row holds the
        parameters that no listed layer holds, when there are any."""
        flops = [sum(c.values()) for c in self.flop_counts.values()]
        columns = [
            (" ", [str(i) for i in range(len(self._layer_summary))]),
            ("Name", self.layer_names),
            ("Type", self.layer_types),
            ("Params", [get_human_readable_count(n) for n in self.param_nums]),
            ("Mode", ["train" if t else "eval" for t in self.training_modes]),
            ("FLOPs", [get_human_readable_count(n) for n in flops]),
        ]
        if getattr(self._model, "example_input_array", None) is not None:
            columns.append(("In sizes", [str(s) for s in self.in_sizes]))
            columns.append(("Out sizes", [str(s) for s in self.out_sizes]))
        leftover = self.total_parameters - self.total_layer_params
        if leftover > 0:
            extra = {" ": " ", "Name": LEFTOVER_PARAMS_NAME, "Params": None}
            for header, cells in columns:
                value = extra.get(header, NOT_APPLICABLE)
                cells.append(get_human_readable_count(leftover) if value is None else value)
        return columns

    def totals(self) -> list[tuple[str, str]]:
        """The lines under the table: (value, what it counts)."""
        return summary_totals(
            self.total_parameters,
            self.trainable_parameters,
            self.model_size,
            self.total_training_modes,
            self.total_flops,
        )

    def __str__(self) -> str:
        return format_table(self._get_summary_data(), self.totals())

    __repr__ = __str__


def format_table(columns: list[tuple[str, list[str]]], totals: list[tuple[str, str]]) -> str:
    """Lightning's plain-text summary: the columns separated by ` | `, a rule above and below the
    rows, then one line per total."""
    widths = [max([len(header), *(len(c) for c in cells)]) for header, cells in columns]
    rule = "-" * (sum(widths) + 3 * (len(columns) + 1))
    rows = [[header for header, _ in columns]]
    rows += [list(cells) for cells in zip(*(cells for _, cells in columns))]
    lines = [" | ".join(f"{cell:<{w}}" for cell, w in zip(row, widths)) for row in rows]
    lines = [lines[0], rule, *lines[1:], rule]
    return "\n".join(lines + [f"{value:<10}{label}" for value, label in totals])


def summary_totals(
    total: int, trainable: int, model_size: float, modes: dict[str, int], flops: int
) -> list[tuple[str, str]]:
    """The lines under a summary table, (value, what it counts)."""
    return [
        (get_human_readable_count(trainable), "Trainable params"),
        (get_human_readable_count(total - trainable), "Non-trainable params"),
        (get_human_readable_count(total), "Total params"),
        (get_formatted_model_size(model_size), "Total estimated model params size (MB)"),
        (str(modes["train"]), "Modules in train mode"),
        (str(modes["eval"]), "Modules in eval mode"),
        (get_human_readable_count(flops), "Total Flops"),
    ]


def get_formatted_model_size(total_model_size: float) -> str:
    """A size in MB with three decimals and thousands separators: 5500.0 -> '5,500.000'."""
    return f"{total_model_size:,.3f}"


def get_human_readable_count(number: float) -> str:
    """A count with K, M, B or T for thousands, millions, billions and trillions: 123 -> '123  ',
    1234 -> '1.2 K', 4e14 -> '400 T', 5e15 -> '5,000 T'."""
    if number < 0:
        raise ValueError(f"get_human_readable_count({number}): expected a count ≥ 0.")
    digits = int(math.floor(math.log10(number))) + 1 if number > 0 else 1
    group = min(math.ceil(digits / 3), len(_UNITS)) - 1  # 0: units, 1: thousands, ...
    scaled = number / 10 ** (3 * group)
    if group == 0 or scaled >= 100:
        return f"{int(scaled):,d} {_UNITS[group]}"
    return f"{scaled:,.1f} {_UNITS[group]}"


def summarize(lightning_module: nn.Module, max_depth: int = 1) -> ModelSummary:
    """`ModelSummary(lightning_module, max_depth)`: the summary down to `max_depth` (0: none)."""
    return ModelSummary(lightning_module, max_depth=max_depth)
