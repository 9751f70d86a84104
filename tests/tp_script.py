"""Tensor-parallel runs for tests/test_tensor_parallel.py and tests/test_deepspeed_tp.py:
`python tests/tp_script.py '<json>'`.

Options: model ("gpt": lightspeed's GPT, fused qkv and tied head; "llama": HF Llama, GQA, rotary,
its own tp_plan; "gpt2": HF GPT-2, Conv1D, fused c_attn, no tp_plan), kv_heads (llama), hook (the
GPT's MLPs split by hand in configure_tensor_parallel, attention left whole), strategy (a name, or
{"tp": 2, ...}: FSDP(**it); {"deepspeed": {...}}: DeepSpeed(**it)), devices ("auto" under torchrun),
accelerator ("cpu" unless given), precision ("32-true" unless given), batch (per data-parallel
rank), steps, accumulate, clip, root, out (rank 0's JSON), ckpt_every (a checkpoint every k steps in
root/ckpt, named step=k), resume (a checkpoint directory), save_to (a directory: the final
checkpoint), consolidate (a path: rank 0 writes save_to's safetensors file there), validate (a
checkpoint: `trainer.validate` from it on the data, instead of fit); jobs (a list of these: each in
turn, in the same ranks). The model is built in configure_model from a config: nothing is
downloaded. The result holds the per-step global-mean losses, and per rank the bytes of the
parameters (`strategy.measure()`), of the parameters tensor parallelism split as DTensors (local,
and whole), each parameter's local elements by name, and the bytes of the tensors the first forward
saved for the backward.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls

VOCAB, SEQ = 64, 16


def build(kind: str, kv_heads: int = 2) -> torch.nn.Module:
    if kind == "gpt":
        from lightspeed.demos.gpt import GPT, GPTConfig

        return GPT(GPTConfig(VOCAB, SEQ, n_layer=2, n_head=4, n_embd=32, bias=False))
    if kind == "gpt2":
        from transformers import AutoModelForCausalLM, GPT2Config

        drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        config = GPT2Config(
            n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=SEQ, **drop
        )
        return AutoModelForCausalLM.from_config(config)
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config)


class CausalLM(ls.LightningModule):
    def __init__(self, kind: str, kv_heads: int = 2):
        super().__init__()
        self.kind, self.kv_heads = kind, kv_heads
        self.losses: list[float] = []
        self.activation_bytes: int | None = None

    def configure_model(self):
        self.model = build(self.kind, self.kv_heads)

    def _loss(self, ids):
        if self.kind != "gpt":
            return self.model(input_ids=ids, labels=ids).loss
        logits = self.model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
        )

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        if self.activation_bytes is None:
            saved: dict[tuple, int] = {}

            def pack(t):
                local = t.to_local() if hasattr(t, "to_local") else t
                if local.device.type != "meta" and local.numel():
                    try:  # one storage saved twice counts once
                        key = (local.data_ptr(), local.numel())
                    except RuntimeError:  # a tensor without storage of its own
                        key = (id(local), local.numel())
                    saved[key] = local.numel() * local.element_size()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = self._loss(ids)
            params = {
                p.to_local().data_ptr() if hasattr(p, "to_local") else p.data_ptr()
                for p in self.parameters()
            }
            self.activation_bytes = sum(n for k, n in saved.items() if k[0] not in params)
        else:
            loss = self._loss(ids)
        self.log("loss", loss, sync_dist=True)  # the global mean, comparable across world sizes
        self.losses.append(float(self.trainer.callback_metrics["loss"]))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Validating(CausalLM):
    """For `validate` runs only (a fit with a validation_step and no val loader warns)."""

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        self.log("val_loss", self._loss(ids), sync_dist=True)


class ByHand(CausalLM):
    """The user's own plan, as Lightning's ModelParallelStrategy users write it."""

    def configure_tensor_parallel(self, mesh):
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {"blocks.*.mlp.0": ColwiseParallel(), "blocks.*.mlp.2": RowwiseParallel()}
        parallelize_module(self.model, mesh, plan)


def local_numels(module: torch.nn.Module) -> dict[str, int]:
    """Each parameter's elements on this rank, by name (DeepSpeed's AutoTP cuts plain tensors;
    a DTensor counts its local shard)."""
    return {
        name: (p.to_local() if hasattr(p, "to_local") else p).numel()
        for name, p in module.named_parameters()
    }


def split_bytes(module: torch.nn.Module) -> dict[str, int]:
    """This rank's bytes of the parameters tensor parallelism split (a Shard placement on the
    mesh's "tp" dimension), those parameters' whole bytes, and every parameter's whole bytes."""
    out = {"split_local": 0, "split_whole": 0, "all_whole": 0}
    for p in module.parameters():
        whole = p.numel() * p.element_size()
        out["all_whole"] += whole
        mesh = getattr(p, "device_mesh", None)
        if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
            continue
        tp_dim = mesh.mesh_dim_names.index("tp")
        if p.placements[tp_dim].is_shard():
            out["split_local"] += p.to_local().numel() * p.element_size()
            out["split_whole"] += whole
    return out


def main(opts: dict) -> None:
    ls.seed_everything(0)
    ids = torch.randint(0, VOCAB, (256, SEQ), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(ids), batch_size=opts.get("batch", 4))
    kind = ByHand if opts.get("hook") else Validating if opts.get("validate") else CausalLM
    module = kind(opts["model"], opts.get("kv_heads", 2))
    strategy = opts.get("strategy", "single")
    if isinstance(strategy, dict) and "deepspeed" in strategy:
        strategy = ls.DeepSpeed(**strategy["deepspeed"])
    elif isinstance(strategy, dict):
        from lightspeed.strategies.fsdp import FSDP

        strategy = FSDP(**strategy)
    trainer = ls.Trainer(
        strategy=strategy,
        devices=opts.get("devices", 1),
        accelerator=opts.get("accelerator", "cpu"),
        max_steps=opts.get("steps", 6),
        accumulate_grad_batches=opts.get("accumulate", 1),
        gradient_clip_val=opts.get("clip"),
        precision=opts.get("precision", "32-true"),
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=bool(opts.get("ckpt_every")),
        callbacks=[
            ls.ModelCheckpoint(
                dirpath=Path(opts["root"]) / "ckpt",
                filename="{step}",
                every_n_train_steps=opts["ckpt_every"],
                save_top_k=-1,
            )
        ]
        if opts.get("ckpt_every")
        else None,
        enable_model_summary=False,
        seed=0,
        default_root_dir=opts["root"],
    )
    if opts.get("validate"):  # only validate, from that checkpoint: rank 0 writes {"val_loss": ...}
        results = trainer.validate(module, data, ckpt_path=opts["validate"])
        if trainer.is_global_zero:
            Path(opts["out"]).write_text(json.dumps(results[0]))
        return
    trainer.fit(module, data, ckpt_path=opts.get("resume"))
    facts = {
        "measure": trainer.strategy.measure(),
        "activations": module.activation_bytes,
        **split_bytes(module),
        "numels": local_numels(module),
    }
    per_rank = [facts]
    if dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, facts)
    if opts.get("save_to"):
        trainer.save_checkpoint(opts["save_to"])
        if trainer.is_global_zero and opts.get("consolidate"):
            ls.consolidate(opts["save_to"], opts["consolidate"])
    if trainer.is_global_zero:
        result = {"losses": module.losses, "ranks": per_rank, "strategy": trainer.strategy.name}
        Path(opts["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    given = json.loads(sys.argv[1])
    for i, job in enumerate(given.get("jobs", [given])):  # several runs, in the same ranks
        if int(os.environ.get("RANK", "0")) == 0:  # where the job's output starts (rank 0's)
            print(f"[tp_script job {i}]", flush=True)
        main(job)
