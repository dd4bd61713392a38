"""Offload at GPU speed (issue 23, item 6): a GPT of 1.28 B parameters, bf16, 8 x 1024
tokens, one GPU, at ZeRO-2 and ZeRO-3 with the optimizer offloaded to pinned host memory and
with optimizer and parameters offloaded, against the GPU-resident step of the same stage.

    python benchmarks/gpu_offload_speed.py            # on a GPU (~3 minutes on one H200)
    python benchmarks/gpu_offload_speed.py --tiny     # anywhere: a tiny GPT on CPU (gloo)
    python benchmarks/gpu_offload_speed.py --hidden 512 --layers 4 ...  # another size

For each case it prints the median step time and its ratio to the GPU-resident step, the
device->host and host->device GB/s of the offload copies (``engine.transfer_report()``:
bytes over the copies' own CUDA-event time) and, from torch.profiler's memcpy events of
one profiled step, how many copies of at least 64 KiB went to or from pinned and pageable
host memory (smaller ones are the step's scalars: the loss, the guard's flags).

It FAILS (exit status 1) on a GPU when any offload copy is pageable or device->host is
under 10 GB/s. On CPU (``--tiny``) it runs the same code and prints the same table; there
are no memcpy events and the counters count the copies between the device and host tiers.
``benchmarks/gpu_check.sh`` runs it as the ``offload_speed`` check.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import ModelSpec, build_model, gpt_spec, loss_fn, make_batches  # noqa: E402

import meshzero  # noqa: E402

MIN_D2H_GBPS = 10.0
LARGE = 64 * 1024  # bytes: a memcpy at least this big is an offload copy
# (stage, offload_optimizer, offload_param, gradient_clipping); stage-3 "cpu", "cpu" is
# ZeRO-Infinity on host. With clipping the global norm is needed before any unit may step,
# so the host step runs after backward instead of during it: that row measures what it costs.
CASES = [(2, "none", "none", 0.0), (2, "cpu", "none", 0.0), (2, "cpu", "none", 1.0),
         (3, "none", "none", 0.0), (3, "cpu", "none", 0.0), (3, "cpu", "cpu", 0.0)]


def big_spec(batch: int = 8, seq: int = 1024) -> ModelSpec:
    # 24 blocks of width 2048 (50.4 M each) + 16384-token embedding and untied head
    # + 1024 positions = 1.278 B parameters
    return gpt_spec(hidden=2048, layers=24, heads=16, vocab=16384, seq=seq, batch=batch)


def config(spec: ModelSpec, stage: int, opt: str, param: str, clip: float) -> dict:
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if opt != "none":
        zero["offload_optimizer"] = {"device": opt}
    if param != "none":
        zero["offload_param"] = {"device": param}
    return {"train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True}, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "zero_optimization": zero}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def memcpy_kinds(trace_path: str) -> dict[str, int]:
    """Counts of the trace's memcpy events by kind ("DtoH Pinned", "HtoD Pageable", ...),
    those under LARGE bytes apart as "small"."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    out: dict[str, int] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") != "gpu_memcpy" or ("DtoH" not in name and "HtoD" not in name):
            continue
        nbytes = int(e.get("args", {}).get("bytes", 0))
        where = "Pageable" if "Pageable" in name else "Pinned" if "Pinned" in name else "?"
        key = f"{'DtoH' if 'DtoH' in name else 'HtoD'} {where}"
        key = key if nbytes >= LARGE else f"{key} small"
        out[key] = out.get(key, 0) + 1
    return out


def _keep_trace(path: str, prof, label: str) -> None:
    """With ``MESHZERO_OFFLOAD_DIAG`` set to a folder: the profiled step's top operations
    (appended to ``offload_ops.txt``) and, for the offload cases, its gzipped chrome trace."""
    out = os.environ.get("MESHZERO_OFFLOAD_DIAG")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "offload_ops.txt"), "a") as f:
        for key in ("self_cpu_time_total", "self_device_time_total"):
            f.write(f"== {label}, by {key}\n")
            f.write(prof.key_averages().table(sort_by=key, row_limit=18) + "\n")
    if "none none" not in label:
        import gzip
        import shutil

        with open(path, "rb") as src, gzip.open(os.path.join(out, f"trace_{label.replace(' ', '_')}"
                                                             ".json.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)


def _profiled_step(step, device: torch.device, label: str = "") -> dict[str, int]:
    """One step under torch.profiler (CUDA): its memcpy events by kind."""
    if device.type != "cuda":
        step()
        return {}
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        step()
        _sync(device)
    with tempfile.TemporaryDirectory(prefix="meshzero_offload_speed_") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        _keep_trace(path, prof, label)
        return memcpy_kinds(path)


def run_case(base: torch.nn.Module, spec: ModelSpec, device: torch.device, case: tuple,
             steps: int) -> dict:
    """Median step time, the last step's transfer report and the profiled memcpy kinds
    (a copy of ``base``: every case starts from the same weights, built once)."""
    model = copy.deepcopy(base)
    engine, *_ = meshzero.initialize(model=model, config=copy.deepcopy(config(spec, *case)))
    batches = [(x.to(device), y.to(device))  # on the device first: no copies of ours
               for x, y in make_batches(spec, 0, 0, 2)]

    def step(i: int = 0) -> None:
        x, y = batches[i % len(batches)]
        engine.backward(loss_fn(spec, engine(x), y))
        engine.step()

    warmup, times = 1, []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        step(i)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    report = engine.transfer_report()
    stage, opt, param, clip = case
    kinds = _profiled_step(step, device, f"z{stage} {opt} {param}"
                           f"{' clip' if clip else ''}")
    engine.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step": statistics.median(times), "report": report, "memcpy": kinds}


def _gbps(d: dict) -> float:
    return d["bytes"] / d["seconds"] / 1e9 if d["seconds"] > 0 else 0.0


def judge(results: dict, device: torch.device) -> tuple[bool, list[str]]:
    """The table's lines and whether every offload case passes (GPU rules only on CUDA)."""
    lines, ok = [], True
    for (stage, opt, param, clip), r in results.items():
        if opt == "none":
            continue
        base = results[(stage, "none", "none", 0.0)]["step"]
        d2h, h2d = r["report"]["d2h"], r["report"]["h2d"]
        pageable = sum(n for k, n in r["memcpy"].items() if "Pageable" in k and "small" not in k)
        pinned = sum(n for k, n in r["memcpy"].items() if "Pinned" in k and "small" not in k)
        bad = device.type == "cuda" and (pageable > 0 or _gbps(d2h) < MIN_D2H_GBPS)
        ok = ok and not bad
        lines.append(
            f"{'FAIL' if bad else 'ok  '} ZeRO-{stage} opt {opt} param {param}"
            f"{f' clip {clip:g}' if clip else ''}: step "
            f"{r['step']:.3f} s = {r['step'] / base:.2f}x resident ({base:.3f} s); d2h "
            f"{d2h['bytes'] / 1e6:.1f} MB at {_gbps(d2h):.1f} GB/s ({d2h['exposed_seconds']:.3f} "
            f"s exposed), h2d {h2d['bytes'] / 1e6:.1f} MB at {_gbps(h2d):.1f} GB/s; "
            f"memcpy >= 64 KiB pinned {pinned} pageable {pageable} "
            f"(counted pinned {d2h['pinned_count'] + h2d['pinned_count']} of "
            f"{d2h['count'] + h2d['count']}); all memcpy {r['memcpy']}")
    return ok, lines


def check_offload_speed(spec: ModelSpec, device: torch.device, steps: int,
                        big: bool | None = None):
    """gpu_check.py's ``offload_speed``: the 1.28 B GPT on CUDA (``big``), else ``spec``."""
    spec = big_spec() if (device.type == "cuda" if big is None else big) else spec
    base = build_model(spec, seed=0)
    params = sum(p.numel() for p in base.parameters())
    steps = min(steps, 3)  # 6 cases of a 1.28 B model within gpu_check.sh's 8 minutes
    results = {case: run_case(base, spec, device, case, steps) for case in CASES}
    ok, lines = judge(results, device)
    for line in lines:
        print("    " + line, flush=True)
    worst = max(r["step"] / results[(c[0], "none", "none", 0.0)]["step"]
                for c, r in results.items() if c[1] != "none")
    return ok, (f"{params / 1e6:.1f} M params, batch {spec.batch}x{spec.seq}, worst offload "
                f"step {worst:.2f}x resident; d2h >= {MIN_D2H_GBPS:.0f} GB/s and no pageable "
                "copy required on GPU")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny GPT on CPU (gloo)")
    p.add_argument("--steps", type=int, default=3)
    for key in ("hidden", "layers", "heads", "vocab", "seq", "batch"):
        p.add_argument(f"--{key}", type=int, help=f"the GPT's {key} instead (any device)")
    args = p.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    from meshzero.topology import init_distributed

    init_distributed("nccl" if device.type == "cuda" else "gloo")
    sizes = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "vocab", "seq",
                                           "batch")}
    given = any(v is not None for v in sizes.values())
    spec = gpt_spec(tiny=args.tiny or not given, **sizes)
    ok, line = check_offload_speed(spec, device, args.steps,
                                   big=None if not given and not args.tiny else False)
    print(f"{'PASS' if ok else 'FAIL'} offload_speed  {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
