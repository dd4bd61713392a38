"""torch.compile under ZeRO (issue 35): the same GPT four ways in one run.

    python benchmarks/compile.py                      # CPU, W=1, stages 0 and 3, inductor
    python benchmarks/compile.py --world 2            # 2 gloo ranks (1 thread each)
    python benchmarks/compile.py --device cuda        # a GPU: the GPU rule (below)
    python benchmarks/compile.py --tiny --backend aot_eager --rule none   # a smoke run

The arms, built side by side in each rank from the same weights and fed the same batches:

- ``plain eager``: the model and ``torch.optim.AdamW``, no communication;
- ``plain compiled``: the same with each block compiled (``block.compile(fullgraph=True)``,
  torchtitan's granularity: its ``apply_compile`` compiles each TransformerBlock);
- ``meshzero eager`` and ``meshzero compiled`` at each ``--stages`` stage: the engine
  without and with the config's ``"compile"`` section (the engine compiles each ZeRO
  unit's forward; its gathers, releases and reduce-scatters stay in eager hooks).

Every round runs one step of each arm in turn (each round starting one arm later), each
after a barrier, so every arm sees the same machine load; after ``--warmup`` rounds
(compilation happens there) the next ``--steps`` are timed. Printed: each arm's median
step, the compiled/eager ratio of plain torch and of meshzero at each stage, the last loss
(all arms train the same model on the same batches) and the compiled arms' compile report
(units, graph breaks, recompiles, compile seconds).

Rules (exit 1 when one fails):
- ``cpu`` (the default on CPU): meshzero's compiled/eager ratio is at most ``--tolerance``
  (5 %) above plain torch's own: compiling under ZeRO gains what compiling gains in plain
  torch (the engine's eager hooks add the same time to both of meshzero's arms, so its ratio
  sits a little above plain torch's);
- ``gpu`` (the default on CUDA): meshzero's compiled step is not slower than its eager one;
- ``none``: print only.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import build_model, gpt_spec, loss_fn, make_batches  # noqa: E402
from _table import markdown  # noqa: E402
from _torchrun import print_result, run_ranks  # noqa: E402

import meshzero  # noqa: E402
from meshzero.topology import init_distributed  # noqa: E402

LR = 1e-3
EPS = 1e-4  # as gpu_check.py: keeps eager and compiled round-off from growing through Adam
# CPU: 4 blocks of width 256 (0.79 M each) + 2048-token embedding and head = 4.2 M
# parameters, 4 x 64 tokens per rank: ~6.5 GFLOP a step, a few hundred ms on 2 cores
CPU_MODEL = dict(hidden=256, layers=4, heads=4, vocab=2048, seq=64, batch=4)
GPU_MODEL = dict(hidden=1024, layers=8, heads=16, vocab=8192, seq=1024, batch=8)


def _config(spec, stage: int, compiled: bool, backend: str, world: int) -> dict:
    cfg: dict = {"train_micro_batch_size_per_gpu": spec.batch,
                 "gradient_accumulation_steps": 1, "train_batch_size": spec.batch * world,
                 "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01,
                                                              "eps": EPS}},
                 "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if compiled:
        cfg["compile"] = {"enabled": True, "backend": backend}
    return cfg


def own_code(model: torch.nn.Module, tag: str) -> torch.nn.Module:
    """``model`` with its blocks of a class of their own, whose ``forward`` is a copy of the
    block's code: dynamo's cache lives on the code object, process-wide, so arms sharing
    ``Block.forward`` would each fail the others' guards (a parameter's type differs at stage
    3) and count a recompile that no single-engine run has."""
    block_cls = type(model.blocks[0])
    forward = block_cls.forward
    copy = types.FunctionType(forward.__code__.replace(), forward.__globals__,
                              f"{tag}_forward", forward.__defaults__, forward.__closure__)
    cls = type(f"{block_cls.__name__}_{tag}", (block_cls,), {"forward": copy})
    for block in model.blocks:
        block.__class__ = cls
    return model


class Arm:
    """One way of training: ``step(x, y)`` runs forward, backward and the optimizer step and
    returns the loss."""

    def __init__(self, name: str, step: Callable, close: Callable | None = None,
                 report: Callable | None = None):
        self.name, self.step, self.close, self.report = name, step, close, report
        self.times: list[float] = []
        self.loss = float("nan")


def plain_arm(spec, device: torch.device, compiled: bool, backend: str) -> Arm:
    model = own_code(build_model(spec, seed=0), "plain").to(device)
    if compiled:
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=EPS)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(spec, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return Arm(f"plain {'compiled' if compiled else 'eager'}", step)


def meshzero_arm(spec, stage: int, compiled: bool, backend: str) -> Arm:
    world = dist.get_world_size()
    engine, *_ = meshzero.initialize(model=own_code(build_model(spec, seed=0), f"z{stage}"),
                                     config=_config(spec, stage, compiled, backend, world))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(spec, engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    report = engine.compile_report if compiled else None
    return Arm(f"meshzero z{stage} {'compiled' if compiled else 'eager'}", step, engine.close,
               report)


def run_rounds(arms: list[Arm], spec, device: torch.device, warmup: int, steps: int) -> None:
    """One step of each arm per round, each after a barrier; rounds past ``warmup`` timed."""
    rank = dist.get_rank()
    batches = make_batches(spec, 0, rank, warmup + steps)
    for i, (x, y) in enumerate(batches):
        x, y = x.to(device), y.to(device)
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:  # each arm first in turn
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = arm.step(x, y)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                arm.times.append(time.perf_counter() - t0)
            arm.loss = loss.item()


def worker(args: argparse.Namespace) -> None:
    """One rank: build every arm, run the rounds, rank 0 prints the result."""
    from torch._dynamo.utils import counters

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    init_distributed("nccl" if device.type == "cuda" else "gloo")
    torch._dynamo.config.recompile_limit = 64  # noqa: SLF001 - many modules share Block code
    spec = _spec(args)
    arms = [plain_arm(spec, device, False, args.backend),
            plain_arm(spec, device, True, args.backend)]
    for stage in args.stages:
        arms += [meshzero_arm(spec, stage, False, args.backend),
                 meshzero_arm(spec, stage, True, args.backend)]
    counters.clear()
    run_rounds(arms, spec, device, args.warmup, args.steps)
    result = {"arms": {a.name: {"median_s": statistics.median(a.times), "loss": a.loss,
                                "report": _report(a)} for a in arms},
              "dynamo": {"frames": counters["stats"]["unique_graphs"],
                         "breaks": sum(counters["graph_break"].values())},
              "params": sum(p.numel() for p in build_model(spec, seed=0).parameters()),
              "world": dist.get_world_size()}
    for arm in arms:
        if arm.close is not None:
            arm.close()
    if dist.get_rank() == 0:
        print_result(result)
    dist.destroy_process_group()


def _report(arm: Arm) -> dict | None:
    if arm.report is None:
        return None
    got = arm.report()
    return {k: got.get(k) for k in ("units", "graph_breaks", "recompiles", "compile_seconds")}


def _spec(args: argparse.Namespace):
    if args.tiny:
        return gpt_spec(tiny=True)
    base = GPU_MODEL if args.device == "cuda" else CPU_MODEL
    return gpt_spec(**{**base, **{k: getattr(args, k) for k in base
                                  if getattr(args, k) is not None}})


def ratios(result: dict, stages: list[int]) -> dict[str, float]:
    """Compiled over eager median step: plain torch's and meshzero's at each stage."""
    arms = result["arms"]
    out = {"plain": arms["plain compiled"]["median_s"] / arms["plain eager"]["median_s"]}
    for s in stages:
        out[f"z{s}"] = (arms[f"meshzero z{s} compiled"]["median_s"]
                        / arms[f"meshzero z{s} eager"]["median_s"])
    return out


def verdicts(result: dict, args: argparse.Namespace) -> list[tuple[str, bool]]:
    """(line, passed) per stage under ``args.rule``."""
    r, arms, out = ratios(result, args.stages), result["arms"], []
    for s in args.stages:
        if args.rule == "cpu":
            bound = r["plain"] * (1 + args.tolerance)
            out.append((f"z{s}: meshzero compiled/eager {r[f'z{s}']:.3f} <= plain "
                        f"{r['plain']:.3f} x {1 + args.tolerance:.2f} = {bound:.3f}",
                        r[f"z{s}"] <= bound))
        elif args.rule == "gpu":
            c = arms[f"meshzero z{s} compiled"]["median_s"]
            e = arms[f"meshzero z{s} eager"]["median_s"]
            out.append((f"z{s}: meshzero compiled {c * 1e3:.1f} ms <= eager {e * 1e3:.1f} ms",
                        c <= e))
    return out


def render(result: dict, args: argparse.Namespace) -> str:
    r = ratios(result, args.stages)
    rows = []
    for name, arm in result["arms"].items():
        key = "plain" if name.startswith("plain") else name.split()[1]
        compiled = name.endswith("compiled")
        rep = arm["report"] or {}
        rows.append([name, f"{arm['median_s'] * 1e3:.1f}", f"{r[key]:.3f}" if compiled else "",
                     f"{arm['loss']:.6f}", _units(rep.get("units")),
                     _text(rep.get("graph_breaks")), _text(rep.get("recompiles")),
                     _secs(rep.get("compile_seconds"))])
    return markdown(["arm", "median step (ms)", "compiled/eager", "last loss", "units",
                     "graph breaks", "recompiles", "compile s"], rows)


def _units(units: object) -> str:
    return "" if units is None else str(len(units) if isinstance(units, (list, dict)) else units)


def _text(v: object) -> str:
    return "" if v is None else str(v)


def _secs(v: object) -> str:
    return "" if v is None else f"{float(v):.1f}"  # type: ignore[arg-type]


def _machine(device: str) -> str:
    where = (torch.cuda.get_device_name(0) if device == "cuda" else
             f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})")
    return f"{where}, PyTorch {torch.__version__}, Python {platform.python_version()}"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--world", type=int, default=1, help="ranks (torchrun, gloo on CPU)")
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="the tiny GPT (a smoke run)")
    for k in CPU_MODEL:
        p.add_argument(f"--{k}", type=int, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: 1 on CPU, cores / ranks on CUDA)")
    p.add_argument("--rule", choices=("cpu", "gpu", "none"), default=None)
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.rule = args.rule or ("gpu" if args.device == "cuda" else "cpu")
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"FAIL: torch {torch.__version__} sees no CUDA device")
        return 1
    # one thread per rank on CPU: on a shared machine a second thread waits on a descheduled
    # sibling at every op (measured: 2 threads per rank ran 10x slower under other load)
    threads = args.threads or (1 if args.device == "cpu" else
                               max(1, (os.cpu_count() or 1) // args.world))
    result = run_ranks(__file__, args.world, [*sys.argv[1:], "--threads", str(threads)])
    print(f"compile.py: {_machine(args.device)}; W={result['world']}, {threads} thread(s) "
          f"per rank, {result['params'] / 1e6:.1f} M parameters, backend {args.backend}, "
          f"{args.warmup} warm-up + {args.steps} timed rounds")
    print(render(result, args))
    print(f"\ndynamo in rank 0: {result['dynamo']['frames']} graphs compiled, "
          f"{result['dynamo']['breaks']} graph breaks (all arms)")
    failed = False
    for line, ok in verdicts(result, args):
        print(f"{'PASS' if ok else 'FAIL'} {line}")
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
