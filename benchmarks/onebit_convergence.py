"""Convergence of the 1-bit family against Adam on the demo GPT (ZeRO stage 0, the stage
the 1-bit optimizers run at): the same seed, data and learning rate, the loss averaged over
the last 20 steps.

    torchrun --nproc-per-node 4 benchmarks/onebit_convergence.py [--steps 300]
        [--freeze N] [--runs Adam,OneBitAdam,...]

Prints, on rank 0, the loss every 50 steps and the final loss of each optimizer and its
ratio to Adam's. "Adam-nobc" is Adam without bias correction, the arithmetic the 1-bit
optimizers' warm-up uses (DeepSpeed's never correct); "OneBitAdam-nocomp" is OneBitAdam
with freeze_step = steps, i.e. the same optimizer never compressing.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.distributed as dist

import meshzero
import meshzero.optimizers.onebit as onebit_module
from meshzero.demo.data import global_batch, load_corpus, rank_micro_batch
from meshzero.demo.gpt import GPT, GPTConfig, loss_fn

GPT_SIZE = GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64)
BATCH = 16


PAIRS: list[tuple[float, float]] = []  # --error-norms: this step's (error^2, norm^2)
ERRORS: list[float] = []  # --error-norms: each step's relative error over its vectors


def record_compression_errors() -> None:
    """Wrap the 1-bit mean so every call also all-reduces the exact mean (extra traffic,
    measurement only) and records ||onebit - exact||^2 and ||exact||^2 for the step."""
    inner = onebit_module.one_bit_mean

    def measured(comm, errors, key, tensors):  # type: ignore[no-untyped-def]
        exact = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(exact)
        exact /= dist.get_world_size()
        inner(comm, errors, key, tensors)
        got = torch.cat([t.reshape(-1) for t in tensors])
        PAIRS.append(((got - exact).square().sum().item(), exact.square().sum().item()))

    onebit_module.one_bit_mean = measured


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
        if PAIRS:  # the step's relative error over all its compressed vectors
            err, norm = (sum(e[i] for e in PAIRS) for i in (0, 1))
            PAIRS.clear()
            ERRORS.append(math.sqrt(err / max(norm, 1e-30)))
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
    parser.add_argument("--curves", default=None, help="write every step's loss (JSON) here")
    parser.add_argument("--error-norms", action="store_true",
                        help="also print ||onebit_mean - exact mean|| / ||exact mean|| of the "
                        "compressed momenta (OneBitAdam; all-reduces the exact mean too)")
    parser.add_argument("--runs", default=None,
                        help="comma-separated subset of the runs (default: all)")
    args = parser.parse_args()
    corpus = load_corpus(500_000)
    freeze = args.freeze if args.freeze is not None else args.steps // 10
    runs = {"Adam": ("Adam", {}),
            "Adam-nobc": ("Adam", {"bias_correction": False}),
            "OneBitAdam-nocomp": ("OneBitAdam", {"freeze_step": args.steps}),
            "OneBitAdam": ("OneBitAdam", {"freeze_step": freeze}),
            "ZeroOneAdam": ("ZeroOneAdam", {"var_freeze_step": freeze,
                                            "var_update_scaler": 4,
                                            "local_step_scaler": 50, "local_step_clipper": 4}),
            "OneBitLamb": ("OneBitLamb", {"freeze_step": freeze, "lr": 2e-3})}
    if args.runs:
        runs = {name: runs[name] for name in args.runs.split(",")}
    if args.error_norms:
        record_compression_errors()
    curves, errors = {}, {}
    for name, (kind, params) in runs.items():
        curves[name] = run(kind, params, args.steps, corpus)
        errors[name], ERRORS[:] = list(ERRORS), []
    if dist.get_rank() == 0:
        print(f"W={dist.get_world_size()}, {args.steps} steps, warm-up {freeze} steps")
        print("step " + "".join(f"{name:>18s}" for name in curves))
        for step in range(0, args.steps, 25):
            print(f"{step:4d} " + "".join(f"{c[step]:18.4f}" for c in curves.values()))
        if args.curves:
            with open(args.curves, "w") as f:
                json.dump({"loss": curves, "compression_error": errors}, f)
        for name, errs in errors.items():
            if errs:
                marks = [0, 10, 50, len(errs) // 2, len(errs) - 1]
                print(f"relative compression error {name}: " + ", ".join(
                    f"step+{i} {errs[i]:.3f}" for i in marks if i < len(errs))
                    + f"; mean {sum(errs) / len(errs):.3f}")
        final = {name: sum(c[-20:]) / 20 for name, c in curves.items()}
        for name, value in final.items():
            ratios = "".join(f"  ratio to {ref} {value / final[ref]:.4f}"
                             for ref in ("Adam", "OneBitAdam-nocomp") if ref in final)
            print(f"final (mean of last 20) {name:17s} {value:.4f}{ratios}")


if __name__ == "__main__":
    main()
