"""Checkpoint save/load time and size on disk, at several world sizes, under torchrun.

    python benchmarks/checkpoint_io.py --world-sizes 1 2 4 --stage 3 [--reps 3]

A model of ~6.3 M parameters (MLP blocks, dim 512) trained one step with AdamW in fp32 holds
~100 MB of model states (params 4 + grads 4 + Adam m, v 8 bytes per parameter); a checkpoint
holds the 12 bytes per parameter that a resume needs (fp32 master, m, v; grads are not saved).
Each world size runs under torchrun (gloo, one thread per rank): ``reps`` saves to new tags,
then ``reps`` loads of the last one into the same engine, each timed on rank 0 between
barriers (so it is the collective's wall time), median reported. Loads verify the sha256 of
every file read. Files are read back right after they are written, so they come from the page
cache. The consolidate column is one process writing model.safetensors (fp32) from the tag.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _torchrun import print_result, run_ranks
from torch import nn


def build_model(dim: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                            nn.Linear(2 * dim, dim)) for _ in range(blocks)]
    return nn.Sequential(nn.Linear(dim, dim), nn.Sequential(*layers), nn.Linear(dim, dim))


def _timed(fn) -> float:
    torch.distributed.barrier()
    t0 = time.perf_counter()
    fn()
    torch.distributed.barrier()
    return time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    import meshzero
    from meshzero.checkpoint import consolidate

    model = build_model(args.dim, args.blocks)
    psi = sum(p.numel() for p in model.parameters())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = {"train_batch_size": 4 * world,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": args.stage, "unit_classes": ["Sequential"],
                                    "stage3_param_persistence_threshold": 0}}
    engine, *_ = meshzero.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(4, args.dim)).pow(2).mean())
    engine.step()
    memory = engine.memory_report()
    states = sum(v["device"] for v in memory.values() if isinstance(v, dict))
    root = Path(args.dir)
    saves = [_timed(lambda i=i: engine.save_checkpoint(root, tag=f"rep{i}"))
             for i in range(args.reps)]
    loads = [_timed(lambda: engine.load_checkpoint(root)) for _ in range(args.reps)]
    tag_dir = root / f"rep{args.reps - 1}"
    if torch.distributed.get_rank() == 0:
        size = sum(p.stat().st_size for p in tag_dir.iterdir())
        t0 = time.perf_counter()
        consolidate(root, root / "consolidated")
        consolidate_s = time.perf_counter() - t0
        print_result({
            "psi": psi, "states_per_rank": states, "save_s": statistics.median(saves),
            "load_s": statistics.median(loads), "size": size,
            "files": len(list(tag_dir.iterdir())), "consolidate_s": consolidate_s})
    torch.distributed.destroy_process_group()


def run(args: argparse.Namespace) -> None:
    rows = ["| N | psi | model states / rank (MB) | checkpoint on disk (MB) | files | save (s) | "
            "load (s) | save MB/s | load MB/s | consolidate (s) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for n in args.world_sizes:
        directory = tempfile.mkdtemp(prefix=f"ckpt_w{n}_", dir=args.dir)
        try:
            r = run_ranks(__file__, n, ["--stage", str(args.stage), "--dim", str(args.dim),
                                        "--blocks", str(args.blocks), "--reps", str(args.reps),
                                        "--dir", directory])
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        mb = r["size"] / 1e6
        rows.append(f"| {n} | {r['psi']} | {r['states_per_rank'] / 1e6:.1f} | {mb:.1f} | "
                    f"{r['files']} | {r['save_s']:.3f} | {r['load_s']:.3f} | "
                    f"{mb / r['save_s']:.0f} | {mb / r['load_s']:.0f} | "
                    f"{r['consolidate_s']:.3f} |")
    print("\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else run(args)


if __name__ == "__main__":
    main()
