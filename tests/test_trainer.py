"""The core loop, proven by loss: 1-device vs 2-rank DDP parity, exact resume, and the Module API.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_trainer.py

Multi-rank runs go through tests/helpers.py (real gloo ranks on 127.0.0.1); single-device API checks
run the Trainer in this process on a tiny regression model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls
from helpers import ROOT, assert_close_losses, launch, run_jobs, run_workload

# ---------------------------------------------------------------- parity: 1 device vs 2-rank DDP

PARITY = dict(max_steps=6, accumulate=2, clip=0.05, shuffle=True, warmup=3)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, dict]:
    """The 2-rank runs of this file (DDP's parity run and its resume runs below), one after another
    in one launched job (helpers.run_jobs: the ranks start once)."""
    root = tmp_path_factory.mktemp("two_ranks")
    jobs = {"parity": dict(devices=2, batch_size=4, **PARITY)}
    jobs |= _resume_jobs(root / "resume", devices=2, batch_size=4)
    return run_jobs(root, jobs)


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory, two_ranks):
    single = run_workload(
        tmp_path_factory.mktemp("single"), launcher="in-process", devices=1, batch_size=8, **PARITY
    )
    return single, two_ranks["parity"]


def test_parity_single_vs_ddp(parity_runs):
    single, ddp = parity_runs
    assert (single["world_size"], ddp["world_size"]) == (1, 2)
    assert ddp["strategy"] == "ddp" and single["strategy"] == "single"
    assert single["global_step"] == ddp["global_step"] == 6
    assert len(single["losses"]) == 12  # 6 optimizer steps × 2 micro-batches
    assert_close_losses(ddp["losses"], single["losses"], rtol=1e-5, what="DDP vs single device")
    assert single["losses"][-1] < single["losses"][0]


# ---------------------------------------------------------------- resume: bit-exact per-step losses

RESUME = dict(
    max_epochs=2, limit_train_batches=8, accumulate=2, clip=1.0, shuffle=True, dropout=0.1, warmup=4
)


def _resume_jobs(root: Path, devices: int, batch_size: int) -> dict[str, dict]:
    """The runs of the resume tests, in order, each with its folder ("root")."""
    kw = dict(devices=devices, batch_size=batch_size, **RESUME)
    dirs = {k: root / k for k in ("straight", "split", "mid")}
    for d in dirs.values():
        d.mkdir(parents=True)
    return {
        # Straight: 2 epochs of 4 steps; a checkpoint every 3 steps (step 3 is mid-epoch 0).
        "straight": dict(root=str(dirs["straight"]), ckpt_every=3, **kw),
        "first": dict(root=str(dirs["split"]), checkpointing=True, **{**kw, "max_epochs": 1}),
        "second": dict(root=str(dirs["split"]), resume="last", **kw),
        "mid": dict(
            root=str(dirs["mid"]),
            resume=str(dirs["straight"] / "checkpoints" / "epoch=0-step=3.ckpt"),
            **kw,
        ),
    }


@pytest.fixture(scope="module", params=[1, 2], ids=["single", "ddp"])
def resume_runs(request, tmp_path_factory):
    if request.param == 2:
        return request.getfixturevalue("two_ranks")
    jobs = _resume_jobs(tmp_path_factory.mktemp("resume1"), devices=1, batch_size=8)
    return {
        name: run_workload(Path(opts.pop("root")), launcher="in-process", **opts)
        for name, opts in jobs.items()
    }


def test_resume_after_epoch_is_bit_exact(resume_runs):
    r = resume_runs
    assert r["straight"]["global_step"] == 8 and len(r["straight"]["losses"]) == 16
    assert r["first"]["global_step"] == 4 and r["second"]["global_step"] == 8
    assert r["first"]["losses"] + r["second"]["losses"] == r["straight"]["losses"]


def test_resume_mid_epoch_is_bit_exact(resume_runs):
    r = resume_runs
    assert len(r["mid"]["losses"]) == 10  # steps 4..8 = 10 micro-batches
    assert r["straight"]["losses"][:6] + r["mid"]["losses"] == r["straight"]["losses"]


# ---------------------------------------------------------------- the Module API on one device (in
# process)


class Regress(ls.Module):
    """y = x·w, with hook calls recorded in `calls`."""

    def __init__(self, opt_form: str = "optimizer"):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.opt_form = opt_form
        self.calls: list[str] = []

    def training_step(self, batch, batch_idx):
        self.calls.append("training_step")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.calls.append("validation_step")
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def test_step(self, batch, batch_idx, dataloader_idx=0):  # several test loaders: Lightning's
        x, y = batch
        self.log_dict(
            {"test_loss": torch.nn.functional.mse_loss(self.layer(x), y), "test_const": 7.0}
        )

    def predict_step(self, batch, batch_idx):
        return batch[0][:, 0].clone()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        match self.opt_form:
            case "optimizer":
                return opt
            case "list":
                return [opt]
            case "tuple":
                return [opt], [sched]
            case "dict":
                return {"optimizer": opt, "lr_scheduler": sched}
            case "dict_step":
                return {
                    "optimizer": opt,
                    "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 2},
                }
            case "plateau":
                plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
                return {
                    "optimizer": opt,
                    "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"},
                }
            case "bogus":
                return "adam"

    def on_fit_start(self):
        self.calls.append("on_fit_start")

    def on_fit_end(self):
        self.calls.append("on_fit_end")

    def on_train_epoch_start(self):
        self.calls.append("on_train_epoch_start")

    def on_train_epoch_end(self):
        self.calls.append("on_train_epoch_end")

    def on_validation_epoch_start(self):
        self.calls.append("on_validation_epoch_start")

    def on_validation_epoch_end(self):
        self.calls.append("on_validation_epoch_end")

    def on_test_epoch_start(self):
        self.calls.append("on_test_epoch_start")

    def on_test_epoch_end(self):
        self.calls.append("on_test_epoch_end")


def regression_data(n: int = 32, batch_size: int = 4, shuffle: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


def make_trainer(tmp_path, **kw) -> ls.Trainer:
    base = dict(
        accelerator="cpu",
        devices=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        seed=0,
    )
    return ls.Trainer(**{**base, **kw})


def test_hook_order_and_loop_counts(tmp_path):
    model = Regress()
    trainer = make_trainer(tmp_path, max_epochs=2, limit_train_batches=3, limit_val_batches=2)
    trainer.fit(model, regression_data(), regression_data())
    epoch = [
        "on_train_epoch_start",
        *["training_step"] * 3,
        "on_validation_epoch_start",
        *["validation_step"] * 2,
        "on_validation_epoch_end",
        "on_train_epoch_end",
    ]
    # The sanity check (num_sanity_val_steps=2, as in Lightning): two validation steps inside
    # validation's hooks.
    assert model.calls == [
        "on_fit_start",
        "on_validation_epoch_start",
        "validation_step",
        "validation_step",
        "on_validation_epoch_end",
        *epoch,
        *epoch,
        "on_fit_end",
    ]
    assert (trainer.global_step, trainer.current_epoch) == (6, 2)
    assert "val_loss" in trainer.callback_metrics and "train_loss_epoch" in trainer.callback_metrics


@pytest.mark.parametrize("form", ["optimizer", "list", "tuple", "dict", "dict_step", "plateau"])
def test_configure_optimizers_forms(tmp_path, form):
    model = Regress(form)
    trainer = make_trainer(tmp_path, max_epochs=2, limit_train_batches=4, limit_val_batches=1)
    trainer.fit(model, regression_data(), regression_data() if form == "plateau" else None)
    opt = trainer.strategy.optimizers[0]
    assert len(trainer.strategy.optimizers) == 1 and isinstance(opt, torch.optim.SGD)
    lr = opt.param_groups[0]["lr"]
    expected = {
        "optimizer": 0.1,
        "list": 0.1,
        "tuple": 0.025,
        "dict": 0.025,
        "dict_step": 0.1 * 0.5**4,
    }
    if (
        form == "plateau"
    ):  # stepped on val_loss each epoch; patience 0 halves it whenever val_loss stalls
        sched = trainer.strategy.schedulers[0]
        assert sched.monitor == "val_loss" and sched.scheduler.last_epoch == 2
    else:
        assert lr == pytest.approx(expected[form])


def test_configure_optimizers_bad_form(tmp_path):
    with pytest.raises(ls.ConfigError, match="configure_optimizers returned str 'adam'.*optimizer"):
        make_trainer(tmp_path, max_steps=1).fit(Regress("bogus"), regression_data())


def test_save_checkpoint_before_fit_is_a_config_error(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(
        ls.ConfigError, match=r"save_checkpoint\('.*early'\) was called before fit, validate"
    ):
        trainer.save_checkpoint(tmp_path / "early")
    assert not (tmp_path / "early").exists()
    trainer.fit(Regress(), regression_data())
    # the same trainer saves once set up: one file, Lightning's, on one device
    assert trainer.save_checkpoint(tmp_path / "after").is_file()


class ManualRegress(Regress):
    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        sched.step()
        self.log("loss", loss)
        self.losses.append(float(loss.detach()))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


def test_manual_optimization_single_device(tmp_path):
    model = ManualRegress()
    model.losses = []
    trainer = make_trainer(tmp_path, max_epochs=1, limit_train_batches=5)
    trainer.fit(model, regression_data())
    assert trainer.global_step == 5 and len(model.losses) == 5
    assert model.losses[-1] < model.losses[0]
    # The user stepped the scheduler once per batch; the trainer must not step it again at the
    # epoch's end.
    assert trainer.strategy.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.9**5)


def test_validate_test_predict_return_values(tmp_path):
    model = Regress()
    trainer = make_trainer(tmp_path, limit_val_batches=2)
    val = trainer.validate(model, regression_data())
    assert list(val[0]) == ["val_loss"] and val[0]["val_loss"] > 0
    test = trainer.test(model, regression_data())
    assert set(test[0]) == {"test_loss", "test_const"} and test[0]["test_const"] == 7.0
    assert model.calls[-2:] == ["on_test_epoch_start", "on_test_epoch_end"]
    preds = trainer.predict(model, regression_data(n=12, batch_size=5))
    assert [p.shape[0] for p in preds] == [5, 5, 2]
    assert torch.equal(torch.cat(preds), regression_data(n=12).dataset.tensors[0][:, 0])


def test_val_check_interval_and_limits(tmp_path):
    def val_runs(**kw) -> int:
        model = Regress()
        make_trainer(tmp_path, **{"limit_val_batches": 1, "num_sanity_val_steps": 0, **kw}).fit(
            model, regression_data(), regression_data()
        )
        return model.calls.count("on_validation_epoch_start")

    assert (
        val_runs(max_epochs=1, val_check_interval=0.25) == 4
    )  # 8 batches: after 2, 4, 6 and at the end
    # after batches 3 and 6; as in Lightning, the end of the epoch (8) is not on the interval
    assert val_runs(max_epochs=1, val_check_interval=3) == 2
    assert val_runs(max_epochs=1, val_check_interval=0.4) == 2  # int(8 * 0.4): after 3 and 6
    assert val_runs(max_epochs=4, limit_train_batches=2, check_val_every_n_epoch=2) == 2
    assert val_runs(max_epochs=2, limit_train_batches=0.5, limit_val_batches=0) == 0
    model = Regress()
    trainer = make_trainer(tmp_path, max_epochs=5, max_steps=7, limit_train_batches=0.5)
    trainer.fit(model, regression_data())
    assert (
        trainer.global_step == 7
        and model.calls.count("training_step") == 7
        and trainer.current_epoch == 1
    )


class Dropout(Regress):
    def __init__(self):
        super().__init__()
        self.drop, self.losses = torch.nn.Dropout(0.5), []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(self.drop(x)), y)
        self.losses.append(float(loss.detach()))
        return loss


def test_validation_does_not_move_training_rng(tmp_path):
    def losses(**kw) -> list[float]:
        torch.manual_seed(0)
        model = Dropout()
        make_trainer(tmp_path, max_epochs=2, limit_val_batches=2, **kw).fit(
            model, regression_data(shuffle=True), regression_data(shuffle=True)
        )
        return model.losses

    assert losses(val_check_interval=0.25) == losses(check_val_every_n_epoch=None) == losses()


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    meta: dict


class NestedBatch(Regress):
    def training_step(self, batch, batch_idx):
        pair, (a, [b]) = batch["pair"], batch["rest"]
        for t in (pair.x, pair.meta["y"], a, b):
            assert t.device == self.device
        self.seen.append((type(batch).__name__, type(pair).__name__, type(batch["rest"]).__name__))
        return torch.nn.functional.mse_loss(self.layer(pair.x), pair.meta["y"])


def test_nested_batches_and_module_properties(tmp_path, capsys):
    model = NestedBatch()
    model.seen = []
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    batches = [{"pair": Pair(x, {"y": y}), "rest": (x, [y])}] * 2
    trainer = make_trainer(tmp_path, max_epochs=1)
    trainer.fit(model, batches)
    assert model.seen == [("dict", "Pair", "tuple")] * 2
    assert (
        model.global_rank == 0 and model.device == torch.device("cpu") and model.trainer is trainer
    )
    model.print("hello from rank", model.global_rank)
    assert "hello from rank 0" in capsys.readouterr().out


def test_nothing_spawned_by_single_device_fit(tmp_path):
    make_trainer(tmp_path, max_steps=2).fit(Regress(), regression_data())
    assert psutil.Process().children() == []


# ---------------------------------------------------------------- the Module API on 2 DDP ranks

DDP_SCRIPT = ROOT / "tests" / "ddp_api_script.py"


@pytest.fixture(scope="module")
def ddp_api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp_api")
    run = launch([str(DDP_SCRIPT), str(tmp)], tmp, "python")
    assert run.returncode == 0, run.stderr[-5000:]
    import json

    return (
        json.loads((tmp / "rank0.json").read_text()),
        json.loads((tmp / "rank1.json").read_text()),
        run,
    )


def test_ddp_sync_dist_and_ranks(ddp_api):
    r0, r1, _ = ddp_api
    assert (r0["global_rank"], r1["global_rank"]) == (0, 1)
    # Each rank logs rank + 1: sync_dist=True gives the mean, 1.5, on both; without it each keeps
    # its own.
    assert r0["synced"] == r1["synced"] == 1.5
    assert (r0["unsynced"], r1["unsynced"]) == (1.0, 2.0)
    # reduce_fx="sum": summed over ranks (1 + 2) and over the epoch's 5 steps.
    assert r0["synced_sum"] == r1["synced_sum"] == 15.0


def test_ddp_sampler_keeps_shuffle_false_and_predict_order(ddp_api):
    r0, r1, _ = ddp_api
    # 10 samples over 2 ranks without shuffling: rank r sees r, r+2, ...; predictions come back in
    # that order.
    assert r0["train_order"] == [0, 2, 4, 6, 8] and r1["train_order"] == [1, 3, 5, 7, 9]
    assert r0["predictions"] == [0, 2, 4, 6, 8] and r1["predictions"] == [1, 3, 5, 7, 9]


def test_ddp_shuffle_reshuffles_each_epoch(ddp_api):
    r0, r1, _ = ddp_api
    epochs = [(r0["shuffled_order"][i : i + 5], r1["shuffled_order"][i : i + 5]) for i in (0, 5)]
    for a, b in epochs:
        assert sorted(a + b) == list(range(10))  # each epoch: the ranks split the data, no overlap
    assert epochs[0] != epochs[1] and epochs[0][0] != [0, 2, 4, 6, 8]


def test_ddp_manual_optimization_keeps_ranks_in_sync(ddp_api):
    r0, r1, _ = ddp_api
    assert (
        r0["manual_weights"] == r1["manual_weights"]
    )  # DDP averaged the manual_backward gradients
    assert r0["manual_losses"][-1] < r0["manual_losses"][0]
    assert r0["manual_lr"] == pytest.approx(0.1 * 0.9**5)


def test_ddp_print_on_rank_zero_only(ddp_api):
    _, _, run = ddp_api
    assert run.stdout.count("printed by rank") == 1 and "printed by rank 0" in run.stdout
