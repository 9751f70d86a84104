"""Lightning's surface where ranks matter, on 2 gloo ranks: prepare_data once per node,
rank_zero_only, the model summary of sharded parameters, several validation loaders,
load_from_checkpoint from each strategy's checkpoint (DDP, DeepSpeed ZeRO-3 shards, FSDP DCP shards)
without a conversion step.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_lightning_ranks.py
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import ROOT, launch
from lightning_api_script import Net, predict_inputs

SCRIPT = ROOT / "tests" / "lightning_api_script.py"


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_stage_3", "fsdp"])
def test_lightning_surface_on_two_ranks(tmp_path, strategy):
    run = launch([str(SCRIPT), str(tmp_path), strategy], tmp_path, "python")
    assert run.returncode == 0, run.stderr[-5000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # prepare_data: local rank 0 only, once per entry point (fit, predict)
    assert (tmp_path / "prepared.txt").read_text().split() == ["0", "0"]
    assert (r0["zero_only"], r1["zero_only"]) == ("ran", None)
    assert r0["stages"] == r1["stages"] == ["fit", "predict"]
    # 8*16+16 and 16+1 parameters: the whole model on every rank, also when sharded
    assert (
        r0["summary"]
        == r1["summary"]
        == [["body", "Sequential", 144, 144], ["head", "Linear", 17, 17]]
    )
    assert (
        r0["metrics"] == ["val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1"] == r1["metrics"]
    )
    assert r0["step"] == 4  # 32 samples, batch 4, 2 ranks
    assert r0["strategy"] == strategy  # built by DDPStrategy / DeepSpeedStrategy / FSDPStrategy
    # Lightning's Trainer names on each rank, read at the epoch's last batch: the model the strategy
    # runs, this
    # rank's batch counts, and one log_dir (rank 0's version_0, though rank 1 found version_0 taken)
    # FSDP2 shards the Module in place, giving it the class FSDPNet
    model = {
        "ddp": "DistributedDataParallel",
        "deepspeed_stage_3": "DeepSpeedEngine",
        "fsdp": "FSDPNet",
    }[strategy]
    for r, names in enumerate((r0["names"], r1["names"])):
        assert names == dict(
            model=model,
            module=True,
            train_batches=4,
            val_batches=[2, 2],
            val_loaders=2,
            node_rank=0,
            local_rank=r,
            state=["fit", "train"],
            last_batch_idx=3,
            log_dir=r0["names"]["log_dir"],
            experiment="ExperimentWriter" if r == 0 else "DummyExperiment",
            gathered=[[0.5], [1.5]],
            gathered_with_grads=[0.0, 2.0],
        )  # Module.all_gather
    assert r0["names"]["log_dir"] == str(tmp_path / "logs" / "lightning_logs" / "version_0")
    assert (
        r0["hooks"]
        == r1["hooks"]
        == {"before_optimizer_step": 4, "before_zero_grad": 4, "after_backward": 4}
    )
    # The DataModule's on_before_batch_transfer saw each rank's own batches of every loop: 4
    # training batches,
    # the sanity check's first batch of each validation loader, 2 per loader in validation, 1 to
    # predict.
    assert (
        r0["transfers"]
        == r1["transfers"]
        == {
            "predict/0": 1,
            "sanity/0": 1,
            "sanity/1": 1,
            "train/0": 4,
            "validate/0": 2,
            "validate/1": 2,
        }
    )
    # The trained weights, read from the strategy's own checkpoint layout: the same predictions as
    # the ranks'.
    model = Net.load_from_checkpoint(tmp_path / "checkpoints")
    x = predict_inputs()
    with torch.no_grad():
        got = [model(x[i : i + 1]).tolist() for i in range(2)]
    torch.testing.assert_close(
        torch.tensor(got[0]), torch.tensor(r0["preds"][0]), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        torch.tensor(got[1]), torch.tensor(r1["preds"][0]), rtol=1e-5, atol=1e-6
    )
