"""TRL's trainers (SFT, DPO, KTO, GRPO) and PEFT LoRA on meshzero, on a tiny Llama built from a
config and a word-level tokenizer made here (nothing downloaded).

    torchrun --nproc-per-node 2 examples/trl_trainers.py --out runs/trl --cases sft-lora,dpo
    python examples/trl_trainers.py --out runs/plain --plain --per-device 4 --cases sft-lora,dpo

``--cases`` runs each case in turn (``CASE`` or ``CASE:STAGE``): ``sft``, ``sft-lora``,
``dpo``, ``dpo-lora``, ``kto``, ``grpo``, ``trainer-lora`` (the plain ``transformers.Trainer``
with LoRA). Each writes ``OUT/CASE/losses.json`` (the log history, plus what meshzero sharded)
and ``OUT/CASE/final`` (``save_model``: the adapter with LoRA, else the full model). The
meshzero class is ``meshzero.hf.on_meshzero(<the TRL class>)``; ``--plain`` runs the TRL
class itself (DDP under torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from datasets import Dataset

VOCAB_WORDS, SEQ = 60, 8


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Words ``w0`` ... ``w59`` split on whitespace, plus pad/eos/bos/unk (64 ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>"])}
    vocab.update({f"w{i}": i + 4 for i in range(VOCAB_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
        unk_token="<unk>")


def tiny_llama() -> transformers.PreTrainedModel:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB_WORDS + 4, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1, bos_token_id=2))


def base_model(root: Path) -> str:
    """The tiny Llama saved under ``root`` (one copy per process), as a model path."""
    path = root / f"base-{os.environ.get('RANK', '0')}"
    if not (path / "config.json").is_file():
        tiny_llama().save_pretrained(path, is_main_process=True)
    return str(path)


def _words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB_WORDS, (n,), generator=g))


def dataset(kind: str, rows: int) -> Dataset:
    g = torch.Generator().manual_seed(1)
    if kind == "sft":
        return Dataset.from_list([{"text": _words(g, SEQ)} for _ in range(rows)])
    if kind == "dpo":
        return Dataset.from_list([{"prompt": _words(g, 4), "chosen": " " + _words(g, 4),
                                   "rejected": " " + _words(g, 4)} for _ in range(rows)])
    if kind == "kto":
        return Dataset.from_list([{"prompt": _words(g, 4), "completion": " " + _words(g, 4),
                                   "label": bool(i % 2)} for i in range(rows)])
    return Dataset.from_list([{"prompt": _words(g, 4)} for _ in range(rows)])  # grpo


def reward_len(completions: list[str], **kwargs: Any) -> list[float]:
    """GRPO's reward: fewer words is better, and words from the upper half of the vocabulary."""
    return [sum(int(w[1:]) >= VOCAB_WORDS // 2 for w in c.split()) - 0.1 * len(c.split())
            for c in completions]


def lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def ds_config(stage: int, flag: str) -> dict:
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if flag != "none":
        zero["stage3_gather_16bit_weights_on_model_save"] = flag == "true"
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero}


def trainer_for(case: str, args: argparse.Namespace, out: Path) -> transformers.Trainer:
    import trl

    kind, lora = case.split("-")[0], case.endswith("-lora")
    common = dict(output_dir=str(out), max_steps=args.steps, learning_rate=1e-2,
                  per_device_train_batch_size=args.per_device, logging_steps=1, seed=0,
                  save_strategy="no", report_to=[], use_cpu=True, max_grad_norm=1.0,
                  lr_scheduler_type="constant", dataloader_drop_last=True,
                  bf16=False)  # TRL defaults bf16=True; the comparison is in fp32
    rows = args.steps * 4 * (2 if kind == "grpo" else 1)
    tok = tokenizer()
    extra: dict[str, Any] = {"peft_config": lora_config()} if lora else {}
    if kind == "trainer":
        import peft

        ids = [tok(r["text"])["input_ids"] for r in dataset("sft", rows)]
        data = [{"input_ids": torch.tensor(i), "labels": torch.tensor(i)} for i in ids]
        cls, targs = transformers.Trainer, transformers.TrainingArguments(**common)
        model = peft.get_peft_model(tiny_llama(), lora_config())
        kw: dict[str, Any] = dict(model=model, args=targs, train_dataset=data)
    elif kind == "sft":
        cls = trl.SFTTrainer
        kw = dict(args=trl.SFTConfig(**common, max_length=SEQ + 2), **extra)
    elif kind == "dpo":
        cls = trl.DPOTrainer
        kw = dict(args=trl.DPOConfig(**common, max_length=16), **extra)
    elif kind == "kto":
        cls = trl.KTOTrainer
        kw = dict(args=trl.KTOConfig(**common, max_length=16), **extra)
    elif kind == "grpo":
        cls = trl.GRPOTrainer
        kw = dict(args=trl.GRPOConfig(**common, num_generations=2, max_completion_length=6,
                                      beta=0.1, temperature=1.0),
                  reward_funcs=reward_len, **extra)
    else:
        raise ValueError(f"unknown case {case!r}")
    if kind != "trainer":  # a path: TRL builds its reference model (the implicit copy) from it
        kw.update(model=base_model(out.parent), train_dataset=dataset(kind, rows),
                  processing_class=tok)
    torch.manual_seed(0)  # LoRA's initial weights: the same in every run and process
    if args.plain:
        return cls(**kw)
    from meshzero.hf import on_meshzero

    return on_meshzero(cls)(**kw, meshzero_config=ds_config(args.stage_of[case], args.flag))


def run_case(case: str, args: argparse.Namespace) -> None:
    out = Path(args.out) / case
    trainer = trainer_for(case, args, out)
    trainer.train()
    trainer.save_model(str(out / "final"))
    info: dict[str, Any] = {"train": [e for e in trainer.state.log_history if "loss" in e]}
    if hasattr(trainer, "memory_report"):  # MeshzeroTrainer: bytes held per engine
        info["memory"] = {name: report["params"] for name, report
                          in trainer.memory_report().items()}
        info["frozen"] = {name: info["memory"][name] for name in trainer.frozen_engines}
        # the policy's full fp32 bytes (ds_numel: a stage-3 parameter's whole size)
        info["full_bytes"] = 4 * sum(getattr(p, "ds_numel", p.numel())
                                     for p in trainer.model.parameters())
        info["world"] = trainer.args.world_size
    else:
        info["frozen"] = {}
    info["ref_model"] = type(getattr(trainer, "ref_model", None)).__name__
    if trainer.args.process_index == 0:
        (out / "losses.json").write_text(json.dumps(info, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default="sft-lora,dpo")
    p.add_argument("--stage", type=int, default=3, help="stage of cases without ':STAGE'")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--per-device", type=int, default=2)
    p.add_argument("--flag", default="none", choices=["none", "true", "false"],
                   help="stage3_gather_16bit_weights_on_model_save")
    p.add_argument("--plain", action="store_true", help="the TRL class without meshzero")
    args = p.parse_args()
    torch.set_num_threads(1)
    args.stage_of = {}
    cases = []
    for spec in args.cases.split(","):
        case, _, stage = spec.partition(":")
        args.stage_of[case] = int(stage) if stage else args.stage
        cases.append(case)
    base_model(Path(args.out))  # before the process group exists: every rank saves its copy
    for case in cases:
        run_case(case, args)


if __name__ == "__main__":
    main()
