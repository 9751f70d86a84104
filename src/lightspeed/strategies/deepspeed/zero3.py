"""ZeRO-3 helpers for the DeepSpeed strategy: building a model partitioned as it is created (deep
copies included) with a single-device run's weights (`configure_partitioned`), the whole size of a
partitioned model, rank 0's plain build copied into the partitions, and a full state dict loaded
into them. Each function that gathers parameters is
collective."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any, cast

import psutil
import torch
import torch.distributed as dist

from lightspeed.errors import ConfigError
from lightspeed.perf.kernels import repeated_blocks, skip_alignment_asserts
from lightspeed.runtime.distributed import broadcast_from_rank0
from lightspeed.runtime.memory import cuda_free
from lightspeed.strategies.common import configure_with_plain_twin


def partitioned_init(deepspeed, config: dict, remote_device: str | None):
    """DeepSpeed's `zero.Init` context (every parameter partitioned as its module is built), whose
    partitioned parameters also survive `copy.deepcopy`.

    Modules that clone a built layer (`nn.TransformerEncoder(layer, n)` deep-copies `layer` n times)
    would otherwise copy a partitioned parameter's bookkeeping as it is: the copies share the
    original's ZeRO id and partition functions, hold an empty tensor, and fail at the first gather.
    Here each such parameter's deep copy gathers the original's whole value and partitions it as a
    new ZeRO-3 parameter, which is what the plain module's deep copy means: an equal, independent
    tensor. Collective: every rank builds the same modules."""

    class Init(deepspeed.zero.Init):
        def _post_init_method(self, module: torch.nn.Module) -> None:
            super()._post_init_method(module)
            for param in module.parameters(recurse=False):
                if hasattr(param, "ds_id") and "__deepcopy__" not in param.__dict__:
                    # copy.deepcopy looks __deepcopy__ up on the object, so this parameter alone
                    # copies this way
                    param.__deepcopy__ = functools.partial(_deepcopy_partitioned, deepspeed, param)

    return Init(config_dict_or_path=config, remote_device=remote_device)


def _deepcopy_partitioned(deepspeed, param: torch.nn.Parameter, memo: dict) -> torch.nn.Parameter:
    with deepspeed.zero.GatheredParameters([param]):
        clone = torch.nn.Parameter(param.data.detach().clone(), requires_grad=param.requires_grad)
    # partitioned by the same Init (rank 0's values)
    param.convert_to_zero_parameters(  # pyright: ignore[reportAttributeAccessIssue]  (DeepSpeed's)
        param_list=[clone]
    )
    clone.__deepcopy__ = functools.partial(_deepcopy_partitioned, deepspeed, clone)
    memo[id(param)] = clone
    return clone


def destroy_engine(engine, module: torch.nn.Module) -> None:
    """Destroys a DeepSpeed engine so that another may wrap `module` (or its submodules) afterwards.

    `engine.destroy()` removes a ZeRO-3 engine's hooks, but DeepSpeed (0.19) also caches on each
    submodule the autograd functions its backward hooks run (`pre_bwd_fn`, `post_bwd_fn`), bound to
    that engine's parameter coordinator, and a later engine's hooks reuse them: the old coordinator
    then gathers parameters in the backward and the new one never releases them (an evaluation
    engine before fit, then one engine per optimizer, failed with "Cannot free a ZeRO-3 parameter
    while it is still active"). Dropping them lets the next engine bind its own."""
    engine.destroy()
    for m in module.modules():
        m.__dict__.pop("pre_bwd_fn", None)
        m.__dict__.pop("post_bwd_fn", None)


def full_shapes(deepspeed, module: torch.nn.Module, device: torch.device, local_ranks: int, log0):
    """Under ZeRO-3 a partitioned parameter is an empty 1-D tensor, so `configure_optimizers` rules
    such as "decay if p.dim() >= 2" would silently change the optimizer. Gathering the parameters
    while it runs shows their true shapes (the context returned); skipped, with a `log0` line, when
    the whole model would not fit on `device` (CPU: host memory shared by `local_ranks`).
    Collective."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    free = (
        cuda_free(device)
        if device.type == "cuda"
        else psutil.virtual_memory().available / max(1, local_ranks)
    )
    # Rank 0 decides for all: GatheredParameters is collective, and free memory differs between
    # ranks.
    if not broadcast_from_rank0(
        # ds_numel: an attribute DeepSpeed adds to a partitioned parameter (untyped)
        sum(p.ds_numel for p in params)  # pyright: ignore[reportAttributeAccessIssue]
        * params[0].element_size()
        < 0.5 * free
    ):
        log0(
            "DeepSpeed stage 3: configure_optimizers sees partitioned parameters (the model is too "
            "large to "
            "gather); use p.ds_shape, not p.shape or p.dim(), to group them."
        )
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def whole_numel(module: torch.nn.Module) -> int:
    """Parameters of `module`, counting ZeRO-3's partitioned ones at their whole size."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def copy_from_rank0(deepspeed, module: torch.nn.Module, plain: torch.nn.Module | None) -> None:
    """Overwrites the partitioned parameters (and buffers) with rank 0's plain build. Collective.

    One parameter is gathered at a time, so the copy never holds more than one full tensor on the
    device: the models this path exists for are the ones that do not fit there whole."""
    source = dict(plain.named_parameters()) if plain is not None else {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0), torch.no_grad():
            if plain is not None:
                p.copy_(source[name])
    source_buffers = dict(plain.named_buffers()) if plain is not None else {}
    for name, b in module.named_buffers():
        b.copy_(source_buffers.get(name, b))
        _broadcast_tensor(b)


@contextlib.contextmanager
def without_hf_init() -> Iterator[None]:
    """Hugging Face's parent-applied weight init (`PreTrainedModel.initialize_weights`, run by
    `post_init` once every child is built) switched off inside: under zero.Init the children's
    weights are already partitioned, empty on this rank, and an init that indexes them
    (`weight[padding_idx]` in BERT's and BART's embeddings) raises IndexError. The values it would
    write are rank 0's plain twin's anyway (`copy_from_rank0`); tying still runs. Only where
    transformers is already imported (the user's module imports it); entered before zero.Init
    patches torch's constructors, so the import below sees them unpatched."""
    model_class = None
    if "transformers" in sys.modules:
        from transformers.modeling_utils import PreTrainedModel as model_class
    if model_class is None or not hasattr(model_class, "initialize_weights"):
        yield
        return
    saved = model_class.initialize_weights
    model_class.initialize_weights = lambda self: None
    try:
        yield
    finally:
        model_class.initialize_weights = saved


def configure_partitioned(
    deepspeed,
    module: torch.nn.Module,
    config: dict,
    offload_params: str | None,
    host_bytes: int,
    log0,
) -> None:
    """Runs `module.configure_model()` under zero.Init (`partitioned_init`), with the weights a
    single-device run draws from the same seed, as DDP's: rank 0 also builds the model plainly and
    its values overwrite the partitions (common.configure_with_plain_twin), unless that fp32 copy,
    beside the `host_bytes` per parameter that offload keeps in host memory for the whole run, would
    not fit there (said on rank 0 through `log0`). Collective."""

    def sharded() -> None:
        # zero.Init patches torch's tensor constructors; a library imported for the first time
        # inside it (transformers' lazy modules import torch._dynamo) would introspect the patched
        # functions and fail ("Signature mismatch ... new_tensor"). Import dynamo with the
        # constructors unpatched.
        import torch._dynamo  # noqa: F401

        with without_hf_init(), partitioned_init(deepspeed, config, offload_params):
            cast(Any, module).configure_model()  # deep copies are partitioned too

    def fits() -> bool:  # rank 0's fp32 copy, beside what offload keeps in host memory
        return (4 + host_bytes) * whole_numel(module) < 0.8 * psutil.virtual_memory().available

    built, plain = configure_with_plain_twin(module, sharded, fits)
    if not built:
        log0(
            f"DeepSpeed stage 3: the model ({whole_numel(module)} parameters) would not fit in "
            "host memory twice; initialised sharded only (zero.Init), so parent-applied init may "
            "differ from DDP."
        )
        return
    copy_from_rank0(deepspeed, module, plain)


def _broadcast_tensor(tensor: torch.Tensor) -> None:
    """Rank 0's values into `tensor` on every rank. NCCL moves only device tensors, and a buffer
    built on the host stays there under ZeRO-3 (a CPU buffer broadcast over NCCL crashed the
    planner's ZeRO-3 fallback on one H200), so such a buffer travels through the current device."""
    if tensor.device.type == "cpu" and dist.get_backend() == "nccl":
        carrier = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        dist.broadcast(carrier, src=0)
        tensor.copy_(carrier)
    else:
        dist.broadcast(tensor, src=0)


def load_weights(deepspeed, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Loads a full state dict into a module; under ZeRO-3 rank 0 loads and DeepSpeed re-partitions.
    Collective."""
    params = list(module.parameters())
    missing, unexpected, is_z3 = [], [], any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0, enabled=is_z3), torch.no_grad():
        if not is_z3 or dist.get_rank() == 0:
            missing, unexpected = module.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k in dict(module.named_parameters())]:
        raise ConfigError(
            f"checkpoint does not match {type(module).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}."
        )


def check_leaf_modules(classes) -> None:
    """Raises ConfigError unless `classes` is None, or a list of nn.Module classes (DeepSpeed's
    `leaf_modules`)."""
    if classes is not None and (
        not isinstance(classes, (list, tuple))
        or not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes)
    ):
        raise ConfigError(
            f"DeepSpeed leaf_modules={classes!r} is not valid: use None (the repeated blocks), [] "
            "(no "
            "leaf modules) or a list of nn.Module classes, e.g. [Block]."
        )


def mark_leaf_modules(deepspeed, module: torch.nn.Module, classes: list[type] | None) -> int:
    """Marks the instances of `classes` in `module` as ZeRO-3 leaf modules (DeepSpeed's
    `set_z3_leaf_modules`): each gathers all its parameters at its own forward and backward, so
    DeepSpeed runs one fetch and one pair of hooks per block instead of per submodule. `classes`
    None means the repeated blocks (the classes of the children of every nn.ModuleList that hold
    parameters); [] marks nothing. Returns the largest marked instance's parameter count (0 if
    none). Raises ConfigError when a class named by the user has no instance in the model."""
    if classes is None:
        classes = list(
            dict.fromkeys(
                type(c) for c in repeated_blocks(module) if any(True for _ in c.parameters())
            )
        )
    if missing := [
        c.__name__ for c in classes if not any(isinstance(m, c) for m in module.modules())
    ]:
        raise ConfigError(
            f"DeepSpeed leaf_modules names {missing}, which {type(module).__name__} does not "
            "contain."
        )
    if classes:
        deepspeed.utils.set_z3_leaf_modules(module, list(classes))
    return max(
        (whole_numel(m) for m in module.modules() if isinstance(m, tuple(classes))), default=0
    )


DS_PREFETCH_BUCKET = 50_000_000  # DeepSpeed's default stage3_prefetch_bucket_size (elements)


def prefetch_bucket(leaf_numel: int) -> int:
    """stage3_prefetch_bucket_size for leaf blocks of up to `leaf_numel` parameters: the next two
    blocks.

    DeepSpeed prefetches upcoming parameters until the bucket is full. Its default (5e7) is about
    one block of a d=2048 GPT (12·d² = 5.03e7), so the next block's gather barely overlapped the
    current block's compute; two blocks ahead lets each gather hide behind a whole block (2×H200:
    45.0k against 40.8k tok/s per GPU, same peak memory; docs/benchmarks.md). Costs up to two
    blocks' gathered parameters of extra memory."""
    return max(DS_PREFETCH_BUCKET, 2 * leaf_numel)


def wants_deepcompile(flag, user_config: dict, stage: int, offloaded: bool, leaf_modules) -> bool:
    """Whether DeepSpeed's DeepCompile runs the step: `DeepSpeed(deepcompile=True)` or the user's
    config key `compile.deepcompile` (DeepSpeed's own switch, which DeepSpeed only acts on once
    `engine.compile()` is called; lightspeed calls it). DeepCompile turns ZeRO-3's per-module
    gathers, releases and gradient reductions into operations of one compiled graph, which removes
    the hooks' host time (docs/benchmarks.md: on 2 H200s 53.6k tok/s per GPU and 1.00 scaling from 1
    to 2 GPUs, where the hooks scale 0.86-0.90).

    Raises ConfigError for a value that is not a bool, a config key contradicting the flag, a stage
    other than 3, offload, or leaf modules (DeepSpeed gives each leaf a full backward hook, which
    DeepCompile keeps and dynamo cannot trace)."""
    if flag not in (True, False):
        raise ConfigError(f"DeepSpeed deepcompile={flag!r} is not valid: use True or False.")
    section = user_config.get("compile") or {}
    in_config = section.get("deepcompile") if isinstance(section, dict) else None
    if flag and in_config is not None and not in_config:
        raise ConfigError(
            f"DeepSpeed config compile.deepcompile={in_config!r} contradicts DeepSpeed(deepcompile="
            "True); set it in one place."
        )
    if not (flag or in_config):
        return False
    if stage != 3 or offloaded:
        raise ConfigError(
            f"DeepSpeed deepcompile=True needs stage=3 without offload (got stage={stage}"
            f"{', offload' if offloaded else ''}): lightspeed runs DeepCompile where it is "
            "measured."
        )
    if leaf_modules:
        raise ConfigError(
            f"DeepSpeed leaf_modules={leaf_modules!r} cannot be combined with deepcompile=True: "
            "DeepCompile gathers whole blocks by itself, and dynamo cannot trace a leaf module's "
            "hook. "
            "Leave leaf_modules unset."
        )
    return True


def deepcompile_hint(strategy) -> str | None:
    """A line for rank 0 when `strategy` (a connected DeepSpeed) runs ZeRO-3's hooks where
    DeepCompile could run the step instead: stage 3 on more than one CUDA GPU, no offload, automatic
    optimization, no Trainer compile, no leaf modules named. None otherwise."""
    s = strategy
    if (
        s.stage != 3
        or s.deepcompile
        or s.device.type != "cuda"
        or s.dist.world_size < 2
        or s.offload_optimizer
        or s.offload_params
        or s.leaf_modules
        or s.spec.compile
        or not s.spec.automatic_optimization
    ):
        return None
    return (
        f"DeepSpeed stage 3 on {s.dist.world_size} GPUs gathers parameters with per-module hooks, "
        "whose host "
        "time costs speed per GPU as GPUs are added (2 H200s: 0.86-0.90 of one GPU's tokens/s per "
        "GPU; "
        "docs/benchmarks.md). DeepSpeed(stage=3, deepcompile=True) compiles the gathers into the "
        "step (1.00-1.05 "
        "there) at the cost of minutes of compilation in the first steps."
    )


def check_deepcompile_run(spec) -> None:
    """Raises ConfigError, before any rank starts, for a run DeepCompile cannot serve: off CUDA
    (DeepSpeed's DeepCompile runs on CUDA only), with the Trainer's own `compile` (the step would be
    compiled twice over), or under manual optimization (the step would hold the backward and the
    optimizer step)."""
    if spec.compile:
        raise ConfigError(
            f"Trainer(compile={spec.compile!r}) is not valid with DeepSpeed(deepcompile=True), "
            "which "
            "compiles the whole step itself: leave the Trainer's compile unset."
        )
    if not spec.automatic_optimization:
        raise ConfigError(
            "DeepSpeed(deepcompile=True) needs automatic_optimization=True: the compiled step "
            "cannot "
            "hold the backward and the optimizer step of manual optimization."
        )
    if spec.device_type != "cuda":
        raise ConfigError(
            "DeepSpeed deepcompile=True needs CUDA GPUs (DeepSpeed's DeepCompile runs on CUDA "
            "only); "
            f"this run's accelerator is {spec.device_type!r}. Leave deepcompile unset there."
        )


DEEPCOMPILE_WARMUP = (
    5  # steps DeepCompile profiles before it compiles its prefetch schedule in (init_z3.WARMUP)
)


PREFETCH = (
    "lightspeed_prefetch"  # DeepSpeed's prefetch pass, kept off graphs that gather no parameter
)


def deepcompile_schedule(step: int) -> list[tuple[int, list[str]]]:
    """DeepSpeed's default ZeRO-3 DeepCompile pass schedule (init_z3), counted from `step` instead
    of 0: gathers and releases in the graph at once, prefetch and selective gathering from
    DEEPCOMPILE_WARMUP steps later. The prefetch is `prefetch_where_gathered`'s, registered by
    `start_deepcompile` under PREFETCH."""
    return [
        (step, ["zero3_compile"]),
        (step + DEEPCOMPILE_WARMUP, ["zero3_compile", PREFETCH, "selective_gather"]),
    ]


def prefetch_where_gathered(gm, *args):
    """DeepSpeed's `schedule_prefetch` on a graph that gathers parameters; None (graph unchanged) on
    one that gathers none. A `training_step` that graph-breaks (`self.log`, `.item()`) leaves small
    graphs with no inputs, and DeepSpeed 0.19's pass fails on those with a bare AssertionError
    (measured on an H200: `assert i < len(order_rev) - 1`); they have nothing to prefetch. Every
    rank traces the same graphs, so every rank skips the same ones (the pass all-reduces)."""
    if not any(str(node.target).startswith("dc.allgather_param") for node in gm.graph.nodes):
        return None
    from deepspeed.compile.passes.prefetch import schedule_prefetch

    return schedule_prefetch(gm, *args)


def start_deepcompile(engine, log0) -> None:
    """`engine.compile()` under DeepCompile with `deepcompile_schedule` from the engine's current
    step. DeepSpeed's own default counts from step 0 and launches a pass only when `global_steps`
    equals its step exactly, so an engine resumed at step 5 would never launch one and would run the
    graph with partitioned weights. Called at the first training forward, after any checkpoint load;
    says so with `log0`."""
    from deepspeed.compile.passes import prefetch

    # the compiled engine validates without grad (kernels.skip_alignment_asserts)
    skip_alignment_asserts()
    log0(
        f"DeepSpeed: DeepCompile compiles the step now and again {DEEPCOMPILE_WARMUP} steps on, "
        "with the prefetch "
        "schedule it measured (minutes on a cold cache; the steps after run compiled)."
    )
    engine.register_compile_pass(PREFETCH, prefetch_where_gathered, prefetch.CONTRACT)
    engine.compile(backend="inductor", schedule=deepcompile_schedule(engine.global_steps))


def release_engine(engine: Any) -> None:
    """Frees a DeepSpeed engine (None: nothing to do) so that its module can be collected:
    `destroy()` drops its hooks; ZeRO-3 also pushes the top module onto a module-level stack at
    setup and never pops it (deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK), which would
    keep every trial's copy alive. Reaches into DeepSpeed's internals (0.19) on purpose: a trial
    engine must leave no memory behind."""
    if engine is None:
        return
    engine.destroy()
    from deepspeed.runtime.zero import parameter_offload

    stack, mine = parameter_offload.FWD_MODULE_STACK, {id(m) for m in engine.module.modules()}
    stack[:] = [
        m for m in stack if id(m) not in mine
    ]  # also submodules a forward cut short by OOM left there
    # ZeRO-3's optimizer still outlives destroy() (something outside Python's view holds it, in
    # DeepSpeed 0.19):
    # its flat partitions, optimizer states and offload buffers are dropped here, so that only small
    # objects leak.
    optimizer = getattr(engine, "optimizer", None)
    for obj in (optimizer, getattr(optimizer, "optimizer", None), engine):
        if obj is not None:
            drop_tensor_attributes(obj)


def drop_tensor_attributes(obj: Any) -> None:
    """Drops the tensors a discarded object holds in its attributes, directly or in lists, tuples
    and dicts (one level deep), and an optimizer's state."""
    if isinstance(getattr(obj, "state", None), dict):
        obj.state.clear()
    for name, value in list(vars(obj).items()):
        if isinstance(value, torch.Tensor):
            setattr(obj, name, None)
        elif isinstance(value, (list, tuple)) and any(_has_tensor(v) for v in value):
            setattr(obj, name, type(value)() if isinstance(value, list) else ())
        elif isinstance(value, dict) and any(_has_tensor(v) for v in value.values()):
            setattr(obj, name, {})


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, torch.Tensor) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) for v in value.values())
    return False
