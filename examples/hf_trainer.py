"""transformers.Trainer on meshzero: the one-line switch, on a tiny GPT-2 and fixed data.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --out runs/hf            # ZeRO-3
    torchrun --nproc-per-node 2 examples/hf_trainer.py --out runs/hf --stage 2 --offload cpu
    python examples/hf_trainer.py --out runs/plain --plain --per-device 4     # plain Trainer

Rank 0 writes ``OUT/losses.json`` (the Trainer's log history: step, loss, grad_norm,
learning_rate); the trained model goes to ``OUT/final`` (``save_model``: load it with
``GPT2LMHeadModel.from_pretrained``). ``--save-steps N`` writes ``OUT/checkpoint-N`` folders;
``--resume DIR`` continues from one, at any world size (keep the global batch: per-device
batch x ranks x accumulation).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from meshzero.hf import MeshzeroTrainer

VOCAB, SEQ, SAMPLES = 64, 16, 32


def tiny_gpt2() -> GPT2LMHeadModel:
    """Two layers, 32 wide, no dropout (so every world size computes the same thing)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(config)


def fixed_data() -> list[dict[str, torch.Tensor]]:
    """SAMPLES sequences of SEQ tokens: a repeating pattern the model can learn, plus noise."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(SAMPLES):
        ids = (torch.arange(SEQ) * (1 + i % 3) + i) % VOCAB
        noise = torch.randint(0, VOCAB, (SEQ,), generator=g)
        ids = torch.where(torch.rand(SEQ, generator=g) < 0.2, noise, ids)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def ds_config(stage: int, offload: str, sp: int = 1) -> dict:
    """A DeepSpeed-style config with "auto" values the Trainer fills from its arguments."""
    zero: dict = {"stage": stage}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload}
    return {
        "sequence_parallel_size": sp,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--offload", default="none", choices=["none", "cpu"],
                   help="offload_optimizer device")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps (max_steps)")
    p.add_argument("--per-device", type=int, default=2, help="per_device_train_batch_size")
    p.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--save-steps", type=int, default=0, help="save checkpoint-N every N steps")
    p.add_argument("--resume", default=None, help="a checkpoint-N folder to resume from")
    p.add_argument("--sp", type=int, default=1,
                   help="sequence_parallel_size (Ulysses; docs/long-sequences.md)")
    p.add_argument("--plain", action="store_true", help="the plain transformers.Trainer")
    return p.parse_args()


def main() -> None:
    cli = parse_args()
    args = TrainingArguments(
        output_dir=cli.out, max_steps=cli.steps, per_device_train_batch_size=cli.per_device,
        gradient_accumulation_steps=cli.accum, learning_rate=3e-3, warmup_steps=2,
        max_grad_norm=1.0, weight_decay=0.01, logging_steps=1, report_to=[], seed=0,
        save_strategy="steps" if cli.save_steps else "no", save_steps=cli.save_steps or 500,
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    common = {"model": tiny_gpt2(), "args": args, "train_dataset": fixed_data(),
              "eval_dataset": fixed_data()[:8]}
    if cli.plain:
        trainer = Trainer(**common)
    else:
        trainer = MeshzeroTrainer(**common, meshzero_config=ds_config(cli.stage, cli.offload,
                                                                     cli.sp))
    trainer.train(resume_from_checkpoint=cli.resume)
    metrics = trainer.evaluate()
    trainer.save_model(os.path.join(cli.out, "final"))
    if trainer.is_world_process_zero():
        logs = [{k: e[k] for k in ("step", "loss", "grad_norm", "learning_rate")}
                for e in trainer.state.log_history if "loss" in e]
        with open(os.path.join(cli.out, "losses.json"), "w") as f:
            json.dump({"train": logs, "eval_loss": metrics["eval_loss"]}, f, indent=1)
        for e in logs:
            print(f"step {e['step']}  loss {e['loss']:.6f}  grad_norm {e['grad_norm']:.6f}  "
                  f"lr {e['learning_rate']:.3e}")
        print(f"eval_loss {metrics['eval_loss']:.6f}")


if __name__ == "__main__":
    main()
