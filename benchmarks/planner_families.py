"""`strategy="auto"` on six model families nobody here wrote, each under a memory cap that plain
training cannot fit: the forecast's device and host peaks against the measured ones of the real run.

    python benchmarks/planner_families.py                 # one GPU, each family under its cap
    python benchmarks/planner_families.py --only llama,gpt2
    python benchmarks/planner_families.py --cpu           # tiny configs, 2 CPU ranks (plumbing)
    python benchmarks/planner_families.py --parallel 2    # two families at a time (peaks as alone)

The families, each built from a config as its users write it (no downloads): a Hugging Face
Llama-style decoder (LlamaForCausalLM), GPT-2, an encoder-decoder (T5), a vision transformer (HF
ViT), a CNN (torchvision ConvNeXt, else timm's), a mixture-of-experts decoder (Mixtral). Each is a
LightningModule that builds the model in `__init__` and returns the model's own loss; the optimizer
is `torch.optim.AdamW`. The Trainer gets `accelerator`, `precision="bf16-mixed"`, `strategy="auto"`,
`micro_batch` ("auto" for the decoders) and 3 steps; nothing about memory except the cap
(`torch.cuda.set_per_process_memory_fraction`; on CPU `memory_budget`).

Each family runs in its own process (a hard time limit, `--limit`). Measured there: the device peak
of the real run (`torch.cuda.max_memory_allocated` from the end of the micro-batch trials, which
reset it, through setup and 3 steps), the host peak (the process's peak resident memory less what
it held before the model was built, its libraries loaded), seconds per step. The forecast is the planner's for what ran:
the strategy the run ended with (after any fallback) at the micro-batch it trained with, from the
same probe the run used (one probe: the run's `inspect_model` is handed the benchmark's facts).
Also shown: plain training's forecast ("single"), which the cap rules out.

After the table, each family's micro-batch trials: the size, whether it ran, and on a GPU the bytes
allocated before the trial and after its release (a failed trial must leave nothing behind: issue
38's GPT-2 trial left 3.5 GiB). `--parallel N` runs N families at once: each has its own process and
cap, so the memory figures are those of a run alone; the seconds per step are not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import lightspeed as ls  # noqa: E402
import lightspeed.plan.micro_batch as micro_batch  # noqa: E402
from lightspeed.plan.candidates import build_candidates  # noqa: E402
from lightspeed.plan.forecast import forecast_candidate  # noqa: E402
from lightspeed.plan.probe import inspect_model  # noqa: E402

GIB = 2**30
FAMILIES = ("llama", "gpt2", "t5", "vit", "cnn", "moe")
# GPU: the model sizes and caps (GiB). Each cap is below plain training's forecast model states.
GPU = {
    "llama": dict(cap=6, seq=256, micro_batch="auto", samples=8),
    "gpt2": dict(cap=5, seq=256, micro_batch="auto", samples=8),
    "t5": dict(cap=4, seq=256, micro_batch="auto", samples=8),
    "vit": dict(cap=4, seq=0, micro_batch="auto", samples=8),
    "cnn": dict(cap=3, seq=0, micro_batch="auto", samples=8),
    "moe": dict(cap=6, seq=256, micro_batch="auto", samples=8),
}


def build(family: str, tiny: bool) -> torch.nn.Module:
    """The family's model, from a config (random weights)."""
    import transformers as hf

    if family == "llama":
        d, layers, ff, vocab = (64, 2, 128, 256) if tiny else (1536, 12, 4096, 32000)
        cfg = hf.LlamaConfig(
            hidden_size=d,
            num_hidden_layers=layers,
            num_attention_heads=4 if tiny else 12,
            num_key_value_heads=2 if tiny else 4,
            intermediate_size=ff,
            vocab_size=vocab,
            max_position_embeddings=1024,
        )
        return hf.LlamaForCausalLM(cfg)
    if family == "gpt2":
        d, layers, heads = (64, 2, 4) if tiny else (1280, 16, 20)
        cfg = hf.GPT2Config(
            n_embd=d, n_layer=layers, n_head=heads, vocab_size=256 if tiny else 50257
        )
        return hf.GPT2LMHeadModel(cfg)
    if family == "t5":
        d, ff, layers = (64, 128, 2) if tiny else (1024, 4096, 8)
        cfg = hf.T5Config(
            d_model=d,
            d_ff=ff,
            d_kv=16 if tiny else 64,
            num_layers=layers,
            num_decoder_layers=layers,
            num_heads=4 if tiny else 16,
            vocab_size=256 if tiny else 32128,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        return hf.T5ForConditionalGeneration(cfg)
    if family == "vit":
        d, layers, ff = (64, 2, 128) if tiny else (1024, 24, 4096)
        cfg = hf.ViTConfig(
            hidden_size=d,
            num_hidden_layers=layers,
            num_attention_heads=4 if tiny else 16,
            intermediate_size=ff,
            image_size=32 if tiny else 224,
            patch_size=8 if tiny else 16,
            num_labels=10 if tiny else 1000,
        )
        return hf.ViTForImageClassification(cfg)
    if family == "cnn":
        try:
            from torchvision.models import convnext_large, convnext_tiny

            return convnext_tiny(num_classes=10) if tiny else convnext_large()
        except Exception:  # noqa: BLE001 - torchvision absent or not importable beside this torch
            import timm

            return timm.create_model("convnext_atto" if tiny else "convnext_large", num_classes=10)
    if family == "moe":
        d, layers, ff = (64, 2, 64) if tiny else (1024, 8, 2048)
        cfg = hf.MixtralConfig(
            hidden_size=d,
            num_hidden_layers=layers,
            num_attention_heads=4 if tiny else 16,
            num_key_value_heads=2 if tiny else 4,
            intermediate_size=ff,
            num_local_experts=4 if tiny else 8,
            num_experts_per_tok=2,
            vocab_size=256 if tiny else 32000,
            max_position_embeddings=1024,
        )
        return hf.MixtralForCausalLM(cfg)
    raise ValueError(family)


class Samples(Dataset):
    """Random inputs in the family's form: token ids (decoders: labels are the ids), source and
    target ids (T5), images and labels (ViT, CNN)."""

    def __init__(self, family: str, n: int, seq: int, tiny: bool, vocab: int):
        self.family, self.n, self.seq, self.tiny, self.vocab = family, n, seq, tiny, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        if self.family in ("vit", "cnn"):
            side = 32 if self.tiny else 224
            return torch.randn(3, side, side, generator=g), torch.randint(0, 10, (), generator=g)
        ids = torch.randint(0, self.vocab, (self.seq,), generator=g)
        if self.family == "t5":
            return ids, torch.randint(0, self.vocab, (max(8, self.seq // 4),), generator=g)
        return ids


class Family(ls.LightningModule):
    """A model as its users train it: built in `__init__`, its own loss, AdamW."""

    def __init__(self, family: str, tiny: bool, seq: int, samples: int, batch_size: int = 1):
        super().__init__()
        self.family, self.batch_size = family, batch_size
        self.model = build(family, tiny)
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", 10)
        self.data = Samples(family, samples, seq, tiny, vocab)

    def training_step(self, batch, batch_idx):
        match self.family:
            case "vit":
                x, y = batch
                return self.model(pixel_values=x, labels=y).loss
            case "cnn":
                x, y = batch
                return torch.nn.functional.cross_entropy(self.model(x), y)
            case "t5":
                src, tgt = batch
                return self.model(input_ids=src, labels=tgt).loss
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-5)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


class Timing(ls.Callback):
    """Each batch's end (the GPU synchronized) and loss; at the fourth batch, what the process runs
    with (threads, garbage collection, DeepSpeed's offload settings): `auto`'s run and a plan by hand
    are compared on these when their steps differ (planner_speed.py)."""

    def __init__(self):
        self.ends: list[float] = []
        self.losses: list[float] = []
        self.gc_s = 0.0  # seconds in the garbage collector since the first batch ended
        self.state: dict = {}
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if not self.ends:
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_start

    def _state(self, trainer) -> dict:
        engine = getattr(trainer.strategy, "engine", None)
        opt = getattr(engine, "optimizer", None)
        fp32 = getattr(opt, "single_partition_of_fp32_groups", None) or [None]
        return {
            "torch_threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "omp_env": os.environ.get("OMP_NUM_THREADS"),
            "python_threads": threading.active_count(),
            "gc_objects": len(gc.get_objects()),
            "gc_enabled": gc.isenabled(),
            "pin_memory": getattr(opt, "cpu_offload_pin_memory", None),
            "fp32_pinned": fp32[0].is_pinned() if fp32[0] is not None else None,
            "overlap_comm": getattr(opt, "overlap_comm", None),
            "optimizer": type(getattr(opt, "optimizer", opt)).__name__,
        }

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach().float()))
        if batch_idx == 3:
            self.state = self._state(trainer)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        self.ends.append(time.perf_counter())


def load_libraries() -> None:
    """What a run loads whatever its model: transformers, torchvision, DeepSpeed and its CPU Adam
    (loaded before the baseline of the host measurement: they are not the model's memory)."""
    import transformers  # noqa: F401

    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or not importable beside this torch
        pass
    from deepspeed.accelerator import get_accelerator

    get_accelerator().create_op_builder("CPUAdamBuilder").load()


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(family: str, cpu: bool, spec: dict) -> dict:
    """One family: the cap, the model, `Trainer.fit` under `strategy="auto"`, the measurements."""
    ls.seed_everything(0)
    precision, devices = "bf16-mixed", 2 if cpu else 1
    if cpu:  # a budget between the sharded plans and plain ddp, from the model's own forecast
        spec["cap"] = cpu_budget(Family(family, cpu, spec["seq"], spec["samples"]), precision) / GIB
    else:
        torch.cuda.init()
        torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")  # CUDA and cuBLAS
        whole = torch.cuda.mem_get_info()[1]
        torch.cuda.set_per_process_memory_fraction(spec["cap"] * GIB / whole)
        load_libraries()
    base = rss_now()  # before the model: the libraries, CUDA's context
    model = Family(family, cpu, spec["seq"], spec["samples"], spec.get("batch_size", 1))
    sample = next(iter(DataLoader(model.data, batch_size=1)))
    facts = inspect_model(model, sample, precision, "cpu" if cpu else "cuda")
    # The run probes once: its own inspect_model gets these facts (the same probe, the same sample).
    micro_batch.inspect_model = lambda *a, **k: facts
    trial_rows, plans = record_trials(cpu), record_plans()
    plain = forecast_candidate(build_candidates(devices)[0], facts, devices, precision, 1)
    timing = Timing()
    name = spec.get("strategy", "auto")  # a plan tried by hand: planner_speed.py
    trainer = ls.Trainer(
        accelerator="cpu" if cpu else "gpu",
        devices=devices,
        precision=precision,
        strategy=name if name == "auto" else micro_batch.planned_strategy(name, devices, model),
        micro_batch=spec["micro_batch"],
        micro_batch_trials=4,
        max_steps=spec.get("steps", 3),
        memory_budget=spec["cap"] * GIB if cpu else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timing],
    )
    start = time.perf_counter()
    if spec.get("history"):  # the allocator's events, to say what is live at the peak
        torch.cuda.memory._record_memory_history(max_entries=500_000)
    trainer.fit(model)
    peak = torch.cuda.max_memory_allocated() if not cpu else 0
    if spec.get("history"):
        Path(spec["history"]).parent.mkdir(parents=True, exist_ok=True)
        Path(spec["history"]).write_text(live_at_peak(torch.cuda.memory._snapshot()))
    candidate = micro_batch.candidate_of(trainer.strategy, devices)
    mb = model.batch_size
    trials = spec["micro_batch"] is not None
    f = forecast_candidate(candidate, facts, devices, precision, mb, pinned=not cpu, trials=trials)
    steps = [b - a for a, b in zip(timing.ends, timing.ends[1:])]
    return {
        "family": family,
        "params": facts.numel,
        "cap": spec["cap"] * GIB,
        "plain": plain.device_total,
        "strategy": candidate.name,
        "micro_batch": mb,
        "forecast": f.device_total,
        "measured": peak,
        "forecast_host": f.host_peak,
        "measured_host": rss_peak() - base,
        "s_per_step": sorted(steps)[len(steps) // 2] if steps else None,
        "steps": steps,
        "gc_s": timing.gc_s,
        "process": timing.state,
        "trained": len(timing.losses) == spec.get("steps", 3)
        and all(map(lambda x: x == x, timing.losses)),
        "tokens_per_sample": facts.tokens_per_sample,
        "losses": timing.losses,
        "seconds": time.perf_counter() - start,
        "trials": trial_rows,
        "plans": plans,
        "rank0": trainer.is_global_zero,
    }


def record_trials(cpu: bool) -> list[list]:
    """Wraps the micro-batch trials (`micro_batch.try_steps`) to keep [size, ran, note, allocated
    before, allocated after] for each; on a GPU also prints them as they end."""
    rows: list[list] = []
    trial = micro_batch.try_steps

    def recorded(plan, strategy, module, size, step):
        before = 0 if cpu else torch.cuda.memory_allocated()
        ran, freed, note = trial(plan, strategy, module, size, step)
        after = 0 if cpu else torch.cuda.memory_allocated()
        rows.append([size, ran, note, before, after])
        if not cpu:
            print(
                f"trial {size}: {'ran' if ran else 'failed'}; allocated {before / GIB:.3f} GiB "
                f"before, {after / GIB:.3f} GiB after its release",
                flush=True,
            )
        return ran, freed, note

    micro_batch.try_steps = recorded
    return rows


def record_plans(top: int = 6) -> list[list]:
    """Wraps `strategy="auto"`'s choice (`micro_batch.auto_choice`) to keep the plans that fit, in
    rank order, as [name, micro-batch, forecast tokens/s, forecast device bytes]: the chosen one,
    then its fallbacks (the first `top`)."""
    rows: list[list] = []
    choose = micro_batch.auto_choice

    def recorded(*args, **kwargs):
        choice = choose(*args, **kwargs)
        for f in (choice.forecast, *choice.fallbacks)[:top]:
            rows.append([f.candidate.name, f.micro_batch, f.tokens_per_s, f.device_total])
        return choice

    micro_batch.auto_choice = recorded
    return rows


def live_at_peak(snapshot: dict, top: int = 30) -> str:
    """The blocks live at the allocator's largest total in `snapshot`'s event trace, grouped by
    where they were allocated (the innermost frames outside torch), largest first."""
    events = snapshot["device_traces"][0]
    total = best = best_at = 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            total += e["size"]
        elif e["action"] == "free_completed":
            total -= e["size"]
        if total > best:
            best, best_at = total, i
    live: dict[int, dict] = {}
    for e in events[: best_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups: dict[str, int] = {}
    for e in live.values():
        frames = [
            f
            for f in e.get("frames", [])
            if f["filename"].endswith(".py") and "/torch/" not in f["filename"]
        ][:4]
        key = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames)
        groups[key] = groups.get(key, 0) + e["size"]
    lines = [f"peak in the trace {best / 2**30:.3f} GiB (event {best_at} of {len(events)})"]
    for key, size in sorted(groups.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{size / 2**20:9.1f} MiB  {key}")
    return "\n".join(lines) + "\n"


def table(rows: list[dict]) -> str:
    head = (
        f"{'family':7s} {'params':>7s} {'cap':>6s} {'plain':>7s}  {'auto chose':28s} {'mb':>3s} "
        f"{'forecast':>8s} {'measured':>8s} {'ratio':>5s}  {'host f':>7s} {'host m':>7s} "
        f"{'ratio':>5s} {'s/step':>6s} trained"
    )
    out = [head]
    for r in rows:
        if "error" in r:
            out.append(f"{r['family']:7s} error: {r['error']}")
            continue
        ratio = r["forecast"] / r["measured"] if r["measured"] else float("nan")
        hratio = r["forecast_host"] / r["measured_host"] if r["measured_host"] > 0 else float("nan")
        step = f"{r['s_per_step']:.2f}" if r["s_per_step"] else "-"
        out.append(
            f"{r['family']:7s} {r['params'] / 1e9:6.2f}B {r['cap'] / GIB:5.1f}G "
            f"{r['plain'] / GIB:6.2f}G  {r['strategy']:28s} {r['micro_batch']:3d} "
            f"{r['forecast'] / GIB:7.2f}G {r['measured'] / GIB:7.2f}G {ratio:5.2f}  "
            f"{r['forecast_host'] / GIB:6.2f}G {r['measured_host'] / GIB:6.2f}G {hratio:5.2f} "
            f"{step:>6s} {'yes' if r['trained'] else 'no'}"
        )
    return "\n".join(out)


def trials_text(rows: list[dict]) -> str:
    """Each family's micro-batch trials, one line each: size, ran or not, the allocated bytes
    before and after (GPU), and whether they came back to the value before."""
    out = ["micro-batch trials (allocated before -> after the trial's release):"]
    for r in rows:
        for size, ran, note, before, after in r.get("trials", []):
            back = "back" if abs(after - before) <= 2**20 else f"+{(after - before) / GIB:.3f} GiB"
            out.append(
                f"  {r['family']:6s} {size:4d} {'ran   ' if ran else 'failed'} "
                f"{before / GIB:6.3f} -> {after / GIB:6.3f} GiB ({back})  {note[:70]}"
            )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(FAMILIES))
    p.add_argument("--cpu", action="store_true", help="tiny configs on 2 CPU ranks (plumbing)")
    p.add_argument("--limit", type=float, default=240, help="seconds per family")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help="folder for planner_families.json")
    p.add_argument("--history", help="families whose live blocks at the peak go to --out")
    p.add_argument("--parallel", type=int, default=1, help="families run at once")
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        row = child(spec.pop("family"), args.cpu, spec)
        if row.pop("rank0"):
            print("RESULT " + json.dumps(row), flush=True)
        return

    def one(family: str) -> dict:
        spec = {"family": family, **GPU[family]}
        if args.history and family in args.history.split(",") and args.out:
            spec["history"] = str(Path(args.out, f"history_{family}.txt"))
        if args.cpu:  # tiny models; the budget comes from their forecast (cpu_budget)
            spec.update(seq=16, samples=8)
        cmd = [sys.executable, __file__, "--child", json.dumps(spec)] + (["--cpu"] * args.cpu)
        row = run_child(cmd, family, args.limit)
        print(table([row]).splitlines()[-1], flush=True)
        return row

    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        rows = list(pool.map(one, args.only.split(",")))
    text = table(rows) + "\n\n" + trials_text(rows)
    print("\n" + text, flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "planner_families.json").write_text(json.dumps(rows, indent=1))
        Path(args.out, "planner_families.txt").write_text(text + "\n")


def cpu_budget(model: Family, precision: str) -> float:
    """--cpu: a per-rank budget on 2 ranks between plain ddp's forecast and the smallest sharded
    one's (model states only: every rank computes the same)."""
    facts = inspect_model(model, None, precision)
    rows = [forecast_candidate(c, facts, 2, precision, 1) for c in build_candidates(2, False)]
    rows = [r for r in rows if r.candidate.is_named]
    ddp = next(r.device_total for r in rows if r.candidate.name == "ddp")
    sharded = min(r.device_total for r in rows if r.candidate.name != "ddp")
    return (ddp + sharded) / 2 / 0.9


def run_child(cmd: list[str], family: str, limit: float) -> dict:
    """Runs one family's process in its own group, killed at `limit` seconds; its RESULT line."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return {"family": family, "error": f"over {limit:.0f} s", "log": out[-3000:]}
    sys.stdout.write("".join(f"  [{family}] {line}\n" for line in out.splitlines()[-60:]))
    sys.stdout.flush()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = [line for line in out.splitlines() if line.strip()][-1:] or ["no output"]
    return {"family": family, "error": f"rc {proc.returncode}: {tail[0][:150]}"}


if __name__ == "__main__":
    main()
