"""predict on 2 ranks sees each sample exactly once under every strategy, and validate and test
do where the forward is each rank's own (ddp): no sample repeated to even the ranks (torch's
DistributedSampler evaluates 5 samples as 6), and the rank with fewer batches does not hang a
strategy whose forward is collective (fsdp, ZeRO-3), where validation keeps the padding.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_eval_once.py
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import ROOT, launch
from lightspeed.data.samplers import UnrepeatedDistributedSampler, even_across_ranks

SCRIPT = ROOT / "tests" / "eval_once_script.py"


@pytest.mark.parametrize(
    "strategy", ["ddp", "fsdp", pytest.param("deepspeed_stage_3", marks=pytest.mark.slow)]
)
def test_each_sample_is_evaluated_once_on_two_ranks(tmp_path, strategy):
    run = launch([str(SCRIPT), str(tmp_path), strategy], tmp_path, "python", timeout=240,
                 extra_env={"DS_ACCELERATOR": "cpu"})  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # predict: every strategy, each sample once (rank 1's extra turn under a collective forward
    # is a shadow step whose prediction is dropped)
    assert sorted(r0["predict"] + r1["predict"]) == [0, 1, 2, 3, 4]
    assert (r0["predictions"], r1["predictions"]) == (3, 2)
    for stage in ("validate", "test"):
        seen, metrics = sorted(r0[stage] + r1[stage]), r0["metrics"]
        if strategy == "ddp":  # the forward is the rank's own: each sample once
            assert seen == [0, 1, 2, 3, 4], (stage, r0[stage], r1[stage])
            assert (metrics[f"{stage}_count"], metrics[f"{stage}_sum"]) == (5.0, 10.0)
        else:  # collective forward: torch's padding (sample 0 twice), as Lightning's
            assert seen == [0, 0, 1, 2, 3, 4], (stage, r0[stage], r1[stage])
            assert (metrics[f"{stage}_count"], metrics[f"{stage}_sum"]) == (6.0, 10.0)


def test_the_unrepeated_sampler_shares_out_every_sample_once():
    data = list(range(11))
    for shuffle in (False, True):
        shares = [
            list(UnrepeatedDistributedSampler(data, 3, r, shuffle=shuffle, seed=7))
            for r in range(3)
        ]
        assert [len(s) for s in shares] == [4, 4, 3]
        assert sorted(sum(shares, [])) == data
    sampler = UnrepeatedDistributedSampler(data, 2, 0, shuffle=True)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first  # a new order each epoch, as torch's
    # 6 and 5 samples: at batch 2, 3 batches each; at batch 5, 2 against 1
    assert even_across_ranks(torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler))
    assert not even_across_ranks(torch.utils.data.DataLoader(data, batch_size=5, sampler=sampler))
