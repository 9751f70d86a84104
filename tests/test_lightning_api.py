"""Lightning's names, mapped onto lightspeed's own objects: strategies, utilities, exceptions.

OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_lightning_api.py
"""

from __future__ import annotations

import pytest
import torch

import lightspeed as ls
from lightspeed.strategies import DDP, DDPStrategy, DeepSpeedStrategy, FSDPStrategy, build_strategy
from lightspeed.utilities import MisconfigurationException, rank_zero_only, seed_everything
from test_trainer import Regress, make_trainer, regression_data


def test_deepspeed_strategy_keywords_map_onto_deepspeed():
    s = DeepSpeedStrategy(
        stage=3,
        offload_optimizer=True,
        offload_parameters=True,
        pin_memory=False,
        logging_batch_size_per_gpu=4,
        allgather_bucket_size=5e7,
        reduce_bucket_size=5e7,
        contiguous_gradients=False,
        sub_group_size=10**9,
    )
    assert type(s).__name__ == "DeepSpeed"
    assert (s.stage, s.offload_optimizer, s.offload_params, s.pin_memory) == (
        3,
        "cpu",
        "cpu",
        False,
    )
    assert (s.allgather_bucket_size, s.reduce_bucket_size) == (50_000_000, 50_000_000)
    zero = s.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["contiguous_gradients"] is False and zero["sub_group_size"] == 10**9
    assert s.name == "deepspeed_stage_3_offload"


def test_deepspeed_strategy_stage_from_config_and_defaults():
    s = DeepSpeedStrategy(
        config={"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 4}
    )
    assert s.stage == 1 and s.config["train_micro_batch_size_per_gpu"] == 4
    assert DeepSpeedStrategy().stage == 2 and DeepSpeedStrategy().offload_optimizer is None


def test_deepspeed_reduce_bucket_default_depends_on_the_stage():
    # Stage 3 keeps a 64M-element reduce bucket, 1 and 2 keep 200M (Lightning's); a size given
    # explicitly stands.
    assert [ls.DeepSpeed(stage=n).reduce_bucket_size for n in (1, 2, 3)] == [
        200_000_000,
        200_000_000,
        64_000_000,
    ]
    assert build_strategy("deepspeed_stage_3_offload", 2).reduce_bucket_size == 64_000_000
    assert DeepSpeedStrategy(stage=3).reduce_bucket_size == 64_000_000
    assert DeepSpeedStrategy(stage=2).reduce_bucket_size == 200_000_000
    assert ls.DeepSpeed(stage=3, reduce_bucket_size=10**8).reduce_bucket_size == 10**8


def test_deepspeed_strategy_config_from_env_and_offload_false(tmp_path, monkeypatch):
    # Lightning's PL_DEEPSPEED_CONFIG_PATH names the config file when config= is not given.
    path = tmp_path / "ds.json"
    path.write_text(
        '{"zero_optimization": {"stage": 1, "offload_optimizer": false}, "steps_per_print": 7}'
    )
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(path))
    s = DeepSpeedStrategy()
    assert s.stage == 1 and s.config["steps_per_print"] == 7 and s.offload_optimizer is None
    assert (
        DeepSpeedStrategy(config={"zero_optimization": {"stage": 3}}).stage == 3
    )  # config= wins over the variable
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH")
    # `"offload_optimizer": false` / null in a config means no offload (it used to fail on bool.get)
    off = DeepSpeedStrategy(
        config={
            "zero_optimization": {"stage": 2, "offload_optimizer": False, "offload_param": None}
        }
    )
    assert off.offload_optimizer is None and off.offload_params is None
    assert (
        "offload_optimizer" not in off.config["zero_optimization"]
    )  # DeepSpeed's schema refuses false


def test_fsdp_and_ddp_strategy_keywords():
    block = torch.nn.Linear
    f = FSDPStrategy(
        sharding_strategy="SHARD_GRAD_OP",
        cpu_offload=True,
        activation_checkpointing_policy={block},
        state_dict_type="full",
    )
    assert (f.name, f.cpu_offload, f.activation_checkpointing) == ("fsdp_grad_op", True, [block])
    assert FSDPStrategy(activation_checkpointing=[block]).activation_checkpointing == [block]
    d = DDPStrategy(find_unused_parameters=True, static_graph=True)
    assert isinstance(d, DDP) and d.find_unused_parameters and d.static_graph
    s = build_strategy("ddp_find_unused_parameters_true", 2)
    assert isinstance(s, DDP) and s.find_unused_parameters


@pytest.mark.parametrize(
    "build, pattern",
    [
        (
            lambda: DeepSpeedStrategy(stagee=3),
            r"DeepSpeedStrategy got unknown keywords \['stagee'\]",
        ),
        (
            lambda: FSDPStrategy(sharding_strategy="HYBRID_SHARD"),
            r"sharding_strategy='HYBRID_SHARD'\) is not valid",
        ),
        (
            lambda: FSDPStrategy(auto_wrap_policy=lambda m: True),
            r"auto_wrap_policy=.* callable policies",
        ),
        (
            lambda: DDPStrategy(find_unused=True),
            r"DDPStrategy got unknown keywords \['find_unused'\]",
        ),
    ],
)
def test_lightning_strategy_bad_keywords(build, pattern):
    with pytest.raises(ls.ConfigError, match=pattern):
        build()


def test_misconfiguration_exception_catches_config_errors(tmp_path):
    with pytest.raises(MisconfigurationException, match="max_steps=-5"):
        make_trainer(tmp_path, max_steps=-5)
    assert issubclass(MisconfigurationException, ValueError)


def test_rank_zero_only_and_seed_everything():
    calls = []

    @rank_zero_only
    def note(x):
        calls.append(x)
        return x

    assert rank_zero_only.rank == 0 and note(1) == 1
    rank_zero_only.rank = 1
    try:
        assert note(2) is None
    finally:
        rank_zero_only._rank = None
    assert calls == [1]
    seed_everything(3)
    a = torch.rand(2)
    seed_everything(3)
    assert torch.equal(a, torch.rand(2))


def test_fit_with_deepspeed_strategy_object(tmp_path):
    model = Regress()
    trainer = make_trainer(tmp_path, strategy=DeepSpeedStrategy(stage=2), max_steps=3)
    trainer.fit(model, regression_data())
    assert trainer.global_step == 3 and trainer.strategy.name == "deepspeed_stage_2"


def test_trainer_reads_its_arguments_back_as_lightning_does():
    """Lightning code reads the Trainer's arguments back (`self.trainer.max_steps` for a
    OneCycleLR's total_steps, `trainer.precision` in a callback); `max_epochs` resolves as
    Lightning's: 1000 with neither limit, -1 with max_steps only. Anything else is still an
    AttributeError."""
    t = ls.Trainer(
        accelerator="cpu",
        max_steps=7,
        precision="bf16-mixed",
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        log_every_n_steps=3,
        default_root_dir="runs",
        logger=False,
    )
    assert (t.max_steps, t.max_epochs, t.precision, t.accumulate_grad_batches) == (
        7,
        None,  # as Lightning: resolved (-1 here) when a fit starts
        "bf16-mixed",
        2,
    )
    assert (t.gradient_clip_val, t.log_every_n_steps, t.num_devices, t.num_nodes) == (0.5, 3, 1, 1)
    assert (
        t.default_root_dir == "runs"
        and ls.Trainer(accelerator="cpu", logger=False).max_epochs is None
    )
    assert ls.Trainer(accelerator="cpu", max_epochs=4, logger=False).max_epochs == 4
    with pytest.raises(AttributeError, match="'Trainer' object has no attribute 'max_stepz'"):
        t.max_stepz  # noqa: B018
