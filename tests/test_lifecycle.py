"""The lifecycle: each protocol method runs once per phase, and a failure ends every entry point
cleanly.

    .venv/bin/python -m pytest -q tests/test_lifecycle.py

- Protocol calls are counted on every strategy in a validate -> fit -> test run (a group of one; the
  strategies one after another in one process): check once per entry point, connect and configure_model once, setup once per phase
  (evaluation, then fit; test reuses fit's), teardown once (at exit), step once per optimizer step.
- A `training_step` that raises on rank 1 of 2: rank 1's on_exception hooks run, rank 0's progress
bar is
  stopped on the terminal (a pseudo-terminal here, as a person would see it) and its loggers are
  finalised with status "failed", and the failing traceback is printed once.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

COUNT_SCRIPT = r"""
import atexit, collections, json, sys
sys.path.insert(0, {tests!r})
import torch
import lightspeed as ls
from test_trainer import Regress, regression_data

counts = {{}}
atexit.register(lambda: print("COUNTS" + json.dumps(counts), flush=True))  # registered first: runs last

class Counting:
    '''Delegates to a real strategy (nothing is mocked) and counts the protocol calls.'''
    def __init__(self, inner):
        self.inner, self.calls = inner, collections.Counter()
    def __getattr__(self, name):
        return getattr(self.inner, name)

for method in ("check", "connect", "configure_model", "setup", "forward", "backward", "step", "save", "load",
               "teardown"):
    def counted(self, *args, _m=method, **kwargs):
        self.calls[_m] += 1
        return getattr(self.inner, _m)(*args, **kwargs)
    setattr(Counting, method, counted)

class Model(Regress):
    def configure_optimizers(self):  # an optimizer with state: torch's FSDP optimizer-state save steps a
        return torch.optim.AdamW(self.parameters(), lr=0.01)  # stateless SGD once to create state (segfaults)

for name in sys.argv[1:]:  # one strategy after another, in this process
    strategy = Counting(ls.build_strategy(name, 1))
    counts[name] = strategy.calls
    trainer = ls.Trainer(strategy=strategy, devices=1, accelerator="cpu", max_steps=4, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, accumulate_grad_batches=2)
    model = Model()
    trainer.validate(model, regression_data(8))
    trainer.fit(model, regression_data(32))
    trainer.save_checkpoint(f"ckpt-{{name}}")
    trainer.test(model, regression_data(8))
"""

STRATEGIES = [
    "single",
    "ddp",
    "ddp_sharded",
    "fsdp",
    "fsdp_grad_op",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
]


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict[str, dict]:
    """COUNT_SCRIPT over every strategy, one after another in one process: name -> its counts."""
    tmp = tmp_path_factory.mktemp("count")
    script = tmp / "count.py"
    script.write_text(COUNT_SCRIPT.format(tests=str(ROOT / "tests")))
    proc = subprocess.run(
        [sys.executable, str(script), *STRATEGIES],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT / "src"),
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
        },
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("COUNTS")), None)
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[len("COUNTS") :])


@pytest.mark.parametrize("name", STRATEGIES)
def test_protocol_calls_once_per_phase(counts, name):
    c = counts[name]
    # 4 optimizer steps of 2 micro-batches; validation 2 batches of 4, test 2 batches of 4; one
    # save.
    once = {
        "check": 3,
        "connect": 1,
        "configure_model": 1,
        "setup": 2,
        "teardown": 1,
        "step": 4,
        "backward": 8,
        "forward": 8 + 2 + 2,
        "save": 1,
        "load": 0,
    }
    assert {k: c.get(k, 0) for k in once} == once


FAIL_SCRIPT = r"""
import sys
import time
from pathlib import Path
sys.path.insert(0, {tests!r})
import lightspeed as ls
from test_trainer import Regress, regression_data

class Recorder(ls.Callback):
    def on_exception(self, trainer, module, exception):
        Path(f"on_exception-rank{{trainer.global_rank}}.txt").write_text(type(exception).__name__)

class FinalisedCSV(ls.CSVLogger):
    def finalize(self, status):
        super().finalize(status)
        Path("finalized.txt").write_text(status)  # loggers live on rank 0 only

class Boom(Regress):
    def training_step(self, batch, batch_idx):
        if self.global_step == 3 and self.global_rank == 1:
            raise RuntimeError("deliberate failure in training_step on rank 1")
        if self.global_step == 3:  # rank 0 is busy (outside any collective) when rank 1 dies: its launcher's
            time.sleep(1.5)  # watchdog sees the dead rank first, and must let rank 0 fail and finalize itself
        return super().training_step(batch, batch_idx)

trainer = ls.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_steps=50, logger=[FinalisedCSV(".")],
                     callbacks=[Recorder()], enable_progress_bar=True, enable_checkpointing=False)
trainer.fit(Boom(), regression_data(256, 2))
"""


def test_failure_in_training_step_ends_cleanly(tmp_path):
    script = tmp_path / "boom.py"  # a file: the Trainer re-runs it as rank 1
    script.write_text(FAIL_SCRIPT.format(tests=str(ROOT / "tests")))
    primary, replica = pty.openpty()  # rank 0's stdout is a terminal: rich draws a live bar there
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        stdout=replica,
        stderr=subprocess.PIPE,
        text=False,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT / "src"),
            "OMP_NUM_THREADS": "1",
            "COLUMNS": "120",
        },
    )
    os.close(replica)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(primary, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    _, err = proc.communicate(timeout=120)
    reader.join(timeout=5)
    os.close(primary)
    terminal, stderr = b"".join(chunks).decode(errors="replace"), err.decode(errors="replace")
    assert proc.returncode != 0, stderr[-3000:]
    assert stderr.count("RuntimeError: deliberate failure in training_step on rank 1") == 1, stderr[
        -4000:
    ]
    assert (tmp_path / "on_exception-rank1.txt").read_text() == "RuntimeError"
    # rank 0 failed by itself on the dead peer (its launcher's watchdog waited for that), so its
    # callbacks and
    # loggers saw the failure too
    assert (tmp_path / "on_exception-rank0.txt").exists(), stderr[-3000:]
    assert (tmp_path / "finalized.txt").read_text() == "failed", stderr[-3000:]
    hide, show = (
        "\x1b[?25l",
        "\x1b[?25h",
    )  # rich hides the cursor while the bar is live, shows it when stopped
    assert hide in terminal and terminal.rfind(show) > terminal.rfind(hide), terminal[-500:]
