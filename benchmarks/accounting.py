"""Model-state bytes and communication per rank, measured by the engine, against the ZeRO
formulas, for every stage at several world sizes.

    python benchmarks/accounting.py --world-sizes 1 2 4 --stages 0 1 2 3 [--bf16]
        [--grad-dtype fp32|bf16] [--no-reuse]

Each (stage, world size) runs under torchrun (gloo on CPU), trains a few steps of an
MLP-block model and reports rank 0's ``memory_report()`` and ``comm_report()``. Formulas
(psi = parameters, N = ranks, AdamW, fp32 / bf16 compute with fp32 master):

    model states:  stage 0: (p + m + g + 8) psi        stage 1: (p + g) psi + (m + 8) psi / N
                   stage 2: p psi + (m + g + 8) psi/N  stage 3: (p + m + g + 8) psi / N
                   with p = 4 (fp32) or 2 (bf16) bytes, m = 0 (fp32) or 4 (bf16 master),
                   g = the gradient dtype's bytes (data_types.grad_accum_dtype; default the
                   compute dtype): bf16 with bf16 gradients is the ZeRO paper's 16 psi
    comm per step: stages 1-2 reduce-scatter psi g and all-gather psi p, stage 0 all-reduces
                   2 psi g, stage 3 all-gathers k psi p and reduce-scatters psi g; (N-1)/N.
                   k = 1: DeepSpeed's default stage3_max_reuse_distance and
                   stage3_max_live_parameters (1e9) keep every unit of this model gathered
                   from forward into backward (zero/gather_plan.py); k = 2 with --no-reuse
                   (both 0: every unit gathered again in backward)

The measured numbers include padding (each unit padded to N * 4 elements) and Adam's 4-byte
step counter per fragment, so they sit slightly above the formulas.
"""

from __future__ import annotations

import argparse
import os

import torch
from _torchrun import print_result, run_ranks
from torch import nn


def build_model(dim: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                            nn.Linear(4 * dim, dim)) for _ in range(blocks)]
    return nn.Sequential(nn.Linear(dim, dim), nn.Sequential(*layers), nn.Linear(dim, dim))


def worker(args: argparse.Namespace) -> None:
    import meshzero

    model = build_model(args.dim, args.blocks)
    psi = sum(p.numel() for p in model.parameters())
    config = {
        "train_batch_size": 8 * int(os.environ.get("WORLD_SIZE", "1")),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": args.bf16},
        **({"data_types": {"grad_accum_dtype": args.grad_dtype}} if args.grad_dtype else {}),
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0,
                              "unit_classes": ["Sequential"],
                              **({"stage3_max_reuse_distance": 0,
                                  "stage3_max_live_parameters": 0} if args.no_reuse else {})},
    }
    engine, *_ = meshzero.initialize(model=model, config=config)
    for _ in range(2):
        x = torch.randn(8, args.dim)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    if torch.distributed.get_rank() == 0:
        print_result({"psi": psi, "memory": engine.memory_report(),
                      "comm": engine.comm_report()})
    torch.distributed.destroy_process_group()


def formulas(stage: int, psi: int, n: int, bf16: bool, grad_dtype: str | None,
             reuse: bool = True) -> tuple[float, float]:
    p, m = (2, 4) if bf16 else (4, 0)
    g = {None: p, "fp32": 4, "bf16": 2}[grad_dtype]
    states = {
        0: (p + m + g + 8) * psi,
        1: (p + g) * psi + (m + 8) * psi / n,
        2: p * psi + (m + g + 8) * psi / n,
        3: (p + m + g + 8) * psi / n,
    }[stage]
    if stage == 3:
        comm = ((1 if reuse else 2) * psi * p + psi * g) * (n - 1) / n
    else:
        comm = psi * (2 * g if stage == 0 else g + p) * (n - 1) / n
    return states, comm


def run(args: argparse.Namespace) -> None:
    rows = ["| stage | N | psi | params | master | grads | optim | states (measured) | "
            "states (formula) | ratio | comm B/step (measured) | comm (formula) | ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for stage in args.stages:
        for n in args.world_sizes:
            res = run_ranks(__file__, n, ["--stage", str(stage), "--dim", str(args.dim),
                                          "--blocks", str(args.blocks)]
                            + (["--bf16"] if args.bf16 else [])
                            + (["--grad-dtype", args.grad_dtype] if args.grad_dtype else [])
                            + (["--no-reuse"] if args.no_reuse else []))
            mem = {k: v["device"] for k, v in res["memory"].items() if isinstance(v, dict)}
            states = sum(mem.values())
            # parameter and gradient traffic (not the 8-byte unit-order and step checks)
            comm = sum(v["bytes"] for k, v in res["comm"].items()
                       if k not in ("order_check", "phase_check", "step_check"))
            f_states, f_comm = formulas(stage, res["psi"], n, args.bf16, args.grad_dtype,
                                        not args.no_reuse)
            ratio = f"{comm / f_comm:.4f}" if f_comm else "-"
            rows.append(
                f"| {stage} | {n} | {res['psi']} | {mem['params']} | {mem['master_params']} | "
                f"{mem['grads']} | {mem['optimizer_states']} | {states} | {f_states:.0f} | "
                f"{states / f_states:.4f} | {comm} | {f_comm:.0f} | {ratio} |")
    print("\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--grad-dtype", choices=["fp32", "bf16"], default=None,
                        help="data_types.grad_accum_dtype (default: the compute dtype)")
    parser.add_argument("--no-reuse", action="store_true",
                        help="stage 3: stage3_max_reuse_distance and max_live_parameters 0")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else run(args)


if __name__ == "__main__":
    main()
