"""Convergence of the 1-bit family against Adam on the demo GPT (ZeRO stage 0, the stage
the 1-bit optimizers run at): the same seed, data and learning rate, the loss averaged over
the last 20 steps.

    torchrun --nproc-per-node 4 benchmarks/onebit_convergence.py [--steps 300]

Prints, on rank 0, the loss every 50 steps and the final loss of each optimizer and its
ratio to Adam's. "Adam-nobc" is Adam without bias correction, the arithmetic the 1-bit
optimizers' warm-up uses (DeepSpeed's never correct).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import meshzero
from meshzero.demo.data import global_batch, load_corpus, rank_micro_batch
from meshzero.demo.gpt import GPT, GPTConfig, loss_fn

GPT_SIZE = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)
BATCH = 16


def run(kind: str, params: dict, steps: int, corpus: torch.Tensor) -> list[float]:
    torch.manual_seed(0)
    engine, _, _, _ = meshzero.initialize(model=GPT(GPT_SIZE), config={
        "train_batch_size": BATCH, "zero_optimization": {"stage": 0},
        "optimizer": {"type": kind, "params": {"lr": 1e-3, **params}}})
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        x, y = global_batch(corpus, step, BATCH, GPT_SIZE.block_size)
        x, y = rank_micro_batch(x, y, rank, BATCH // world, 1, 0)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    engine.close()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--freeze", type=int, default=None,
                        help="warm-up steps (freeze_step, var_freeze_step); default steps / 10")
    args = parser.parse_args()
    corpus = load_corpus(500_000)
    freeze = args.freeze if args.freeze is not None else args.steps // 10
    runs = {"Adam": ("Adam", {}),
            "Adam-nobc": ("Adam", {"bias_correction": False}),
            "OneBitAdam": ("OneBitAdam", {"freeze_step": freeze}),
            "ZeroOneAdam": ("ZeroOneAdam", {"var_freeze_step": freeze,
                                            "var_update_scaler": 4,
                                            "local_step_scaler": 50, "local_step_clipper": 4}),
            "OneBitLamb": ("OneBitLamb", {"freeze_step": freeze, "lr": 2e-3})}
    curves = {name: run(kind, params, args.steps, corpus)
              for name, (kind, params) in runs.items()}
    if dist.get_rank() == 0:
        print(f"W={dist.get_world_size()}, {args.steps} steps, warm-up {freeze} steps")
        print("step " + "".join(f"{name:>13s}" for name in curves))
        for step in range(0, args.steps, 50):
            print(f"{step:4d} " + "".join(f"{c[step]:13.4f}" for c in curves.values()))
        final = {name: sum(c[-20:]) / 20 for name, c in curves.items()}
        for name, value in final.items():
            print(f"final (mean of last 20) {name:12s} {value:.4f}  "
                  f"ratio to Adam {value / final['Adam']:.4f}")


if __name__ == "__main__":
    main()
