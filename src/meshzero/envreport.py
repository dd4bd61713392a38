"""``meshzero env``: what this machine offers meshzero, in the spirit of DeepSpeed's
``ds_report``: versions, backends, devices and their peak FLOP/s, fused optimizers, free space
where offload files would go, and which optional extras are installed."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import meshzero
from meshzero.profiling.peaks import device_peak_flops, measure_cpu_matmul_flops
from meshzero.profiling.report import si

SCRATCH_PATHS = ("/tmp", "/local_nvme", "/nvme", "/scratch", "/mnt")
EXTRAS = ("pytest", "matplotlib", "deepspeed", "transformers", "tqdm")

Row = tuple[str, str]


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def software_rows() -> list[Row]:
    return [
        ("meshzero", f"{meshzero.__version__} ({Path(meshzero.__file__).parent})"),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", platform.platform()),
        ("torch", f"{torch.__version__} ({Path(torch.__file__).parent})"),
    ]


def backend_rows() -> list[Row]:
    rows: list[Row] = []
    if torch.cuda.is_available():
        rows.append(("CUDA available", f"yes: CUDA {torch.version.cuda}, "
                                       f"{torch.cuda.device_count()} device(s)"))
    elif torch.version.cuda:
        rows.append(("CUDA available", f"no (torch built for CUDA {torch.version.cuda}, "
                                       "but no device is visible)"))
    else:
        rows.append(("CUDA available", "no (a CPU build of torch)"))
    rows.append(("NCCL", _nccl_version()))
    rows.append(("gloo", "available" if dist.is_gloo_available() else "not available"))
    rows.append(("backend meshzero picks", "nccl, one GPU per local rank"
                 if torch.cuda.is_available() else "gloo on the CPU"))
    return rows


def _nccl_version() -> str:
    if not dist.is_nccl_available():
        return "not available"
    try:
        version = torch.cuda.nccl.version()
    except Exception as exc:  # torch built with NCCL but the library cannot be loaded
        return f"available, version unknown ({exc})"
    text = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
    return f"available, version {text}"


def device_rows(measure_cpu: bool = True) -> list[Row]:
    rows: list[Row] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            device = torch.device("cuda", i)
            props = torch.cuda.get_device_properties(device)
            peak, source = device_peak_flops(device, None)
            rows.append((f"cuda:{i}", f"{props.name}, {si(props.total_memory, 'B')}"))
            rows.append((f"cuda:{i} peak FLOP/s",
                         source if peak is None else f"{si(peak, 'FLOP/s')} ({source})"))
    cpu = platform.processor() or platform.machine()
    rows.append(("cpu", f"{cpu}, {os.cpu_count()} logical cores, "
                        f"{torch.backends.cpu.get_cpu_capability()} kernels, "
                        f"torch uses {torch.get_num_threads()} threads"))
    if measure_cpu:
        rows.append(("cpu peak FLOP/s", f"{si(measure_cpu_matmul_flops(), 'FLOP/s')} (fp32 "
                                        f"matmul measured on this CPU, "
                                        f"{torch.get_num_threads()} threads)"))
    return rows


def fused_optimizer_rows() -> list[Row]:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows: list[Row] = []
    for device in devices:
        for cls in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
            rows.append((f"fused {cls.__name__} on {device}", _try_fused(cls, device)))
    return rows


def _try_fused(cls: type[torch.optim.Optimizer], device: str) -> str:
    """Build the optimizer with fused=True and take one step on a tiny parameter."""
    param = torch.nn.Parameter(torch.ones(8, device=device))
    param.grad = torch.full_like(param, 0.5)
    try:
        kwargs: dict[str, Any] = {"lr": 0.1, "fused": True}
        if cls is torch.optim.SGD:
            kwargs["momentum"] = 0.9
        cls([param], **kwargs).step()
    except Exception as exc:
        return f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    return "yes"


def storage_rows() -> list[Row]:
    """Free space on the usual NVMe and scratch mounts that exist here (and $TMPDIR)."""
    paths = list(SCRATCH_PATHS)
    tmpdir = os.environ.get("TMPDIR")
    if tmpdir and tmpdir not in paths:
        paths.append(tmpdir)
    rows: list[Row] = []
    for path in paths:
        if not os.path.isdir(path):
            continue
        try:
            usage = shutil.disk_usage(path)
        except OSError as exc:
            rows.append((f"free space {path}", f"unknown ({exc})"))
            continue
        label = f"free space {path}" + (" ($TMPDIR)" if path == tmpdir else "")
        rows.append((label, f"{si(usage.free, 'B')} of {si(usage.total, 'B')}"))
    return rows or [("free space", "none of " + ", ".join(SCRATCH_PATHS) + " exists")]


def extras_rows() -> list[Row]:
    return [(name, _version(name) or "not installed") for name in EXTRAS]


def report(measure_cpu: bool = True) -> str:
    sections = [("software", software_rows()), ("backends", backend_rows()),
                ("devices", device_rows(measure_cpu)), ("fused optimizers", fused_optimizer_rows()),
                ("storage for offload", storage_rows()), ("optional extras", extras_rows())]
    width = max(len(label) for _, rows in sections for label, _ in rows) + 4
    lines = [f"{'-' * 20} meshzero env {'-' * 20}"]
    for title, rows in sections:
        lines.append(f"[{title}]")
        lines += [f"{label + ' ':.<{width}} {value}" for label, value in rows]
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "env",
        description="Report torch, CUDA, NCCL and gloo, the devices and their peak FLOP/s, "
                    "fused optimizer support, free space on NVMe/scratch paths and the "
                    "optional extras installed.")
    p.add_argument("--no-measure", action="store_true",
                   help="skip the short matmul that measures the CPU's FLOP/s")
    return p


def run(args: argparse.Namespace) -> int:
    print(report(measure_cpu=not args.no_measure))
    return 0
