"""Profile one ZeRO step of an MLP-block model and print what each rank really holds,
computes and sends.

    torchrun --nproc-per-node 4 examples/profile_mlp.py --stage 3
    torchrun --nproc-per-node 4 examples/profile_mlp.py --hidden 1024 --blocks 10  # ~85 M params

The defaults are small so it runs in seconds on a laptop CPU. With ``--json FILE`` the
report is also written as JSON.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import meshzero


class MLPBlock(nn.Module):
    """x + W2 gelu(W1 LN(x)): (B, T, H) -> (B, T, H)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class MLPModel(nn.Module):
    def __init__(self, hidden: int, blocks: int):
        super().__init__()
        self.proj_in = nn.Linear(hidden, hidden)
        self.blocks = nn.ModuleList(MLPBlock(hidden) for _ in range(blocks))
        self.proj_out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="micro batch per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLPModel(args.hidden, args.blocks)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 2,
                           "top_modules": 2, "output_file": args.json, "headline_steps": 3},
    }
    engine, *_ = meshzero.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    # step 0 warms up, records the unit order and counts FLOPs; step 1 is timed (the
    # profiled step); steps 2-4 are the headline's steady state, after which it prints
    for _ in range(5):
        x = torch.randn(args.batch, args.seq, args.hidden, generator=gen)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
