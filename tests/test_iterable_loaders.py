"""Loaders without an exact length (issue 39): an IterableDataset trains under every strategy, the
ranks' streams end their epochs together, a StatefulDataLoader resumes mid-epoch; evaluation over
streams of different lengths per rank ends together and drops no batch.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_iterable_loaders.py

The multi-rank runs (tests/iterable_script.py, 2 gloo ranks): rank 0 streams 20 batches per epoch,
rank 1 13, accumulation 2, two epochs, validation every 4 batches. Every rank must stop after
rank 1's 13th batch (7 steps per epoch, the 7th a window of one micro-batch on both ranks), with
the same per-step losses under every strategy (relative 1e-5: DeepSpeed reduces in another order;
observed ≤ 1.5e-6). The evaluation runs (`eval`: fit, validate, test and predict in one job per
strategy) are described in tests/iterable_script.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import lightspeed as L
from helpers import ROOT, assert_close_losses, launch

SCRIPT = str(ROOT / "tests" / "iterable_script.py")
RUN = dict(lengths=[20, 13], max_epochs=2, accumulate=2, val_check_interval=4)
STEPS = 14  # 7 per epoch: 6 windows of 2, then rank 1's 13th batch alone
RTOL = 1e-5


def run_jobs(tmp_path, jobs: dict[str, dict]) -> dict[str, tuple[list[dict], str]]:
    """Runs the script's `jobs` (name -> options) one after another in one launched job of 2 ranks
    (they start once), each writing to tmp_path/name/out; returns name -> (each rank's record, its
    part of the output)."""
    given = []
    for name, opts in jobs.items():
        (tmp_path / name / "out").mkdir(parents=True, exist_ok=True)
        given.append({"out": str(tmp_path / name / "out"), **opts})
    run = launch([SCRIPT, json.dumps({"jobs": given})], tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    parts = re.split(r"\[iterable_script job (\d+)\]\n", run.stdout)
    said = ["" for _ in given]  # parts: text, number, text, number, text, ...
    for number, text in zip(parts[1::2], parts[2::2]):
        said[int(number)] += text
    return {
        name: ([json.loads((Path(job["out"]) / f"rank{r}.json").read_text()) for r in (0, 1)], out)
        for name, job, out in zip(jobs, given, said)
    }


def run_script(tmp_path, **opts) -> tuple[list[dict], str]:
    """Runs the script on 2 ranks; returns each rank's record and rank 0's stdout."""
    return run_jobs(tmp_path, {"run": opts})["run"]


UNSIZED = ["deepspeed_stage_3", "fsdp"]  # the default cells of the two matrices below
UNEVEN = ["ddp", "deepspeed_stage_3", "fsdp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    """Every default test's run, one after another in one launched job. "ddp": DDP over an
    IterableDataset whose `__len__` claims 20 batches on each rank, through a StatefulDataLoader,
    saving every 2 steps; "resumed": from its step-4 checkpoint."""
    tmp = tmp_path_factory.mktemp("iterable")
    ckpt = tmp / "ddp" / "out" / "ckpt" / "epoch=0-step=4.ckpt"
    stateful = dict(strategy="ddp", claimed=20, stateful=True, **RUN)
    return run_jobs(
        tmp,
        {
            "ddp": dict(ckpt_every=2, **stateful),
            "resumed": dict(resume=str(ckpt), **stateful),
            **{f"unsized-{s}": dict(strategy=s, **RUN) for s in UNSIZED},
            **{f"uneven-{s}": dict(strategy=s, eval=True) for s in UNEVEN},
        },
    )


def check_epochs(ranks: list[dict]) -> None:
    """Both ranks ran 7 steps per epoch on their own stream's first 13 batches, validated at 4, 8,
    12 and the epoch's end (3 batches each time), and knew the last window while it ran."""
    for r, rec in enumerate(ranks):
        assert rec["global_step"] == STEPS and rec["epoch"] == 2, rec
        ids = [1000 * r + b for b in range(13)]
        assert [s[2] for s in rec["steps"]] == ids + ids
        assert [s[0] for s in rec["steps"]][:13] == [i // 2 for i in range(13)]
        last = [s[2] for s in rec["steps"] if s[4]]
        assert last == [1000 * r + 12] * 2, last
        assert rec["val_batches"] == 2 * 4 * 3
        assert rec["sampler"] != "DistributedSampler"  # each rank's stream is its own


@pytest.fixture(scope="module")
def ddp(runs):
    """(each rank's record, its output) of the run `runs` names "ddp"."""
    return runs["ddp"]


def test_a_short_rank_ends_the_epoch_for_all_under_ddp(ddp):
    ranks, stdout = ddp
    check_epochs(ranks)
    notes = re.findall(r"train_dataloaders: .*", stdout)
    assert notes == [
        "train_dataloaders: rank 1 ran out after 13 batches (its len() says 20); every rank ended "
        "epoch 0 there, together: rank(s) 0 had more, left untrained this epoch."
    ], stdout[-2000:]
    # the schedule length from the claimed len: 10 steps per epoch
    assert [rec["estimated"] for rec in ranks] == ["20", "20"]


@pytest.mark.skipif(
    not __import__("importlib").util.find_spec("torchdata"), reason="torchdata not installed"
)
def test_a_stateful_loader_resumes_mid_epoch(ddp, runs):
    """From the step-4 checkpoint (8 batches into epoch 0): each rank's StatefulDataLoader is
    restored at its own position (its dataset's load_state_dict sees 8 batches of 4 samples, no
    batch replayed) and the rest of the run is the uninterrupted one, loss for loss."""
    full, _ = ddp
    ranks, _ = runs["resumed"]
    for rec, whole in zip(ranks, full):
        assert rec["restored"] == [8 * 4]
        assert rec["global_step"] == STEPS
        assert rec["steps"] == [s for s in whole["steps"] if s[0] >= 4]


@pytest.mark.parametrize(
    "strategy",  # ZeRO-2 repeats ZeRO-3's engine path and ddp's agreement: slow
    [pytest.param("deepspeed_stage_2", marks=pytest.mark.slow), "deepspeed_stage_3", "fsdp"],
)
def test_an_unsized_stream_trains_alike_under(strategy, ddp, runs, tmp_path):
    reference, _ = ddp
    if strategy in UNSIZED:
        ranks, stdout = runs[f"unsized-{strategy}"]
    else:
        ranks, stdout = run_script(tmp_path, strategy=strategy, **RUN)
    check_epochs(ranks)
    assert "rank 1 ran out after 13 batches (it has no len())" in stdout
    for rec, ref in zip(ranks, reference):
        assert rec["estimated"] == "inf"
        losses, ref_losses = [s[3] for s in rec["steps"]], [s[3] for s in ref["steps"]]
        assert_close_losses(losses, ref_losses, RTOL, f"{strategy} vs ddp")


# ---------------------------------------------------------------- evaluation, uneven per rank
def batch_mean(at: int) -> float:
    """The mean feature of the script's batch `at` (Stream: 4 rows drawn from a seed of `at`)."""
    g = torch.Generator().manual_seed(at)
    return float(torch.stack([torch.randn(8, generator=g) + i for i in range(4)]).mean())


def mean_of(ats) -> float:
    return sum(map(batch_mean, ats)) / len(ats)


@pytest.mark.parametrize(
    "strategy",
    ["ddp", "deepspeed_stage_3", "fsdp", pytest.param("deepspeed_stage_2", marks=pytest.mark.slow)],
)
def test_uneven_evaluation_streams_end_together_and_drop_nothing_under(strategy, runs, tmp_path):
    """One job (tests/iterable_script.py `evaluate`): fit's sanity check and validation over two
    loaders, then validate, test and predict, each stream a different length per rank (one empty
    on a rank, one behind a `__len__` that claims 20). Every rank ends each stage together; the
    batch hooks see every rank's own batches and nothing else; the epoch values logged with
    sync_dist are the mean over every rank's real batches (relative 1e-6, float32 sums); predict
    returns each rank's own outputs only. Where the forward is collective (ZeRO-3, FSDP) a rank out
    of batches steps with the others on its last batch (a shadow step: counted in `calls`, not
    seen by the hooks); under DDP and ZeRO-2 it waits, except for its first turn when its stream
    was empty."""
    if strategy in UNEVEN:
        ranks, stdout = runs[f"uneven-{strategy}"]
    else:
        ranks, stdout = run_script(tmp_path, strategy=strategy, eval=True)
    val = {
        "val_x/dataloader_idx_0": mean_of([0, 1, 2, 3, 1000, 1001]),  # limit_val_batches=4
        "val_x/dataloader_idx_1": mean_of([1100, 1101, 1102]),
    }
    test = mean_of([200, 201, *range(1200, 1211)])  # rank 1: two windows of agreement
    for r, rec in enumerate(ranks):
        assert rec["fit"] == pytest.approx(val, rel=1e-6)
        assert rec["validate"] == [pytest.approx({k: v}, rel=1e-6) for k, v in val.items()]
        assert rec["test"] == [pytest.approx({"test_x": test}, rel=1e-6)]
        seen = {
            0: {"sanity/0": [0, 1], "val/0": [0, 1, 2, 3] * 2, "test/0": [200, 201]},
            1: {
                "sanity/0": [1000, 1001],
                "sanity/1": [1100, 1101],
                "val/0": [1000, 1001] * 2,
                "val/1": [1100, 1101, 1102] * 2,
                "test/0": list(range(1200, 1211)),
            },
        }[r]
        predicted = [[300, 301, 302], [1300]][r]
        assert rec["seen"] == {**seen, "predict/0": predicted}
        assert rec["predict"] == predicted
        collective = strategy in ("deepspeed_stage_3", "fsdp")
        turns = {"sanity": 4, "val": 14, "test": 11, "predict": 3}
        own = [
            {"sanity": 3, "val": 10, "test": 2, "predict": 3},
            {**turns, "val": 10, "predict": 1},
        ][r]
        assert rec["calls"] == (turns if collective else own), rec["calls"]
    notes = re.findall(r".*_dataloaders.*", stdout)
    assert notes[0] == (
        "val_dataloaders (sanity check)[1]: rank 0 ran out after 0 batches (it has no len()), 2 "
        "short of the longest; every rank ended after 2 batches, together (no batch left out)."
    )
    assert (
        notes[1]
        == notes[2]
        == (  # fit's validation, then validate
            "val_dataloaders[0]: rank 1 ran out after 2 batches (its len() says 20), 2 short of the "
            "longest; every rank ended after 4 batches, together; val_dataloaders[1]: rank 0 ran out "
            "after 0 batches (it has no len()), 3 short of the longest; every rank ended after 3 "
            "batches, together (no batch left out)."
        )
    )
    assert notes[3].startswith("test_dataloaders: rank 0 ran out after 2 batches")
    assert notes[4].startswith("predict_dataloaders: rank 1 ran out after 1 batches")
    assert len(notes) == 5, notes


# ---------------------------------------------------------------- one process
class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(20):
            yield torch.randn(8, generator=g)


class Tiny(L.LightningModule):
    def __init__(self, one_cycle: bool = False):
        super().__init__()
        self.layer, self.one_cycle = torch.nn.Linear(8, 1), one_cycle
        self.val_batches = 0

    def training_step(self, batch, batch_idx):
        return self.layer(batch).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.one_cycle:
            return opt
        steps = self.trainer.estimated_stepping_batches
        return [opt], [torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=steps)]


def fit(tmp_path, model=None, **flags):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
        **flags,
    )
    model = model or Tiny()
    trainer.fit(model, DataLoader(Stream(), batch_size=4), DataLoader(Stream(), batch_size=4))
    return trainer, model


def test_one_process_epochs_steps_limits_and_bars(tmp_path, capsys):
    trainer, model = fit(tmp_path, max_epochs=2, val_check_interval=2)
    assert trainer.global_step == 10 and trainer.current_epoch == 2
    assert trainer.num_training_batches == math.inf
    assert trainer.estimated_stepping_batches == math.inf
    assert model.val_batches == 2 * 3 * 5  # at batches 2, 4 and the end of each epoch
    assert re.search(r"epoch 1 step 10 [\d.]+ it/s", capsys.readouterr().out)  # no total
    trainer, _ = fit(tmp_path, max_steps=7, callbacks=[L.TQDMProgressBar()])
    assert (trainer.global_step, trainer.current_epoch) == (7, 1)
    assert trainer.estimated_stepping_batches == 7
    assert "| 2/? [" in "".join(capsys.readouterr())  # tqdm counts epoch 1 without a total
    trainer, _ = fit(tmp_path, max_epochs=2, limit_train_batches=3)
    assert trainer.global_step == 6 and trainer.estimated_stepping_batches == 6


@pytest.mark.parametrize(
    "flags, says",
    [
        (dict(val_check_interval=0.5), "val_check_interval=0.5 is a fraction of an epoch"),
        (dict(limit_train_batches=0.5), "limit_train_batches=0.5 is a fraction of an epoch"),
    ],
)
def test_fractions_of_an_unsized_epoch_are_refused(tmp_path, flags, says):
    with pytest.raises(L.ConfigError, match=re.escape(says)):
        fit(tmp_path, max_epochs=1, **flags)


def test_a_schedule_sized_by_an_unknowable_length_names_it(tmp_path):
    with pytest.raises(L.ConfigError, match="estimated_stepping_batches is inf") as err:
        fit(tmp_path, Tiny(one_cycle=True), max_epochs=2)
    assert "Set Trainer(max_steps=N)" in str(err.value)
    trainer, _ = fit(tmp_path, Tiny(one_cycle=True), max_steps=6)
    assert trainer.global_step == 6


@pytest.mark.timeout(120)
def test_a_spent_stream_ends_its_epochs_instead_of_looping(tmp_path):
    """A generator given to fit is spent after the first epoch: the later epochs end with no
    batch (an epoch without batches must still count as done, or fit would loop forever)."""
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=3, logger=False, enable_checkpointing=False
    )
    trainer.fit(Tiny(), (torch.randn(4, 8) for _ in range(5)))
    assert (trainer.global_step, trainer.current_epoch) == (5, 3)
