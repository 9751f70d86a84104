"""What the heartbeat (lightspeed/runtime/heartbeat.py) costs a training process, measured on this
machine.

    PYTHONPATH=src .venv/bin/python benchmarks/heartbeat_cost.py

The loop pays `note_step` once per step (an attribute write). The heartbeat thread pays one tick per
second: sample the training thread's stack, encode, `TCPStore.set` to a store on 127.0.0.1. The tick
holds the GIL for part of that time; the table gives both as microseconds and the tick as a share of
each second.
"""

from __future__ import annotations

import statistics
import time
import timeit

import torch.distributed as dist

from lightspeed.runtime import heartbeat


def main() -> None:
    per_step = (
        min(timeit.repeat(lambda: heartbeat.note_step(7), number=100_000, repeat=5)) / 100_000
    )
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    heartbeat.start(0, 1, "127.0.0.1", server.port, timeout_s=600)
    heart = heartbeat._heart
    samples, ticks = [], []
    for _ in range(200):
        t0 = time.perf_counter()
        beat = heart.sample()
        t1 = time.perf_counter()
        heart.publish(beat)
        t2 = time.perf_counter()
        samples.append(t1 - t0)
        ticks.append(t2 - t0)
    heartbeat.stop()
    tick = statistics.median(ticks)
    print(f"note_step (per optimizer step):   {per_step * 1e9:8.0f} ns")
    print(f"tick: stack sample               {statistics.median(samples) * 1e6:8.1f} us")
    print(
        f"tick: sample + TCPStore.set      {tick * 1e6:8.1f} us  = "
        f"{tick / heartbeat.INTERVAL_S:.4%} of each second"
    )


if __name__ == "__main__":
    main()
