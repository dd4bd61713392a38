"""The CUDA checks of ``benchmarks/gpu_check.sh``, one process, world size 1.

    python benchmarks/gpu_check.py                 # on a GPU: NCCL, cuda tensors
    python benchmarks/gpu_check.py --device cpu --tiny   # the script's own check (gloo)

Checks (each prints PASS/FAIL and a line of figures):

1. ``nccl``: the process group is NCCL at world size 1 and a ZeRO-3 fp32 engine trains to
   the same parameters as plain torch (rtol 1e-4: TF32 is off for the check).
2. ``bf16``: ZeRO-3 with bf16 compute, fp32 master, equals plain-torch autocast training
   within bf16 tolerance (the losses within 2e-2 relative).
3. ``cpu_offload``: ZeRO-3 with ``offload_optimizer`` and ``offload_param`` to pinned host
   memory and the overlapped host step (no clipping: each unit steps during backward) equals
   the run without offload.
4. ``nvme_offload``: the same with both on NVMe (files under a temporary directory).
5. ``gpt_offload``: the benchmark GPT (~84 M) at ZeRO-3 with CPU offload, bf16: median step
   time and MFU from the flops profiler's FLOPs per step over the H200's dense bf16 peak.
6. ``profiler_truth`` (``gpu_profiler_truth.py``): a 1.24 B GPT at ZeRO-3, bf16: the
   profiler's headline latency against an outside timer, and the profiled step against the
   median step, both within 5 %.
7. ``offload_speed`` (``gpu_offload_speed.py``): a 1.28 B GPT, bf16, 8 x 1024, at ZeRO-2/3
   with the optimizer (and the parameters) offloaded: step time against the GPU-resident
   step, d2h / h2d GB/s, pinned vs pageable memcpy; fails on any pageable offload copy or
   d2h under 10 GB/s.
8. ``quantized`` (``gpu_quantized.py``): ZeRO++ qwZ + qgZ at ZeRO-3 on the device: the
   quantizer's bytes equal the CPU's, the engine equals a plain-torch replay with the same
   int8 weights and int4 gradients (rtol 1e-4), the quantized ops run.

Exit status 1 if any check fails. Nothing is downloaded; the models are built here.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _models import build_model, gpt_spec, loss_fn, make_batches  # noqa: E402
from gpu_offload_speed import check_offload_speed  # noqa: E402
from gpu_profiler_truth import check_profiler_truth  # noqa: E402
from gpu_quantized import check_quantized  # noqa: E402

import meshzero  # noqa: E402
from meshzero.topology import init_distributed  # noqa: E402

H200_BF16_DENSE = 989e12  # FLOP/s, NVIDIA H200 SXM dense bf16 (no sparsity)
LR = 1e-3
# Adam divides by sqrt(v) + eps: with a tiny eps, summation-order round-off on near-zero
# gradients becomes lr-sized; 1e-4 keeps the comparison well-conditioned (as tests/ do)
EPS = 1e-4


def _config(**zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01,
                                                         "eps": EPS}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  **zero}}


def _train_meshzero(spec, config: dict, device: torch.device, steps: int):
    model = build_model(spec, seed=0)
    engine, *_ = meshzero.initialize(model=model, config=copy.deepcopy(config))
    losses = []
    for x, y in make_batches(spec, 0, 0, steps):
        loss = loss_fn(spec, engine(x.to(device)), y.to(device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = engine.full_state_dict()
    engine.close()
    return params, losses


def _train_plain(spec, device: torch.device, steps: int, bf16: bool):
    model = build_model(spec, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
    losses = []
    for x, y in make_batches(spec, 0, 0, steps):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(x.to(device))
        loss = loss_fn(spec, out, y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}, losses


def _max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item()
               for k in b)


def check_nccl(spec, device, steps):
    want_backend = "nccl" if device.type == "cuda" else "gloo"
    got, _ = _train_meshzero(spec, _config(), device, steps)
    ref, _ = _train_plain(spec, device, steps, bf16=False)
    backend = dist.get_backend()
    err = _max_rel(got, ref)
    return backend == want_backend and err < 1e-4, f"backend {backend}, max rel diff {err:.2e}"


def check_bf16(spec, device, steps):
    cfg = _config()
    cfg["bf16"] = {"enabled": True}
    _, got = _train_meshzero(spec, cfg, device, steps)
    _, ref = _train_plain(spec, device, steps, bf16=True)
    err = max(abs(g - r) / abs(r) for g, r in zip(got, ref, strict=True))
    return err < 2e-2, f"losses {got[-1]:.4f} vs autocast {ref[-1]:.4f}, max rel {err:.2e}"


def _offload(spec, device, steps, where: dict) -> tuple[bool, str]:
    base, _ = _train_meshzero(spec, _config(), device, steps)
    pin = device.type == "cuda"
    zero = {"offload_optimizer": {**where, "pin_memory": pin},
            "offload_param": {**where, "pin_memory": pin}}
    got, _ = _train_meshzero(spec, _config(**zero), device, steps)
    err = _max_rel(got, base)
    return err < 1e-4, f"pinned {pin}, max rel diff to no offload {err:.2e}"


def check_cpu_offload(spec, device, steps):
    return _offload(spec, device, steps, {"device": "cpu"})


def check_nvme_offload(spec, device, steps):
    with tempfile.TemporaryDirectory(prefix="meshzero_gpu_check_") as tmp:
        return _offload(spec, device, steps, {"device": "nvme", "nvme_path": tmp})


def check_gpt_offload(spec, device, steps):
    warmup = 2
    pin = device.type == "cuda"
    cfg = _config(offload_optimizer={"device": "cpu", "pin_memory": pin},
                  offload_param={"device": "cpu", "pin_memory": pin})
    cfg["train_micro_batch_size_per_gpu"] = spec.batch
    cfg["bf16"] = {"enabled": True}
    # the profiler prints its report (memory, comm, FLOPs) of step warmup - 1, which step
    # warmup - 2 counts the FLOPs of: both inside the warm-up, out of the timed steps
    cfg["flops_profiler"] = {"enabled": True, "profile_step": warmup - 1, "detailed": False,
                             "peak_flops": H200_BF16_DENSE}
    model = build_model(spec, seed=0)
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    times = []
    for i, (x, y) in enumerate(make_batches(spec, 0, 0, warmup + steps)):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.backward(loss_fn(spec, engine(x.to(device)), y.to(device)))
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    prof = engine.last_profile
    engine.close()
    if prof is None:
        return False, "the flops profiler produced no report"
    step = statistics.median(times)
    flops = prof.fwd_flops_per_rank + prof.bwd_flops_per_rank + prof.recompute_flops_per_rank
    mfu = flops / step / H200_BF16_DENSE
    params = sum(p.numel() for p in build_model(spec, seed=0).parameters())
    return step > 0 and flops > 0, (
        f"{params / 1e6:.1f} M params, batch {spec.batch}x{spec.seq}, median step "
        f"{step * 1e3:.1f} ms over {len(times)}, {flops / 1e9:.2f} GFLOP "
        f"per step (fwd + bwd), MFU {mfu:.2%} of {H200_BF16_DENSE / 1e12:.0f} TFLOP/s "
        f"(the profiler's own: {prof.mfu:.2%})")


CHECKS = {"nccl": check_nccl, "bf16": check_bf16, "cpu_offload": check_cpu_offload,
          "nvme_offload": check_nvme_offload, "gpt_offload": check_gpt_offload,
          "offload_speed": check_offload_speed,  # gpu_offload_speed.py: the 1.28 B GPT
          "profiler_truth": check_profiler_truth,  # gpu_profiler_truth.py
          "quantized": check_quantized}  # gpu_quantized.py: ZeRO++ qwZ + qgZ


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny models (the script's own check)")
    p.add_argument("--checks", default=",".join(CHECKS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--gpt-batch", type=int, default=8)
    p.add_argument("--gpt-seq", type=int, default=1024)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"FAIL: torch {torch.__version__} sees no CUDA device (torch.version.cuda = "
              f"{torch.version.cuda}); install a CUDA build of torch (nothing is downloaded "
              "here)")
        return 1
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks compare to fp32 references
    init_distributed("nccl" if args.device == "cuda" else "gloo")
    small = gpt_spec(tiny=True)
    gpt = gpt_spec(tiny=True) if args.tiny else gpt_spec(batch=args.gpt_batch, seq=args.gpt_seq)
    failed = []
    for name in [c.strip() for c in args.checks.split(",") if c.strip()]:
        t0 = time.perf_counter()
        try:
            ok, line = CHECKS[name](gpt if name == "gpt_offload" else small, device, args.steps)
        except Exception as exc:  # report every check, not only the first failure
            ok, line = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print(f"{'PASS' if ok else 'FAIL'} {name:13s} {time.perf_counter() - t0:6.1f} s  {line}",
              flush=True)
        if not ok:
            failed.append(name)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"gpu_check: {len(failed)} failed {failed}" if failed else "gpu_check: all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
