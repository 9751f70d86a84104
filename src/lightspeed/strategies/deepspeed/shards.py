"""A lightspeed DeepSpeed checkpoint's files: the engine's save, with what lightspeed writes beside
its ZeRO shards (`save_engine`), and those shards merged back into one fp32 state dict
(`full_state_dict`), which is also how an engine without an optimizer loads weights
(`load_weights_only`: ZeRO keeps the fp32 weights with the optimizer state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from lightspeed.checkpoint.io import DEEPSPEED_DIR as TAG  # the sub-directory of DeepSpeed's files
from lightspeed.checkpoint.layouts import CHECKPOINT_PREFIX, Portable, engine_tags, read_portable
from lightspeed.errors import ConfigError
from lightspeed.strategies.deepspeed.autotp import local_portable
from lightspeed.strategies.deepspeed.quiet import import_deepspeed
from lightspeed.strategies.deepspeed.zero3 import load_weights


def save_engine(engine: Any, path: Path, strategy_name: str, tp: int) -> None:
    """Saves `engine` (or an EngineGroup) under `path`/TAG, naming the strategy in its client state.

    The universal-checkpoint marker lets DeepSpeed's ds_to_universal convert the checkpoint for
    another world size (without it the conversion asserts); save_latest lets zero_to_fp32.py run
    without a tag."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    client: dict[str, Any] = {"lightspeed_strategy": strategy_name}
    if tp == 1:  # AutoTP's engine records its own (how each split layer was cut)
        client[UNIVERSAL_CHECKPOINT_INFO] = {"universal_checkpoint_version": 0.2}
    engine.save_checkpoint(str(path), tag=TAG, client_state=client, save_latest=True)


def load_weights_only(
    module: torch.nn.Module, path: Path, plan: dict[str, str], tp: int, tp_rank: int
) -> None:
    """Loads the checkpoint's merged fp32 weights into `module` (partitioned or not), for an engine
    without an optimizer (DeepSpeed's own weights-only load needs one). Under tp > 1 each split
    tensor is cut to this TP rank's share, as AutoTP's `plan` cut it. Collective."""
    state = full_state_dict(Path(path))
    if tp > 1:
        whole: Portable = {"model": state, "optim": {"state": {}, "param_groups": []}}
        state = local_portable(whole, plan, tp, tp_rank)["model"]
    load_weights(import_deepspeed(), module, state)


def merge_engines(path: Path, tag: str) -> dict[str, torch.Tensor]:
    """`full_state_dict`'s merge: every engine's ZeRO shards under `path` (tags `tag`, `tag_1`,
    ...) merged by DeepSpeed's zero_to_fp32 into one fp32 state dict keyed as the user's Module's
    state_dict. Raises ConfigError if `path` has no DeepSpeed shards."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if not (path / tag).is_dir():
        raise ConfigError(
            f"{path} holds no DeepSpeed checkpoint (expected the directory {path / tag})."
        )
    state = {}
    for name in engine_tags(path, tag):
        # (DeepSpeed's untyped return: a dict of tensors when not lazy)
        merged = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=name)
        state.update(cast("dict[str, torch.Tensor]", merged))
    return {k.removeprefix("module.").replace(CHECKPOINT_PREFIX, ""): v for k, v in state.items()}


def full_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Merges a lightspeed DeepSpeed checkpoint's ZeRO shards (every engine's) into one fp32 state
    dict on CPU.

    Keys are the user's Module's own `state_dict()` keys (the engine's `module.` and activation
    checkpointing's prefixes removed); tied weights appear under each name. Uses DeepSpeed's
    zero_to_fp32; for an AutoTP checkpoint (one model file per TP rank) DeepSpeed's ds_to_universal,
    which joins the TP cuts too (checkpoint/layouts.py). Raises ConfigError if `path` has no
    DeepSpeed shards."""
    import_deepspeed()
    if any((Path(path) / TAG).glob("mp_rank_01_model_states.pt")):
        return read_portable(Path(path), "deepspeed_stage_2", with_optimizer=False)["model"]
    return merge_engines(Path(path), TAG)
