"""The script every multi-rank test runs: `python tests/workload.py '<json options>'`.

It trains the tiny GPT with the Trainer (which starts its own ranks for devices > 1, or joins
torchrun's), records the per-step global-mean losses, and rank 0 writes them with other facts to the
JSON file `out`; `{"jobs": [options, ...]}` runs several option sets one after another in the same
ranks (helpers.run_jobs). Options (all optional except out): strategy, devices, max_steps,
max_epochs, accumulate, clip, clip_algo, precision, batch_size, ckpt_every, resume ("last" or a path), root,
seed, limit_train_batches, shuffle, predict, validate, test, consolidate (a path), fail_rank (raise
on that rank at step 3), dropout, num_nodes, progress (show the progress bar), fused (the module's
AdamW with fused=True), optimizer_kernels (the Trainer flag), compile (Trainer(compile=...): true or
a dict of torch.compile options; the loss is then recorded in on_train_batch_end, outside the
compiled step). Fault options: nan_at ({"step": k, "rank": r}: that rank's loss is NaN at global
step k; rank omitted: every rank), inf_grad_at ({"step": k, "rank": r}: at global step k a tensor
hook puts one Inf into that rank's gradient of blocks[0].attn.proj.weight, the loss stays finite),
on_nonfinite (the Trainer flag), sigterm_at ({"step": k, "rank":
r, "signal": "SIGTERM"}: that rank sends
itself the signal during step k); a run that exits (preemption) still writes its result, with "exit"
set to the status; stall_at ({"step": k, "rank": r, "seconds": s}: that rank sleeps; rank omitted:
every rank), collective_timeout (Trainer(timeout=)), uneven (rank r's own sampler gives
`limit_train_batches`-free counts of 6 + r batches, which lightspeed does not re-sample). DeepSpeed
options: ds (DeepSpeed(**ds) as the strategy; "ac": true checkpoints the GPT blocks), ds_hook (a
dict merged into the config by configure_deepspeed), fit (false: evaluate only, from resume), probe
(a path: rank 0 saves the eval-mode logits of the first batch there), two_optimizers;
result["deepspeed"] holds engine facts. FSDP / ZeRO-1 options: fsdp (FSDP(**fsdp) as the strategy;
shard_classes and activation_checkpointing as class names from lightspeed.demos.gpt or torch.nn;
result["fsdp_offload_policy"] names the policy applied), init_weights (a path: rank 0 saves the full
weights at fit start), build_in_init (the GPT is built in __init__, not configure_model), manual
(automatic_optimization=False), manual_clip (with manual: self.clip_gradients(opt,
gradient_clip_val=manual_clip) before each opt.step()),
duck_optimizer (configure_optimizers returns an object that is not a torch optimizer), memory
(result["memory"]: each rank's lightspeed.runtime.memory.measure after fit), memory_budget (bytes
per device for strategy "auto"). DDP option: ddp_comm_hook ("fp16", "bf16", "powersgd":
DDP(comm_hook=...); "count": a plain all-reduce hook in the `(state, hook)` form that records, per
call, how many micro-batches had run: result["comm_hook_calls"]). auto_requeue: the Trainer gets
plugins=[SLURMEnvironment(auto_requeue=...)].
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import lightspeed as ls  # noqa: E402
from lightspeed.demos.gpt import SIZES, ByteWindows, GPTModule, stdlib_corpus  # noqa: E402
from lightspeed.plugins import SLURMEnvironment  # noqa: E402


class Workload(GPTModule):
    def __init__(self, opts: dict):
        # Bias-free: a key bias has a zero gradient (softmax ignores shifts), and Adam turns the
        # fp32 noise
        # in that gradient into full-size updates, which would make weight comparisons meaningless.
        cfg = dataclasses.replace(SIZES["tiny"], bias=False, dropout=opts.get("dropout", 0.0))
        super().__init__(cfg, lr=opts.get("lr", 3e-3), warmup_steps=opts.get("warmup", 0))
        self.opts = opts
        self.losses: list[float] = []
        if opts.get("manual"):
            self.automatic_optimization = False
        if opts.get("build_in_init"):
            self.configure_model()

    def on_fit_start(self):
        if self.opts.get("init_weights"):
            # full_tensor() is a collective: every rank gathers, rank 0 writes.
            full = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in self.state_dict().items()
            }
            if self.global_rank == 0:
                torch.save(full, self.opts["init_weights"])

    def on_train_start(self):
        # Hooked on the Linear's forward: the weight it uses then is the one autograd accumulates
        # into under every strategy (FSDP2's unsharded parameter, ZeRO-3's gathered one).
        if self.opts.get("inf_grad_at"):
            self.model.blocks[0].attn.proj.register_forward_pre_hook(self._poison_weight_grad)

    def _poison_weight_grad(self, linear, args):
        fault = self.opts["inf_grad_at"]
        if self.global_step != fault["step"] or fault.get("rank", self.global_rank) != (
            self.global_rank
        ):
            return

        def poison(grad):
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
            return grad

        hook = linear.weight.register_hook(poison)
        self._poison_hooks = [*getattr(self, "_poison_hooks", []), hook]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        for hook in getattr(self, "_poison_hooks", []):  # one step's backward only
            hook.remove()
        self._poison_hooks = []
        if self.opts.get("compile"):  # the same value, read outside the step torch.compile traces
            self.losses.append(float(self.trainer.callback_metrics["loss"]))

    def training_step(self, batch, batch_idx):
        if self.opts.get("fail_rank") == self.global_rank and self.global_step == 3:
            raise RuntimeError(f"deliberate failure on rank {self.global_rank}")
        loss = self._loss(batch)
        nan_at = self.opts.get("nan_at")
        if (
            nan_at
            and self.global_step == nan_at["step"]
            and nan_at.get("rank", self.global_rank) == self.global_rank
        ):
            loss = loss * float("nan")
        stall = self.opts.get("stall_at")
        if (
            stall
            and self.global_step == stall["step"]
            and stall.get("rank", self.global_rank) == self.global_rank
        ):
            time.sleep(stall["seconds"])
        sig = self.opts.get("sigterm_at")
        if sig and self.global_step == sig["step"] and sig.get("rank", 0) == self.global_rank:
            os.kill(os.getpid(), getattr(signal, sig.get("signal", "SIGTERM")))
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        if not self.opts.get("compile"):
            self.losses.append(float(self.trainer.callback_metrics["loss"]))
        if self.opts.get(
            "manual"
        ):  # the same update as the automatic loop, done by hand (each optimizer)
            opts = self.optimizers()
            opts = opts if isinstance(opts, list) else [opts]
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in opts:
                self.clip_gradients(
                    opt, gradient_clip_val=self.opts.get("manual_clip")
                )  # None: no clipping
                opt.step()
        return loss

    def configure_deepspeed(self, config: dict) -> dict:
        for key, value in self.opts.get(
            "ds_hook", {}
        ).items():  # one level deep is enough for the tests
            config[key] = (
                {**config[key], **value} if isinstance(value, dict) and key in config else value
            )
        return config

    def configure_optimizers(self):
        if self.opts.get("duck_optimizer"):
            return DuckSGD(self.parameters())
        if self.opts.get(
            "fused"
        ):  # torch's fused AdamW (CPU too): the guard then decides on the device
            groups = [
                {k: v for k, v in g.items() if k not in ("fused", "foreach")}
                for g in super().configure_optimizers().param_groups
            ]
            return torch.optim.AdamW(groups, fused=True)
        if not self.opts.get("two_optimizers"):
            return super().configure_optimizers()
        # Momentum gives both optimizers state, so a resume that lost either one would change the
        # losses.
        return [
            torch.optim.SGD(self.model.blocks.parameters(), lr=0.1, momentum=0.9),
            torch.optim.SGD(self.model.wte.parameters(), lr=0.1, momentum=0.9),
        ]


class DuckSGD:
    """Has step / zero_grad / param_groups but is not a torch.optim.Optimizer."""

    def __init__(self, params):
        self.inner = torch.optim.SGD(params, lr=0.1)
        self.param_groups = self.inner.param_groups

    def step(self):
        self.inner.step()

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none)


class RankSampler:
    """A user's sampler with 6 + rank batches: rank counts differ (read lazily: ranks start inside
    fit)."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    def __len__(self) -> int:
        import torch.distributed as dist

        return (6 + dist.get_rank()) * self.batch_size

    def __iter__(self):
        return iter(range(len(self)))


def _classes(names):
    import lightspeed.demos.gpt as gpt

    return [getattr(gpt, n, None) or getattr(torch.nn, n) for n in names]


def _counting_allreduce(state: dict, bucket):
    """A DDP comm hook: torch's plain all-reduce, noting which micro-batch's backward called it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state["calls"].append(len(state["module"].losses))
    return default_hooks.allreduce_hook(None, bucket)


def _strategy(opts: dict, module=None):
    if opts.get("ddp_comm_hook") == "count":
        return ls.DDP(comm_hook=({"calls": [], "module": module}, _counting_allreduce))
    if opts.get("ddp_comm_hook"):
        return ls.DDP(comm_hook=opts["ddp_comm_hook"])
    if opts.get("fsdp") is not None:
        from lightspeed.strategies.fsdp import FSDP

        kw = dict(opts["fsdp"])
        for key in ("shard_classes", "activation_checkpointing"):
            if kw.get(key):
                kw[key] = _classes(kw[key])
        return FSDP(**kw)
    if not opts.get("ds"):
        return opts.get("strategy", "auto")
    from lightspeed.demos.gpt import Block

    kw = dict(opts["ds"])
    if kw.pop("ac", False):
        kw["activation_checkpointing"] = [Block]
    return ls.DeepSpeed(**kw)


def _deepspeed_facts(strategy) -> dict:
    """Engine facts for the DeepSpeed tests: config, optimizer class, each rank's share of the
    parameters."""
    import torch.distributed as dist

    engine = strategy.engine
    local = sum(getattr(p, "ds_tensor", p).numel() for p in engine.module.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, local)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return {
        "config": engine.config,
        "optimizer": type(inner).__name__,
        "optimizers": len(strategy.optimizers),
        "global_steps": engine.global_steps,
        "local_params": shares,
        "total_params": total,
        "lr": [g["lr"] for g in inner.param_groups] if strategy.optimizers else None,
    }


def _probe(trainer, module, data, path: str) -> None:
    x = torch.stack([data[i][0] for i in range(4)])
    module.eval()
    with torch.no_grad():
        logits = trainer.strategy.forward(lambda inp: module(inp), x)
    if trainer.is_global_zero:
        torch.save({"x": x, "logits": logits}, path)


def main(opts: dict) -> None:
    ls.seed_everything(opts.get("seed", 0))
    data = ByteWindows(stdlib_corpus(60_000), SIZES["tiny"].block_size)
    bs = opts.get("batch_size", 8)
    train = DataLoader(data, batch_size=bs, shuffle=opts.get("shuffle", False))
    if opts.get("uneven"):
        train = DataLoader(data, batch_size=bs, sampler=RankSampler(bs))
    val = DataLoader(data, batch_size=bs)
    module = Workload(opts)
    callbacks = []
    if opts.get("ckpt_every"):
        callbacks.append(ls.ModelCheckpoint(every_n_train_steps=opts["ckpt_every"], save_top_k=-1))
    trainer = ls.Trainer(
        strategy=_strategy(opts, module),
        devices=opts.get("devices", 1),
        num_nodes=opts.get("num_nodes", 1),
        max_steps=opts.get("max_steps", -1),
        max_epochs=opts.get("max_epochs"),
        accumulate_grad_batches=opts.get("accumulate", 1),
        gradient_clip_val=opts.get("clip"),
        gradient_clip_algorithm=opts.get("clip_algo", "norm"),
        precision=opts.get("precision", "32-true"),
        default_root_dir=opts.get("root", "."),
        limit_train_batches=opts.get("limit_train_batches"),
        limit_val_batches=4,
        limit_test_batches=4,
        limit_predict_batches=opts.get("limit_predict_batches"),
        seed=opts.get("seed", 0),
        enable_progress_bar=bool(opts.get("progress")),
        enable_checkpointing=bool(opts.get("ckpt_every") or opts.get("checkpointing")),
        callbacks=callbacks,
        logger=False,
        accelerator=opts.get("accelerator", "cpu"),
        memory_budget=opts.get("memory_budget"),
        on_nonfinite=opts.get("on_nonfinite", "stop"),
        timeout=opts.get("collective_timeout", 600),
        optimizer_kernels=opts.get("optimizer_kernels", "fused"),
        compile=opts.get("compile", False),
        # Lightning's SLURM plugin: requeue (or not) after a preemption
        plugins=[SLURMEnvironment(opts["auto_requeue"])] if "auto_requeue" in opts else None,
    )
    result: dict = {"world_size": trainer.world_size}
    if opts.get("fit", True):
        try:
            trainer.fit(
                module, train, val if opts.get("val") else None, ckpt_path=opts.get("resume")
            )
        except SystemExit as e:  # preempted: record what ran, then exit as the Trainer asked
            if trainer.is_global_zero:
                with open(opts["out"], "w") as f:
                    json.dump(
                        {
                            "losses": module.losses,
                            "global_step": trainer.global_step,
                            "exit": e.code,
                        },
                        f,
                    )
            raise
        result["skipped_steps"] = trainer.guard.skipped_steps
        result["finite_weights"] = all(
            bool(torch.isfinite(getattr(p, "to_local", lambda: p)()).all())
            for p in module.parameters()
        )
    else:
        result["validate"] = trainer.validate(module, val, ckpt_path=opts.get("resume"))
    if opts.get(
        "compile"
    ):  # kernels.CompiledStep: None while the step runs compiled, else why it stopped
        result["step_fallback"] = trainer._run.training_step.failed
    result.update(
        losses=list(module.losses),
        global_step=trainer.global_step,
        epoch=trainer.current_epoch,
        strategy=trainer.strategy.name,
    )
    if opts.get("validate"):
        result["validate"] = trainer.validate(module, val)
    if opts.get("test"):
        result["test"] = trainer.test(module, val)
    if opts.get("predict"):
        preds = trainer.predict(module, DataLoader(data, batch_size=bs))
        result["predict_batches"] = len(preds)
    if opts.get("save_to"):
        trainer.save_checkpoint(opts["save_to"])
        if trainer.is_global_zero and opts.get("consolidate"):
            ls.consolidate(opts["save_to"], opts["consolidate"])
    if opts.get("probe"):
        _probe(trainer, module, data, opts["probe"])
    if opts.get("memory"):
        import torch.distributed as dist

        from lightspeed.runtime.memory import measure

        # One more forward/backward, no step: gradients exist only between backward and the step's
        # zero_grad.
        # (Its training_step appends a loss to module.losses; result["losses"] is the fit's, copied
        # above.)
        module.train()
        trainer.strategy.backward(
            trainer.strategy.forward(module.training_step, next(iter(train)), 0, sync_grads=True)
        )
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, measure(trainer.strategy))
        result["memory"] = per_rank
    if opts.get("fsdp") is not None:  # the offload policy FSDP2 applied to the root's parameters
        group = trainer.strategy.module._get_fsdp_state()._fsdp_param_group
        result["fsdp_offload_policy"] = type(group.offload_policy).__name__
    if opts.get("ddp_comm_hook") == "count":
        result["comm_hook_calls"] = trainer.strategy.comm_hook[0]["calls"]
    if getattr(trainer.strategy, "engine", None) is not None:
        result["deepspeed"] = _deepspeed_facts(trainer.strategy)
    if trainer.is_global_zero:
        with open(opts["out"], "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    # The deepspeed launcher appends --local_rank=N to the script's arguments; the options are the
    # other one. {"jobs": [options, ...]}: several runs, one after another, in the same ranks.
    given = json.loads(next(a for a in sys.argv[1:] if not a.startswith("--local_rank")))
    for i, job in enumerate(given.get("jobs", [given])):
        if "jobs" in given and int(os.environ.get("RANK", "0")) == 0:
            print(f"[workload job {i}]", flush=True)  # where the job's output starts (rank 0's)
        main(job)
