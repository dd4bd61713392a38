"""A short torchrun job that ends as a training script ends, for the clean-exit tests.

    torchrun --standalone --nproc-per-node 2 tests/exit_job.py --variant zero3 --out DIR

Variants: ``zero3`` (4 ZeRO-3 steps and a checkpoint), ``cpu`` (+ optimizer and parameters
in host memory), ``nvme`` (+ both in NVMe files under ``--out``), ``tp`` (tensor parallel
2 x data parallel), ``pp`` (a 2-stage pipeline), ``fail`` (rank 1 raises after two steps).
``--end`` picks how the script ends: ``destroy`` (``dist.destroy_process_group()``),
``close`` (``engine.close()`` then destroy), ``with`` (the engine as a context manager) or
``none`` (nothing: the interpreter's exit does it all).
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn

import meshzero

DIM, STEPS = 8, 4


class Block(nn.Module):
    fail = False  # set on the failing rank: raise inside forward, with gathers in flight

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, DIM) -> (B, DIM)
        if Block.fail:
            raise RuntimeError("exit_job: rank 1 fails on purpose at step 2")
        return x + self.fc2(torch.relu(self.fc1(x)))


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, DIM), Block(), Block(), nn.Linear(DIM, 2))


def config(variant: str, out: str, world: int) -> dict:
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if variant == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        zero["offload_param"] = {"device": "cpu"}
    if variant == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": out}
        zero["offload_param"] = {"device": "nvme", "nvme_path": out}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": zero, "seed": 0}
    dp = world
    if variant == "tp":
        cfg["tensor_parallel"] = {"size": 2, "plan": {"1.fc1": "colwise", "1.fc2": "rowwise",
                                                      "2.fc1": "colwise", "2.fc2": "rowwise"}}
        dp = world // 2
    if variant == "pp":
        cfg["pipeline_parallel"] = {"size": 2, "micro_batches": 2}
        cfg["gradient_accumulation_steps"] = 2
        zero["stage"] = 1
        dp = world // 2
    cfg["train_batch_size"] = 2 * cfg["gradient_accumulation_steps"] * dp
    return cfg


def train(engine, variant: str) -> None:
    gen = torch.Generator().manual_seed(engine.topology.dp_rank)
    for step in range(STEPS):
        Block.fail = variant == "fail" and step == 2 and dist.get_rank() == 1
        if variant == "pp":
            batches = [(torch.randn(2, 4, generator=gen), torch.randn(2, 2, generator=gen))
                       for _ in range(2)]
            engine.train_batch(iter(batches))
            continue
        x, y = torch.randn(2, 4, generator=gen), torch.randn(2, 2, generator=gen)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()


def gloo_threads() -> list[str]:
    """Names of this process's threads that gloo started (Linux /proc)."""
    task = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(task):
        return []
    names = []
    for tid in os.listdir(task):
        try:
            with open(os.path.join(task, tid, "comm")) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return [n for n in names if "gloo" in n]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default="zero3",
                        choices=["zero3", "cpu", "nvme", "tp", "pp", "fail"])
    parser.add_argument("--end", default="destroy", choices=["destroy", "close", "with", "none"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = {}
    if args.variant == "pp":
        extra = {"loss_fn": nn.functional.mse_loss, "example_inputs": torch.zeros(2, 4)}
    engine, *_ = meshzero.initialize(model=model(), config=config(args.variant, args.out, world),
                                     **extra)
    if args.end == "with":
        with engine:
            train(engine, args.variant)
            engine.save_checkpoint(os.path.join(args.out, "ckpt"))
    else:
        train(engine, args.variant)
        engine.save_checkpoint(os.path.join(args.out, "ckpt"))
    if args.end == "close":
        engine.close()
    if args.end in ("destroy", "close", "with"):
        dist.destroy_process_group()
    if args.end in ("close", "with") and args.variant in ("zero3", "cpu", "nvme", "pp"):
        # a closed engine holds no process group: the destroyed group is freed and gloo's
        # threads are joined now, not while the interpreter exits (docs/lifecycle.md)
        gc.collect()
        left = gloo_threads()
        if left:
            raise SystemExit(f"exit_job: gloo threads still running after close: {left}")
    if int(os.environ.get("RANK", "0")) == 0:  # the work is done; what follows is the exit
        print("exit_job: done", flush=True)


if __name__ == "__main__":
    main()
