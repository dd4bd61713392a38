"""What each part of the flops profiler costs on the host (issue 24), on CPU or a GPU.

A GPT of 24 blocks (small width by default: the step is host-bound, as the 1.24 B GPT is at
one GPU, so every microsecond of Python shows) has 222 modules, like the GPU case, and
dispatches 2438 ops in a plain forward + backward (the 1.24 B GPT's engine step on the GPU:
5051, with ZeRO's and the optimizer's). Part A times one forward + backward of the plain
model with each part of the profiler alone; part B trains an engine (ZeRO-3, W=1) and
times, from outside, the FLOP-counting step P-1 and the timed step P against the median
unprofiled step, and the report's building and printing. Medians of ``--repeats``.
Part B prints its pass/fail against the profiler's target (the timed step at most 1.10x an
unprofiled one, by the outside timer); the test suite checks only that the report prints
what it measured, since a timed test fails on a loaded machine.

    python benchmarks/profiler_cost.py                 # CPU
    python benchmarks/profiler_cost.py --device cuda   # the same on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import ModelSpec, build_model, gpt_spec, loss_fn, make_batches  # noqa: E402

import meshzero  # noqa: E402
from meshzero.profiling.flops import FlopCounter  # noqa: E402
from meshzero.profiling.marks import ModuleTimer, marks_for  # noqa: E402
from meshzero.topology import init_distributed  # noqa: E402

PROFILE_STEP = 4
TARGET = 1.10  # the timed step over an unprofiled one, by the outside timer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(model, spec: ModelSpec, x, y, before: Callable[[], object] | None = None,
             after: Callable[[], object] | None = None) -> float:
    """Host CPU seconds of one forward + backward (synchronised; CPU time, not wall time,
    since a shared machine's load moves wall time more than the parts measured here),
    ``before`` / ``after`` around it but outside the time."""
    start = before() if before else None
    _sync(x.device)
    t0 = time.process_time()
    loss_fn(spec, model(x), y).backward()
    _sync(x.device)
    seconds = time.process_time() - t0
    if after:
        after(start)  # type: ignore[call-arg]
    return seconds


def part_a(spec: ModelSpec, device: torch.device, repeats: int) -> None:
    model = build_model(spec, seed=0).to(device)
    x, y = (t.to(device) for t in make_batches(spec, 0, 0, 1)[0])
    modules = sum(1 for _ in model.modules())

    def timer(backward_paths=None):
        t = ModuleTimer(model, marks_for(device, 2 * modules + 16), backward_paths)
        t.register()
        t.arm()
        return t

    def stop_timer(t):
        t.stop()
        t0 = time.process_time()
        t.read()
        read_s.append(time.process_time() - t0)

    def counter():
        c = FlopCounter(model)
        c.start()
        return c

    all_paths = frozenset(p for p, _ in model.named_modules())
    cases = {"plain": (None, None), "timer, backward per top-level block": (timer, stop_timer),
             "timer, backward per module": (lambda: timer(all_paths), stop_timer),
             "FLOP counter (dispatch mode + hooks)": (counter, lambda c: c.stop())}
    for _ in range(3):
        _fwd_bwd(model, spec, x, y)  # warm-up
    results: dict[str, list[float]] = {k: [] for k in cases}
    read_s: list[float] = []
    for _ in range(repeats):
        for name, (before, after) in cases.items():
            results[name].append(_fwd_bwd(model, spec, x, y, before, after))
    base = statistics.median(results["plain"])
    print(f"A. one forward + backward of the plain model ({modules} modules), host CPU time, "
          f"median of {repeats}:")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"  {name:<40} {median * 1e3:8.2f} ms  +{(median - base) * 1e3:7.2f} ms "
              f"({median / base:.3f}x)")
    print(f"  reading the timer's marks after the step  {statistics.median(read_s) * 1e3:8.2f} ms")


def part_b(spec: ModelSpec, device: torch.device, repeats: int) -> None:
    rows = []
    for _ in range(repeats):
        cfg = {"train_micro_batch_size_per_gpu": spec.batch,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
               "zero_optimization": {"stage": 3},
               "flops_profiler": {"enabled": True, "profile_step": PROFILE_STEP,
                                  "headline_steps": 3}}
        if device.type == "cuda":
            cfg["bf16"] = {"enabled": True}
        engine, *_ = meshzero.initialize(model=build_model(spec, seed=0), config=cfg)
        outside, printed = [], io.StringIO()
        with contextlib.redirect_stdout(printed):
            for x, y in make_batches(spec, 0, 0, PROFILE_STEP + 4):
                x, y = x.to(device), y.to(device)
                _sync(device)
                t0 = time.perf_counter()
                engine.backward(loss_fn(spec, engine(x), y))
                engine.step()
                _sync(device)
                outside.append(time.perf_counter() - t0)
        r = engine.last_profile
        t0 = time.perf_counter()
        str(r)
        print_s = time.perf_counter() - t0
        median = statistics.median(outside[s] for s in r.headline_steps)
        rows.append((outside[PROFILE_STEP - 1] / median, outside[PROFILE_STEP] / median,
                     (outside[PROFILE_STEP] - median) * 1e3, r.report_build_s * 1e3,
                     print_s * 1e3, median * 1e3, r.profiled_step_overhead))
        engine.close()
    cols = [statistics.median(c) for c in zip(*rows, strict=True)]
    print(f"B. engine, ZeRO-3, W=1, profile_step {PROFILE_STEP}, median of {repeats} engines:")
    print(f"  unprofiled step (outside timer)          {cols[5]:8.2f} ms")
    print(f"  FLOP-counting step {PROFILE_STEP - 1} (outside timer)     {cols[0]:8.3f}x")
    print(f"  timed step {PROFILE_STEP} (outside timer)             {cols[1]:8.3f}x "
          f"(+{cols[2]:.2f} ms; the report's footer: {cols[6]:.3f}x)")
    verdict = "pass" if cols[1] <= TARGET else "FAIL"
    print(f"  target: timed step <= {TARGET:.2f}x                {verdict}")
    print(f"  building the report (in step {PROFILE_STEP})          {cols[3]:8.2f} ms")
    print(f"  str(report) (printing it)                {cols[4]:8.2f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--part", choices=("a", "b", "ab"), default="ab")
    args = p.parse_args()
    device = torch.device(args.device)
    spec = gpt_spec(hidden=args.hidden, layers=24, heads=2, vocab=512, seq=32, batch=2)
    init_distributed("nccl" if args.device == "cuda" else "gloo")
    if "a" in args.part:
        part_a(spec, device, args.repeats)
    if "b" in args.part:
        part_b(spec, device, args.repeats)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
