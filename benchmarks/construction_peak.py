"""Peak host memory of building a model for ZeRO-3: eager construction vs ``zero_init``.

    python benchmarks/construction_peak.py [--model hidden] [--world-size 2] [--stage 3]

Models (odd width 1001, a tied embedding; one unit is one block's fp32 bytes):
    tied_lm    5,993 x 1,001 embedding tied to the head (nanoGPT's tie), 15 blocks of
               LayerNorm, Linear(1001, 2997), ReLU, Linear(2997, 1001)      (issue 15)
    tied_gelu  the same with GELU, 16 blocks, Hugging Face's tie               (issue 26)
    hidden     issue 26's hidden model as we read it: 16 pre-LN blocks of LayerNorm,
               Linear(1001, 4004), GELU, Linear(4004, 1001), a 16,384 x 1,001 embedding
               tied to the head (2.04 units: the root unit is the largest)

Each rank under torchrun (gloo on CPU) resets its peak RSS (``/proc/self/clear_refs`` 5),
builds the engine, and reports

    peak beyond states = (VmHWM - RSS before) - bytes of the model states it holds after

(``memory_report()``: parameter, master and gradient shards), in units; the table gives the
worst rank. Two starts per construction:

    fresh   the process has built no engine yet: an outside probe's view. Like a training
            script it imports torch, then meshzero, before the measure starts; meshzero then
            loads its engine and what the first engine would import (torch._dynamo and sympy,
            which ``torch.optim.Optimizer.add_param_group`` and any ``TorchDispatchMode``
            import on first use; pydantic, safetensors: about 94 MB whatever the model) at
            ``import meshzero`` (src/meshzero/__init__.py), not inside the first build
    warm    a tiny engine is built first, the same way: construction alone

Eager construction holds the whole model (+ the ZeRO copy of each unit) before it is
sharded; ``zero_init`` materialises one unit at a time, the largest first.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
from _torchrun import print_result, run_ranks
from torch import nn

import meshzero  # after torch, as a training script does: the engine loads here


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TiedLM(nn.Module):
    """Embedding tied to the head (nanoGPT's way: the head's initial values are kept)."""

    def __init__(self, vocab: int = 5993, dim: int = 1001, hidden: int = 2997,
                 blocks: int = 15) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.embed.weight = self.head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class GeluBlock(nn.Module):
    """LayerNorm, Linear, GELU, Linear (a transformer MLP)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class TiedGelu(nn.Module):
    """16 GELU blocks, the head tied to the embedding (Hugging Face's way: the embedding's
    initial values are kept, the head's own draw is discarded)."""

    def __init__(self, vocab: int = 5993, dim: int = 1001, hidden: int = 2997,
                 blocks: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(GeluBlock(dim, hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Hidden(TiedGelu):
    """Issue 26's hidden model as we read it: a 4x MLP, a 16,384-token tied embedding."""

    def __init__(self, vocab: int = 16384, dim: int = 1001, hidden: int = 4004,
                 blocks: int = 16) -> None:
        super().__init__(vocab, dim, hidden, blocks)


MODELS = {"tied_lm": TiedLM, "tied_gelu": TiedGelu, "hidden": Hidden}
# one block of each model, for the unit: (block class, width, hidden width)
UNIT_BLOCK = {"tied_lm": (Block, 1001, 2997), "tied_gelu": (GeluBlock, 1001, 2997),
              "hidden": (GeluBlock, 1001, 4004)}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _state_bytes(report: dict) -> int:
    return sum(sum(v.values()) for k, v in report.items()
               if k in ("params", "master_params", "grads", "optimizer_states"))


def _build(how: str, factory, config: dict) -> tuple:
    if how == "eager":
        torch.manual_seed(0)
        return meshzero.initialize(model=factory(), config=config)
    if how == "zero_init_block":  # the user builds it under `with zero_init(config)`
        with meshzero.zero_init(config):
            model = factory()
        return meshzero.initialize(model=model, config=config)
    return meshzero.initialize(model=factory, config=config)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    config = {"train_batch_size": world, "seed": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": args.stage}}
    block, dim, hidden = UNIT_BLOCK[args.model]
    unit = sum(p.numel() for p in block(dim, hidden).parameters()) * 4
    model = MODELS[args.model]
    first_engine = 0
    if args.process == "warm":  # the first engine's imports and threads, then construction alone
        gc.collect()
        before = _status("VmRSS")
        _build(args.how, lambda: model(vocab=8, dim=3, hidden=5, blocks=2), config)[0].close()
        gc.collect()
        first_engine = _status("VmRSS") - before
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    kwargs = {} if args.blocks is None else {"blocks": args.blocks}
    engine = _build(args.how, lambda: model(**kwargs), config)[0]
    peak = _status("VmHWM") - base
    gc.collect()
    after = _status("VmRSS") - base
    states = _state_bytes(engine.memory_report())
    numel = sum(p.numel() for p in engine.module.parameters())
    rows: list = [None] * world
    dist.all_gather_object(rows, {"peak": peak, "after": after, "states": states,
                                  "first_engine": first_engine})
    if dist.get_rank() == 0:
        print_result({"unit": unit, "numel": numel, "ranks": rows})
    engine.close()
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    print(f"model {args.model}\n\n"
          "| construction | start | W | stage | params | unit MB | states MB/rank "
          "| peak MB (worst) | peak beyond states, units (per rank) "
          "| RSS after beyond states, units | first engine MB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for how in args.how:
        for start in args.process:
            extra = [] if args.blocks is None else ["--blocks", str(args.blocks)]
            res = run_ranks(__file__, args.world_size,
                            ["--how", how, "--stage", str(args.stage), "--model", args.model,
                             "--process", start, *extra])
            unit = res["unit"]
            ranks = res["ranks"]
            beyond = [(r["peak"] - r["states"]) / unit for r in ranks]
            left = [(r["after"] - r["states"]) / unit for r in ranks]
            first = (f"{max(r['first_engine'] for r in ranks) / 1e6:.0f}"
                     if start == "warm" else "-")
            print(f"| {how} | {start} | {args.world_size} | {args.stage} | "
                  f"{res['numel'] / 1e6:.1f} M | {unit / 1e6:.1f} | "
                  f"{max(r['states'] for r in ranks) / 1e6:.0f} | "
                  f"{max(r['peak'] for r in ranks) / 1e6:.0f} | **{max(beyond):.2f}** "
                  f"({', '.join(f'{b:.2f}' for b in beyond)}) | {max(left):.2f} | {first} |",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=None,
                        help="number of blocks (default: the model's own)")
    parser.add_argument("--model", choices=sorted(MODELS), default="hidden")
    parser.add_argument("--process", nargs="+", default=["fresh", "warm"],
                        choices=["fresh", "warm"],
                        help="fresh: no engine built before (an outside probe's view); "
                             "warm: a tiny engine first, so construction alone is measured")
    parser.add_argument("--how", nargs="+", default=["eager", "zero_init"],
                        choices=["eager", "zero_init", "zero_init_block"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.how, args.process = args.how[0], args.process[0]
        worker(args)
    else:
        run(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
