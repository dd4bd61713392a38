"""Bytes one rank sends per step: 1-bit Adam after its warm-up against the uncompressed
gradient all-reduce (ZeRO stage 0, the only stage 1-bit Adam runs at), from comm_report.

    torchrun --nproc-per-node 4 benchmarks/onebit_bytes.py [--dim 512 --layers 4]

Prints, on rank 0, the last step's bytes by op for Adam and for OneBitAdam (freeze_step 2,
5 steps: the last three compressed), and their ratio.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import meshzero


def model(dim: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(layers)])


def last_step_bytes(kind: str, dim: int, layers: int) -> tuple[dict[str, int], int]:
    params = {"lr": 1e-3}
    if kind == "OneBitAdam":
        params["freeze_step"] = 2
    net = model(dim, layers)
    numel = sum(p.numel() for p in net.parameters())
    engine, _, _, _ = meshzero.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0},
        "optimizer": {"type": kind, "params": params}})
    gen = torch.Generator().manual_seed(engine.topology.rank)
    for _ in range(5):
        x = torch.randn(4, dim, generator=gen)
        engine.backward(engine(x).square().mean())
        engine.step()
    report = {op: int(v["bytes"]) for op, v in engine.comm_report().items() if v["bytes"]}
    engine.close()
    return report, numel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    adam, numel = last_step_bytes("Adam", args.dim, args.layers)
    onebit, _ = last_step_bytes("OneBitAdam", args.dim, args.layers)
    if torch.distributed.get_rank() == 0:
        world = torch.distributed.get_world_size()
        print(f"W={world}, {numel} parameters, bytes one rank sends in the last step")
        for name, report in (("Adam (fp32 all-reduce)", adam), ("OneBitAdam", onebit)):
            print(f"  {name:24s} {sum(report.values()):>12,d}  {report}")
        print(f"  ratio OneBitAdam / Adam: {sum(onebit.values()) / sum(adam.values()):.4f}")


if __name__ == "__main__":
    main()
