"""Loggers as real parts: CSV and TensorBoard files read back, a real MLflow store (SQLite, created
here) read back with MlflowClient, and W&B's offline run file read back with W&B's own protobuf
schema.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_trackers.py
"""

from __future__ import annotations

import glob
import struct
import time
from pathlib import Path

import pytest
import yaml

import lightspeed as ls
from lightspeed.callbacks.run_metrics import RunMetrics
from lightspeed.loggers import CSVLogger, MLflowLogger, TensorBoardLogger, WandbLogger
from test_trainer import Regress, make_trainer, regression_data


def _fit(tmp_path: Path, logger, steps: int = 6) -> ls.Trainer:
    """A one-device fit of the regression model with RunMetrics, logging every 2 steps, saving
    `last`. Its SGD starts at lr 0.1, halved every 2 steps: lr 0.05, 0.025, 0.0125 at the log steps
    2, 4, 6."""
    trainer = make_trainer(
        tmp_path,
        max_steps=steps,
        log_every_n_steps=2,
        logger=[logger],
        callbacks=[RunMetrics(report=False)],
        enable_checkpointing=True,
    )
    trainer.fit(Regress("dict_step"), regression_data())
    return trainer


def _weights(trainer: ls.Trainer, tmp_path: Path) -> Path:
    return ls.consolidate(trainer.checkpoint_dir / "last.ckpt", tmp_path / "model.safetensors")


def test_csv_and_tensorboard_honour_the_protocol(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    csv_logger = CSVLogger(tmp_path)
    trainer = _fit(tmp_path, csv_logger)
    run = Path(csv_logger.log_dir)
    hparams = yaml.safe_load((run / "run.yaml").read_text())
    # The settings RunMetrics writes at fit start (run.yaml, not the loggers' hyper-parameters),
    # nested as written, through a real YAML writer.
    assert (
        hparams["strategy"] == "single"
        and hparams["world_size"] == 1
        and hparams["trainer"]["max_steps"] == 6
    )
    assert hparams["parameters"] == sum(p.numel() for p in trainer.lightning_module.parameters())
    assert (
        yaml.safe_load((run / "status.yaml").read_text())["status"] == "success"
    )  # the Trainer's finalize()
    weights = _weights(trainer, tmp_path)
    csv_logger.save_artifact(weights)
    assert (run / "artifacts" / "model.safetensors").read_bytes() == weights.read_bytes()
    csv_logger.finalize("failed")
    assert yaml.safe_load((run / "status.yaml").read_text())["status"] == "failed"
    with pytest.raises(ls.ConfigError, match=r"finalize\(status=3\) is not valid"):
        csv_logger.finalize(3)
    with pytest.raises(ls.ConfigError, match="expected an existing file"):
        csv_logger.save_artifact(tmp_path / "nothing.bin")

    tb = TensorBoardLogger(tmp_path, name="tb")
    tb.log_hyperparams({"strategy": "ddp", "nested": {"lr": 0.1}})
    tb.log_metrics({"loss": 1.5}, step=3)
    tb.finalize("interrupted")
    events = EventAccumulator(tb.log_dir)
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 1.5)]
    texts = {
        tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode()
        for tag in events.Tags()["tensors"]
    }
    saved = yaml.safe_load((Path(tb.log_dir) / "hparams.yaml").read_text())  # as Lightning's
    assert saved == {"strategy": "ddp", "nested": {"lr": 0.1}}
    assert texts["status/text_summary"] == "interrupted"


def test_mlflow_store_holds_params_metrics_artifact_and_status(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLflowLogger(
        experiment_name="t",
        run_name="fit",
        tracking_uri=uri,
        artifact_location=tmp_path / "mlartifacts",
    )
    trainer = _fit(tmp_path, logger)
    logger.save_artifact(_weights(trainer, tmp_path))

    client = MlflowClient(
        uri
    )  # a fresh client: what the store holds, not what the logger remembers
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "fit"
    params = run.data.params
    assert "strategy" not in params  # the loggers get the user's hyper-parameters only
    assert [m.step for m in client.get_metric_history(logger.run_id, "train_loss_step")] == [
        2,
        4,
        6,
    ]
    assert [m.value for m in client.get_metric_history(logger.run_id, "lr-SGD")] == [
        0.05,
        0.025,
        0.0125,
    ]
    assert all(m.value > 0 for m in client.get_metric_history(logger.run_id, "samples_per_s"))
    assert client.get_metric_history(logger.run_id, "peak_memory_gib/rank0")[0].value > 0
    artifacts = {a.path: a.file_size for a in client.list_artifacts(logger.run_id)}
    assert artifacts == {"model.safetensors": (tmp_path / "model.safetensors").stat().st_size}

    failed = MLflowLogger(experiment_name="t", tracking_uri=uri)
    failed.log_metrics({"loss": 2.0}, step=1)
    failed.finalize("failed")
    assert client.get_run(failed.run_id).info.status == "FAILED"


def _wandb_records(run_file: Path) -> list:
    """The records of a W&B transaction log (`run-<id>.wandb`), parsed with W&B's own protobuf
    `Record`.

    The container is LevelDB's log format: a 7-byte header (":W&B", magic, version), then 32 KiB
    blocks of chunks, each with a 7-byte header (CRC-32C, little-endian length, type: 1 full, 2
    first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _finished_wandb_run(save_dir: Path, timeout: float = 30.0) -> list:
    """The records of the one offline run under `save_dir`, once its exit record is written:
    `finish()` can return before W&B's service process has written the file (seen with wandb
    0.31)."""
    deadline = time.monotonic() + timeout
    while True:
        files = glob.glob(str(save_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
        records = _wandb_records(Path(files[0])) if len(files) == 1 else []
        if (
            any(r.WhichOneof("record_type") == "exit" for r in records)
            or time.monotonic() > deadline
        ):
            return records
        time.sleep(0.1)


def test_wandb_offline_run_files_hold_the_metrics(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="t", name="fit", save_dir=tmp_path / "wb", mode="offline")
    trainer = _fit(tmp_path, logger)  # the Trainer finalizes, which finishes the W&B run
    records = _finished_wandb_run(tmp_path / "wb")
    kinds = [r.WhichOneof("record_type") for r in records]
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item
            }
            history[row["_step"]] = row
    assert sorted(history) == [2, 4, 6]
    assert [history[s]["lr-SGD"] for s in (2, 4, 6)] == [0.05, 0.025, 0.0125]
    assert all(history[s]["samples_per_s"] > 0 for s in history)
    assert "train_loss_step" in history[6] and history[6]["peak_memory_gib/rank0"] > 0
    config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert "strategy" not in config  # the loggers get the user's hyper-parameters only
    (exit_record,) = [r for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit.exit_code == 0 and "run" in kinds

    # An artifact, and a failed run's exit status, in a second offline run.
    weights = _weights(trainer, tmp_path)
    failed = WandbLogger(project="t", name="failed", save_dir=tmp_path / "wb2", mode="offline")
    failed.log_metrics({"loss": 2.0}, step=1)
    failed.save_artifact(weights)
    failed.finalize("failed")
    records = _finished_wandb_run(tmp_path / "wb2")
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert artifact.type == "model" and artifact.name.endswith("-model")
    (exit_record,) = [r for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit.exit_code == 1
    import wandb

    wandb.teardown()  # stops W&B's background service (wandb-core), a child of this test process
