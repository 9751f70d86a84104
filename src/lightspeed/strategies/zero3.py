"""ZeRO-3 helpers for the DeepSpeed strategy: building a model partitioned as it is created (deep copies included),
the whole size of a partitioned model, rank 0's plain build copied into the partitions, and a full state dict loaded
into them. Each function that gathers parameters is collective."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..plan_probe import repeated_blocks


def partitioned_init(deepspeed, config: dict, remote_device: str | None):
    """DeepSpeed's `zero.Init` context (every parameter partitioned as its module is built), whose partitioned
    parameters also survive `copy.deepcopy`.

    Modules that clone a built layer (`nn.TransformerEncoder(layer, n)` deep-copies `layer` n times) would
    otherwise copy a partitioned parameter's bookkeeping as it is: the copies share the original's ZeRO id and
    partition functions, hold an empty tensor, and fail at the first gather. Here each such parameter's deep copy
    gathers the original's whole value and partitions it as a new ZeRO-3 parameter, which is what the plain
    module's deep copy means: an equal, independent tensor. Collective: every rank builds the same modules."""

    class Init(deepspeed.zero.Init):
        def _post_init_method(self, module: torch.nn.Module) -> None:
            super()._post_init_method(module)
            for param in module.parameters(recurse=False):
                if hasattr(param, "ds_id") and "__deepcopy__" not in param.__dict__:
                    # copy.deepcopy looks __deepcopy__ up on the object, so this parameter alone copies this way
                    param.__deepcopy__ = functools.partial(_deepcopy_partitioned, deepspeed, param)

    return Init(config_dict_or_path=config, remote_device=remote_device)


def _deepcopy_partitioned(deepspeed, param: torch.nn.Parameter, memo: dict) -> torch.nn.Parameter:
    with deepspeed.zero.GatheredParameters([param]):
        clone = torch.nn.Parameter(param.data.detach().clone(), requires_grad=param.requires_grad)
    param.convert_to_zero_parameters(param_list=[clone])  # partitioned by the same Init (rank 0's values)
    clone.__deepcopy__ = functools.partial(_deepcopy_partitioned, deepspeed, clone)
    memo[id(param)] = clone
    return clone


def destroy_engine(engine, module: torch.nn.Module) -> None:
    """Destroys a DeepSpeed engine so that another may wrap `module` (or its submodules) afterwards.

    `engine.destroy()` removes a ZeRO-3 engine's hooks, but DeepSpeed (0.19) also caches on each submodule the
    autograd functions its backward hooks run (`pre_bwd_fn`, `post_bwd_fn`), bound to that engine's parameter
    coordinator, and a later engine's hooks reuse them: the old coordinator then gathers parameters in the
    backward and the new one never releases them (an evaluation engine before fit, then one engine per
    optimizer, failed with "Cannot free a ZeRO-3 parameter while it is still active"). Dropping them lets the
    next engine bind its own."""
    engine.destroy()
    for m in module.modules():
        m.__dict__.pop("pre_bwd_fn", None)
        m.__dict__.pop("post_bwd_fn", None)


def whole_numel(module: torch.nn.Module) -> int:
    """Parameters of `module`, counting ZeRO-3's partitioned ones at their whole size."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def copy_from_rank0(deepspeed, module: torch.nn.Module, plain: torch.nn.Module | None) -> None:
    """Overwrites the partitioned parameters (and buffers) with rank 0's plain build. Collective.

    One parameter is gathered at a time, so the copy never holds more than one full tensor on the device:
    the models this path exists for are the ones that do not fit there whole."""
    source = dict(plain.named_parameters()) if plain is not None else {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            if plain is not None:
                p.copy_(source[name])
    source_buffers = dict(plain.named_buffers()) if plain is not None else {}
    for name, b in module.named_buffers():
        b.copy_(source_buffers.get(name, b))
        dist.broadcast(b, src=0)


def load_weights(deepspeed, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Loads a full state dict into a module; under ZeRO-3 rank 0 loads and DeepSpeed re-partitions. Collective."""
    params = list(module.parameters())
    missing, unexpected, is_z3 = [], [], any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=is_z3), torch.no_grad():
        if not is_z3 or dist.get_rank() == 0:
            missing, unexpected = module.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k in dict(module.named_parameters())]:
        raise ConfigError(f"checkpoint does not match {type(module).__name__}: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}.")


def check_leaf_modules(classes) -> None:
    """Raises ConfigError unless `classes` is None, or a list of nn.Module classes (DeepSpeed's `leaf_modules`)."""
    if classes is not None and (not isinstance(classes, (list, tuple)) or not all(
            isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes)):
        raise ConfigError(f"DeepSpeed leaf_modules={classes!r} is not valid: use None (the repeated blocks), [] (no "
                          "leaf modules) or a list of nn.Module classes, e.g. [Block].")


def mark_leaf_modules(deepspeed, module: torch.nn.Module, classes: list[type] | None) -> int:
    """Marks the instances of `classes` in `module` as ZeRO-3 leaf modules (DeepSpeed's `set_z3_leaf_modules`):
    each gathers all its parameters at its own forward and backward, so DeepSpeed runs one fetch and one pair of
    hooks per block instead of per submodule. `classes` None means the repeated blocks (the classes of the children
    of every nn.ModuleList that hold parameters); [] marks nothing. Returns the largest marked instance's
    parameter count (0 if none). Raises ConfigError when a class named by the user has no instance in the model."""
    if classes is None:
        classes = list(dict.fromkeys(type(c) for c in repeated_blocks(module) if any(True for _ in c.parameters())))
    if missing := [c.__name__ for c in classes if not any(isinstance(m, c) for m in module.modules())]:
        raise ConfigError(f"DeepSpeed leaf_modules names {missing}, which {type(module).__name__} does not contain.")
    if classes:
        deepspeed.utils.set_z3_leaf_modules(module, list(classes))
    return max((whole_numel(m) for m in module.modules() if isinstance(m, tuple(classes))), default=0)


DS_PREFETCH_BUCKET = 50_000_000  # DeepSpeed's default stage3_prefetch_bucket_size (elements)


def prefetch_bucket(leaf_numel: int) -> int:
    """stage3_prefetch_bucket_size for leaf blocks of up to `leaf_numel` parameters: the next two blocks.

    DeepSpeed prefetches upcoming parameters until the bucket is full. Its default (5e7) is about one block of a
    d=2048 GPT (12·d² = 5.03e7), so the next block's gather barely overlapped the current block's compute; two
    blocks ahead lets each gather hide behind a whole block (2×H200: 45.0k against 40.8k tok/s per GPU, same
    peak memory; docs/benchmarks.md). Costs up to two blocks' gathered parameters of extra memory."""
    return max(DS_PREFETCH_BUCKET, 2 * leaf_numel)
