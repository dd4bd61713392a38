"""Train a small MLP with ZeRO stage 3: ``python examples/train_minimal.py`` (one process) or
``torchrun --nproc-per-node 2 examples/train_minimal.py``. Prints only on rank 0."""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import meshzero

IN, HIDDEN, OUT, SEED = 16, 64, 4, 0


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))); the repeated blocks become the ZeRO units."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class Model(nn.Module):  # ~51K parameters
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def global_batch(step: int, size: int, A, B):
    """Batch ``step`` of y = sin(x @ A) @ B, the same on every rank."""
    x = torch.randn(size, IN, generator=torch.Generator().manual_seed(SEED + 1 + step))
    return x, torch.sin(x @ A) @ B


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--config", default=str(Path(__file__).with_name("ds_config_zero3.json")))
    args = parser.parse_args()
    torch.manual_seed(SEED)
    A, B = torch.randn(IN, 32) / IN**0.5, torch.randn(32, OUT) / 32**0.5
    engine, _, _, _ = meshzero.initialize(model=Model(), config=args.config)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    for step in range(args.steps):
        total = torch.zeros(())
        for m in range(gas):
            x, y = global_batch(step * gas + m, micro * world, A, B)
            x, y = x[rank * micro:(rank + 1) * micro], y[rank * micro:(rank + 1) * micro]
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / gas
        dist.all_reduce(total)  # the loss of the whole global batch, for printing
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d} loss {total.item() / world:.6f}", flush=True)
    if rank == 0:
        mem = engine.memory_report()
        peak = mem.pop("gathered_params_peak")
        print("memory on device (bytes):", {k: v["device"] for k, v in mem.items()},
              "gathered_params_peak", peak)
        for op, s in engine.comm_report().items():
            print(f"comm {op}: count {s['count']} bytes {s['bytes']} "
                  f"seconds {s['seconds']:.4f} exposed {s['exposed_seconds']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
