"""Checkpoints that travel: any strategy's checkpoint, saved on any world size, resumed under any
other.

    if layout(saved_strategy, saved_world_size) != layout(strategy.name, world_size):
        portable = read_portable(path, saved_strategy)   # rank 0, offline: the files -> the neutral
        form
    strategy.load(path, portable=portable)               # every rank: the neutral form -> its own
    shards

The neutral form is torch's own full, name-keyed layout (what `get_model_state_dict` and
`get_optimizer_state_dict(full_state_dict=True)` return), named by the user Module's parameter
names:

    {"model": {name: tensor},                    # the Module's state_dict keys; tied weights under
    each name
     "optim": {"state": {name: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}},   # or SGD's
     momentum_buffer
               "param_groups": [{hyper-parameters..., "params": [name, ...]}]},      # every
               optimizer's, in order
     "precision": {...}}                         # the loss scaler's state, where the source has one

Readers use each engine's own tool: the replicated files as written (optimizer indices become names
through the names recorded at save time), torch.distributed.checkpoint's offline load of every
shard, DeepSpeed's `ds_to_universal` (its resharding tool) into a temporary directory. Writers: an
index-keyed state dict for torch optimizers (single, DDP, and ZeroRedundancyOptimizer, which keeps
its partition of it); torch's `set_model_state_dict` / `set_optimizer_state_dict` for FSDP (torch
cuts the shards); DeepSpeed's tensor-fragment API (`safe_set_full_fp32_param`,
`safe_set_full_optimizer_state`) for ZeRO stages 1, 2 and 3.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightspeed.checkpoint import single_file
from lightspeed.checkpoint.io import (
    DCP_DIR,
    DEEPSPEED_DIR,
    FSDP_EXTRA,
    OPTIMIZER,
    WEIGHTS,
    load_weights,
)
from lightspeed.checkpoint.neutral import (
    CHECKPOINT_PREFIX,
    IMPLEMENTATION,
    Portable,
    canonical,
    named_optimizer_state,
    optimizer_param_names,
    param_names,
)
from lightspeed.errors import ConfigError

__all__ = [  # the neutral form's names, used by the strategies' writers from here
    "CHECKPOINT_PREFIX",
    "IMPLEMENTATION",
    "Portable",
    "canonical",
    "named_optimizer_state",
    "optimizer_param_names",
    "param_names",
]


def layout(strategy: str, world_size: int) -> str:
    """The on-disk layout `strategy` writes on `world_size` ranks. Two runs with one layout load
    each other's checkpoints natively; any other pair goes through the neutral form."""
    if strategy in ("single", "ddp", "ddp_sharded"):
        return (
            "replicated"  # whole tensors (ZeRO-1 consolidates on save): any world size reads them
        )
    if strategy.startswith("fsdp"):
        return "dcp"  # torch.distributed.checkpoint reshards on load
    if strategy.startswith("deepspeed_stage_"):
        # offload writes the same; AutoTP (`_tp2`) writes each TP rank's cut (mp_rank_01, ...)
        stage, _, tp = strategy[len("deepspeed_stage_") :].partition("_tp")
        return f"deepspeed-{f'tp{tp}-' if tp else ''}zero{stage[0]}-{world_size}ranks"
    return f"{strategy}-{world_size}ranks"


def writes_file(strategy: str, world_size: int) -> bool:
    """Whether `strategy` saves Lightning's one `.ckpt` file (the replicated layout: whole tensors,
    as Lightning's single-device and DDP strategies write) rather than a directory."""
    return layout(strategy, world_size) == "replicated"


def read_portable(path: Path, strategy: str, with_optimizer: bool = True) -> Portable:
    """Reads the checkpoint `path` (a directory written by `strategy`, or one file) into the neutral
    form on CPU. Offline: no process group is used (call it on one rank). Raises ConfigError naming
    the file that is missing or unusable."""
    if path.is_file():
        return single_file.portable(single_file.read(path), path, with_optimizer)
    match layout(strategy, 1).split("-")[0]:
        case "replicated":
            return _read_replicated(path, with_optimizer)
        case "dcp":
            return _read_dcp(path, with_optimizer)
        case "deepspeed":
            return _read_deepspeed(path, with_optimizer)
    raise ConfigError(
        f"checkpoint {path} was written by strategy {strategy!r}, whose files lightspeed cannot "
        "read for another strategy or world size."
    )


def _read_replicated(path: Path, with_optimizer: bool) -> Portable:
    out: Portable = {
        "model": load_weights(path / WEIGHTS),
        "optim": {"state": {}, "param_groups": []},
    }
    if not with_optimizer:
        return out
    saved = torch.load(path / OPTIMIZER, map_location="cpu", weights_only=False)
    if "param_names" not in saved:
        raise ConfigError(
            f"checkpoint {path} was written before lightspeed recorded parameter names in "
            f"{OPTIMIZER}: its optimizer state can only be resumed by single, ddp or ddp_sharded."
        )
    out["optim"] = named_optimizer_state(saved["optimizers"], saved["param_names"])
    out["precision"] = saved.get("precision", {})
    return out


def _read_dcp(path: Path, with_optimizer: bool) -> Portable:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = path / DCP_DIR
    if not (folder / ".metadata").exists():
        raise ConfigError(
            f"checkpoint {path} has no FSDP shards: {folder / '.metadata'} is missing."
        )
    keys = {"model", "optim"} if with_optimizer else {"model"}
    # no_dist: rank 0 reads alone; the planner rebuilds every tensor from the metadata, whole, from
    # all shards.
    state: dict[str, Any] = {}
    _load_state_dict(
        state,
        storage_reader=dcp.FileSystemReader(str(folder)),
        planner=_EmptyStateDictLoadPlanner(keys=keys),
        no_dist=True,
    )
    out = {
        "model": dict(state["model"]),
        "optim": state.get("optim", {"state": {}, "param_groups": []}),
    }
    if (path / FSDP_EXTRA).exists():
        out["precision"] = torch.load(path / FSDP_EXTRA, weights_only=False).get("precision", {})
    return out


def _read_deepspeed(path: Path, with_optimizer: bool) -> Portable:
    """Every engine's part (one, or one per optimizer under manual optimization), merged."""
    out: Portable = {"model": {}, "optim": {"state": {}, "param_groups": []}}
    for tag in engine_tags(path, DEEPSPEED_DIR) or [DEEPSPEED_DIR]:
        part = _read_engine(path, path / tag, with_optimizer)
        out["model"].update(part["model"])
        out["optim"]["state"].update(part["optim"]["state"])
        out["optim"]["param_groups"] += part["optim"]["param_groups"]
    return out


def _read_engine(path: Path, src: Path, with_optimizer: bool) -> Portable:
    """DeepSpeed's own `ds_to_universal` merges the ZeRO shards into one folder per parameter
    (`zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`, and under stages 1-2 `step.pt`), which
    this reads."""
    model_states = sorted(src.glob("*model_states.pt"))
    if not model_states:
        raise ConfigError(f"checkpoint {path} has no DeepSpeed model states in {src}.")
    states = torch.load(model_states[0], map_location="cpu", weights_only=False)
    with tempfile.TemporaryDirectory(prefix="lightspeed-universal-") as tmp:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(src),
                "--output_folder",
                tmp,
                "--num_extract_workers",
                "1",
                "--num_merge_workers",
                "1",
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            hint = (
                " It converts Adam's state (exp_avg, exp_avg_sq) only: a DeepSpeed checkpoint of "
                "another "
                "optimizer (SGD's momentum) resumes under the same DeepSpeed stage and world size "
                "only."
                if "KeyError: 'exp_avg'" in done.stderr
                else ""
            )
            raise ConfigError(
                f"checkpoint {path}: DeepSpeed's ds_to_universal failed on {src}.{hint}\n"
                f"{done.stderr[-2000:]}"
            )
        zero = Path(tmp) / "zero"
        optimizer_state = torch.load(zero / "optimizer_state.pt", weights_only=False)
        model: dict[str, torch.Tensor] = {}
        state: dict[str, dict] = {}
        for group in states["param_shapes"]:
            for name, shape in group.items():
                files = {
                    f.stem: torch.load(f, map_location="cpu", weights_only=False)
                    for f in (zero / name).glob("*.pt")
                }
                files = {k: v["param"] if isinstance(v, dict) else v for k, v in files.items()}
                if states.get("mp_world_size", 1) > 1:  # AutoTP: param_shapes are one TP cut's,
                    shape = files["fp32"].shape  # the merged tensors carry their whole shape
                model[canonical(name)] = files.pop("fp32").detach().reshape(shape)
                if with_optimizer:
                    state[canonical(name)] = {
                        k: v.reshape(shape) if k != "step" else torch.tensor(float(v))
                        for k, v in files.items()
                    }  # DeepSpeedCPUAdam's step is an int
    for tied, source in states.get("shared_params", {}).items():
        model[canonical(tied)] = model[canonical(source)]
    for name in states.get("buffer_names", []):
        model[canonical(name)] = states["module"][name]
    if not with_optimizer:
        return {"model": model, "optim": {"state": {}, "param_groups": []}}
    # Stage 3 keeps the step in the optimizer's own state dict; stages 1-2 once per parameter
    # (step.pt).
    inner = optimizer_state.get("optimizer_state_dict", {}).get("state", {})
    step = next((float(s["step"]) for s in inner.values() if "step" in s), None)
    for st in state.values():
        if "step" not in st and step is not None:
            st["step"] = torch.tensor(
                step
            )  # one tensor each: fused optimizers increment it in place
    groups = optimizer_state["param_groups"]
    if len(groups) != len(states["param_shapes"]):
        raise ConfigError(
            f"checkpoint {path}: {len(groups)} DeepSpeed optimizer groups but "
            f"{len(states['param_shapes'])} groups of parameters; lightspeed cannot name them."
        )
    param_groups = [
        {**g, "params": [canonical(n) for n in shapes]}
        for g, shapes in zip(groups, states["param_shapes"])
    ]
    return {"model": model, "optim": {"state": state, "param_groups": param_groups}}


# --------------------------------------------------------------------------------------------------
# writers
def check_model(portable: Portable, module: torch.nn.Module, path: Path) -> None:
    """Raises ConfigError naming the checkpoint and the first parameter whose name or shape differs
    between the checkpoint and `module` (ZeRO-3's partitioned parameters are compared at their whole
    shape)."""
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    for name, p in module.named_parameters(remove_duplicate=False):
        if hasattr(p, "ds_shape"):  # DeepSpeed's attribute (ZeRO-3), unknown to torch's types
            want[canonical(name)] = tuple(p.ds_shape)  # pyright: ignore[reportAttributeAccessIssue]
    got = {k: tuple(v.shape) for k, v in portable["model"].items()}
    for name in [*want, *(k for k in got if k not in want)]:
        if got.get(name) != want.get(name):
            raise ConfigError(
                f"checkpoint {path} does not match {type(module).__name__}: parameter {name!r} is "
                f"{_shape(got.get(name))} in the checkpoint and {_shape(want.get(name))} in the "
                "model."
            )


def _shape(shape: tuple | None) -> str:
    return "absent" if shape is None else f"of shape {list(shape)}"


def indexed_optimizer_state(portable: Portable, opt: Any, names: dict[int, str]) -> dict:
    """The part of the neutral form's optimizer state that belongs to the torch optimizer `opt`,
    keyed by index, as `opt.load_state_dict` takes it. Each group takes the hyper-parameters (lr,
    betas, weight decay, ...) of the saved group holding its first parameter; the implementation
    flags (fused, foreach) stay `opt`'s own."""
    saved_group = {n: g for g in portable["optim"]["param_groups"] for n in g["params"]}
    state, groups, index = {}, [], 0
    for group in opt.param_groups:
        fqns = [names[id(p)] for p in group["params"]]
        source = saved_group.get(fqns[0], {}) if fqns else {}
        hyper = {k: v for k, v in source.items() if k in group and k not in IMPLEMENTATION}
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                **hyper,
                "params": list(range(index, index + len(fqns))),
            }
        )
        state.update(
            {
                index + i: portable["optim"]["state"][n]
                for i, n in enumerate(fqns)
                if n in portable["optim"]["state"]
            }
        )
        index += len(fqns)
    return {"state": state, "param_groups": groups}


def write_torch(
    portable: Portable, module: torch.nn.Module, optimizers: list, with_optimizer: bool, path: Path
) -> None:
    """Writes the neutral form into a whole (unsharded) module and its torch optimizers: single
    device, DDP, and ZeroRedundancyOptimizer, which keeps its own partition of the index-keyed state
    it is given."""
    check_model(portable, module, path)
    module.load_state_dict(portable["model"])
    if with_optimizer:
        names = param_names(module)
        for opt in optimizers:
            opt.load_state_dict(indexed_optimizer_state(portable, opt, names))


def write_fsdp(
    portable: Portable, module: torch.nn.Module, optimizers: list, with_optimizer: bool, path: Path
) -> None:
    """Writes the neutral form into an FSDP2 module and its optimizers: torch keeps each rank's
    shards of the full tensors every rank holds."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    check_model(portable, module, path)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(module, portable["model"], options=options)
    if with_optimizer and optimizers:
        # The saved groups' hyper-parameters, each optimizer's own implementation flags (fused,
        # foreach).
        names = param_names(module)
        target = {
            names[id(p)]: g for opt in optimizers for g in opt.param_groups for p in g["params"]
        }
        groups = []
        for g in portable["optim"]["param_groups"]:
            own = target.get(g["params"][0], {}) if g["params"] else {}
            groups.append(
                {
                    **{k: v for k, v in g.items() if k not in IMPLEMENTATION},
                    **{k: v for k, v in own.items() if k in IMPLEMENTATION},
                    "params": g["params"],
                }
            )
        set_optimizer_state_dict(
            module,
            optimizers,
            {"state": portable["optim"]["state"], "param_groups": groups},
            options=options,
        )


def engine_tag(tag: str, index: int) -> str:
    """The checkpoint tag of DeepSpeed engine `index`: the strategy's own tag for the first,
    `<tag>_<index>` after (one engine per optimizer under manual optimization)."""
    return tag if index == 0 else f"{tag}_{index}"


def engine_tags(path: Path, tag: str) -> list[str]:
    """The engine tags a DeepSpeed checkpoint directory holds, in engine order (one unless manual
    optimizers)."""
    count = 0
    while (path / engine_tag(tag, count)).is_dir():
        count += 1
    return [engine_tag(tag, i) for i in range(count)]
