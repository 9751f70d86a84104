"""A Hugging Face model trained as Lightning users write it: `python tests/hf_script.py '<json
options>'`.

Options: model ("gpt2": tied head; "llama": RMSNorm, rotary, untied; "bert": masked LM, embeddings
with a padding_idx), strategy, devices, out (JSON
for rank 0), steps, export (a folder: rank 0 writes the consolidated weights there as
model.safetensors + config.json, the layout `from_pretrained` reads); jobs (a list of these: each in
turn, in the same ranks). The model is built in configure_model, from a config: nothing is
downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls
from lightspeed.checkpoint.io import save_weights

VOCAB, SEQ = 64, 16


def hf_config(kind: str):
    if kind == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            n_layer=2,
            n_head=2,
            n_embd=32,
            vocab_size=VOCAB,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    if kind == "bert":  # its embeddings have a padding_idx (transformers' init indexes it)
        from transformers import BertConfig

        return BertConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )


class CausalLM(ls.LightningModule):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def configure_model(self):
        from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

        auto = AutoModelForMaskedLM if self.kind == "bert" else AutoModelForCausalLM
        self.model = auto.from_config(hf_config(self.kind))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("loss", loss, sync_dist=True)  # the global mean, comparable across world sizes
        self.losses.append(float(self.trainer.callback_metrics["loss"]))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(opts: dict) -> None:
    ls.seed_everything(0)
    devices = opts.get("devices", 2)
    ids = torch.randint(0, VOCAB, (64, SEQ), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(ids), batch_size=8 // devices)
    module = CausalLM(opts["model"])
    module.losses = []
    trainer = ls.Trainer(
        strategy=opts["strategy"],
        devices=devices,
        accelerator="cpu",
        max_steps=opts.get("steps", 6),
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        seed=0,
        default_root_dir=opts["root"],
    )
    trainer.fit(module, data)
    ckpt = trainer.save_checkpoint(Path(opts["root"]) / "final")
    if not trainer.is_global_zero:
        return
    if opts.get("export"):
        out = Path(opts["export"])
        out.mkdir(parents=True, exist_ok=True)
        state = ls.full_state_dict(ckpt)
        save_weights(
            {k.removeprefix("model."): v for k, v in state.items()}, out / "model.safetensors"
        )
        hf_config(opts["model"]).save_pretrained(out)
    Path(opts["out"]).write_text(json.dumps({"losses": module.losses}))


if __name__ == "__main__":
    given = json.loads(sys.argv[1])
    for job in given.get("jobs", [given]):  # several fits, one after another, in the same ranks
        main(job)
