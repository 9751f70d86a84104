"""Hugging Face models as users build them, under every strategy on 2 CPU ranks, against one device.

    PYTHONPATH=src .venv/bin/python benchmarks/hf_families_cpu.py [--families bert,t5] [--strategies ddp,fsdp]

Nine families built from tiny configs (nothing downloaded) in the LightningModule's `__init__`:
BERT (masked LM), T5, BART, ViT, Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-NeoX, Phi. `training_step(self,
batch, batch_nb)` returns `self.model(**batch).loss`; `torch.optim.AdamW`; fp32, dropout 0; 4 steps at
a global batch of 8 (one device: 8; two ranks: 4 each). Each (family, strategy) runs in its own
process; the table gives the largest relative difference of the per-step loss (the mean over ranks)
from the one-device run, or the run's first error line. About 15 minutes on a 2-core machine.
Two more variants by name: `mixtral_aux` (the router's auxiliary loss on: it is taken over each
rank's tokens, so it differs from one device's by design) and `bert_auto` (AutoModelForMaskedLM).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import lightspeed as ls

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ["bert", "t5", "bart", "vit", "mixtral", "qwen2moe", "qwen3moe", "gptneox", "phi"]
STRATEGIES = ["ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"]


VOCAB, SEQ, N = 64, 16, 32


def config(family: str):
    import transformers as t

    if family == "bert":
        return t.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    if family == "t5":
        return t.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1,
        )
    if family == "bart":
        return t.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=SEQ + 2, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
            decoder_layerdrop=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
            decoder_start_token_id=2, forced_eos_token_id=None,
        )
    if family == "vit":
        return t.ViTConfig(
            image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, num_labels=10,
        )
    if family == "bert_auto":
        return config("bert")
    if family == "mixtral_aux":
        cfg = config("mixtral")
        cfg.output_router_logits, cfg.router_aux_loss_coef = True, 0.02
        return cfg
    if family == "mixtral":
        return t.MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=SEQ, attention_dropout=0.0,
        )
    if family == "qwen2moe":
        return t.Qwen2MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=SEQ, decoder_sparse_step=1, attention_dropout=0.0,
        )
    if family == "qwen3moe":
        return t.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=SEQ,
            decoder_sparse_step=1, attention_dropout=0.0,
        )
    if family == "gptneox":
        return t.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=SEQ, rotary_pct=0.25,
            hidden_dropout=0.0, attention_dropout=0.0,
        )
    if family == "phi":
        return t.PhiConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attention_dropout=0.0,
        )
    raise ValueError(family)


def build(family: str):
    import transformers as t

    cfg = config(family)
    if family == "bert":
        return t.BertForMaskedLM(cfg)
    if family == "bert_auto":
        return t.AutoModelForMaskedLM.from_config(cfg)
    if family == "t5":
        return t.T5ForConditionalGeneration(cfg)
    if family == "bart":
        return t.BartForConditionalGeneration(cfg)
    if family == "vit":
        return t.ViTForImageClassification(cfg)
    if family in ("mixtral", "mixtral_aux"):
        return t.MixtralForCausalLM(cfg)
    return t.AutoModelForCausalLM.from_config(cfg)


class Samples(Dataset):
    """N fixed samples (dicts of tensors), made from a private generator: deterministic."""

    def __init__(self, family: str):
        g = torch.Generator().manual_seed(1234)
        self.items = []
        for _ in range(N):
            if family in ("bert", "bert_auto"):
                ids = torch.randint(5, VOCAB, (SEQ,), generator=g)
                pos = torch.randperm(SEQ, generator=g)[:4]  # 4 masked tokens in every row
                labels = torch.full((SEQ,), -100)
                labels[pos] = ids[pos]
                inp = ids.clone()
                inp[pos] = 4
                item = dict(input_ids=inp, attention_mask=torch.ones(SEQ, dtype=torch.long),
                            labels=labels)
            elif family in ("t5", "bart"):
                item = dict(
                    input_ids=torch.randint(3, VOCAB, (SEQ,), generator=g),
                    attention_mask=torch.ones(SEQ, dtype=torch.long),
                    labels=torch.randint(3, VOCAB, (8,), generator=g),
                )
            elif family == "vit":
                item = dict(
                    pixel_values=torch.randn(3, 16, 16, generator=g),
                    labels=torch.randint(0, 10, (), generator=g),
                )
            else:
                ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
                item = dict(input_ids=ids, attention_mask=torch.ones(SEQ, dtype=torch.long),
                            labels=ids.clone())
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class HFModule(ls.LightningModule):
    def __init__(self, family: str):
        super().__init__()
        self.model = build(family)  # in __init__, as users write it

    def training_step(self, batch, batch_nb):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Losses(ls.Callback):
    def __init__(self):
        self.local, self.glob = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        loss = loss.detach().float().reshape(()).clone()
        self.local.append(loss.item())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.glob.append(loss.item())


def trainer(opts, steps, cb):
    return ls.Trainer(
        strategy=opts["strategy"], devices=opts["devices"], accelerator="cpu", max_steps=steps,
        precision="32-true", logger=False, enable_progress_bar=False, enable_checkpointing=False,
        callbacks=[cb], default_root_dir=opts["root"],
    )


def train(opts: dict) -> None:
    """One run; rank 0 writes the per-step losses to opts["out"]."""
    ls.seed_everything(0)
    devices = opts["devices"]
    data = DataLoader(Samples(opts["family"]), batch_size=8 // devices, shuffle=False)
    losses = Losses()
    tr = trainer(opts, 4, losses)
    tr.fit(HFModule(opts["family"]), data)
    if tr.is_global_zero:
        Path(opts["out"]).write_text(json.dumps({"global": losses.glob}))


def run(family: str, strategy: str, tmp: Path) -> list[float] | str:
    """The run's per-step losses, or its first error line."""
    devices = 1 if strategy == "single" else 2
    out = tmp / f"{family}-{strategy}.json"
    opts = dict(family=family, strategy="auto" if devices == 1 else strategy, devices=devices,
                out=str(out), root=str(tmp / f"{family}-{strategy}"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, __file__, "--run", json.dumps(opts)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 0 and out.exists():
        return json.loads(out.read_text())["global"]
    errors = [line for line in done.stderr.splitlines() if re.match(r"^\w[\w.]*(Error|Exception)\b", line)]
    return (errors[-1] if errors else f"exit {done.returncode}")[:120]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        return train(json.loads(args.run))
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"hf_families_cpu.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    strategies = args.strategies.split(",")
    print("| family | " + " | ".join(strategies) + " |")
    print("|---|" + "---|" * len(strategies))
    began = time.perf_counter()
    for family in args.families.split(","):
        reference = run(family, "single", tmp)
        cells = []
        for strategy in strategies:
            got = run(family, strategy, tmp) if not isinstance(reference, str) else "no reference"
            if isinstance(got, str) or isinstance(reference, str):
                cells.append(f"error: {got if isinstance(got, str) else reference}")
            else:
                diff = max(abs(a - b) / abs(b) for a, b in zip(got, reference))
                cells.append(f"{diff:.1e}" if len(got) == len(reference) else "step count differs")
        print(f"| {family} | " + " | ".join(cells) + " |", flush=True)
    print(f"({time.perf_counter() - began:.0f} s; relative difference of the mean loss per step)")


if __name__ == "__main__":
    main()
