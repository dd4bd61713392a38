"""How ``benchmarks/compare.py`` runs one system: fresh processes under torchrun (or one
plain process for the no-communication limit), the share of the machine other processes used
meanwhile, and the probes that decide up front whether a row can run here at all."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _systems import describe

ROOT = Path(__file__).resolve().parent.parent
COMPARE = Path(__file__).with_name("compare.py")  # its --worker flag runs one rank


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines()
             if re.search(r"(Error|Exception)\b", ln) and "Traceback" not in ln]
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln) for ln in lines]
    if not lines:
        lines = text.strip().splitlines()[-1:] or ["failed"]
    return lines[0][:200]


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the whole machine was busy so far, CPU seconds of our waited children)."""
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    busy = (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")
    return busy, ch.ru_utime + ch.ru_stime


def launch(job: dict, nproc: int | None, timeout: float) -> dict:
    """Run one system in fresh processes and measure how much of the machine others used
    meanwhile (all busy CPU time minus what our ranks used, over wall time x cores)."""
    busy0, ours0 = _cpu_seconds()
    t0 = time.monotonic()
    result = _launch(job, nproc, timeout)
    busy1, ours1 = _cpu_seconds()
    wall = (time.monotonic() - t0) * (os.cpu_count() or 1)
    result["other_load"] = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall
    return result


def _launch(job: dict, nproc: int | None, timeout: float) -> dict:
    """Run one system in fresh processes; ``nproc`` None: one plain process, no torchrun."""
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]),
               MKL_NUM_THREADS=str(job["threads"]), DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(COMPARE), "--worker", json.dumps(job)]
    if nproc is not None:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        return {"error": _last_error(out.stderr + "\n" + out.stdout)}
    return json.loads(line[len("RESULT "):])


def deepspeed_version() -> tuple[str | None, str]:
    """(version, "") if ``import deepspeed`` works in a fresh interpreter, else (None, why)."""
    out = subprocess.run([sys.executable, "-c", "import deepspeed; print(deepspeed.__version__)"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DS_ACCELERATOR="cpu"))
    if out.returncode == 0:
        return out.stdout.strip().splitlines()[-1], ""
    return None, _last_error(out.stderr)


def deepspeed_note() -> str | None:
    version, why = deepspeed_version()
    return None if version else f"skipped: `import deepspeed` failed ({why})"


def fsdp2_offload_note() -> str | None:
    """FSDP2's CPUOffloadPolicy tried on one rank in this process: None if it trains."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            fully_shard(model, offload_policy=CPUOffloadPolicy())
            model(torch.randn(2, 4)).sum().backward()
            return None
        except Exception as e:  # noqa: BLE001 - reported in the table
            return f"unsupported here: {describe(e)}"
        finally:
            dist.destroy_process_group()


def _cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all cores busy over ``seconds`` (/proc/stat; 0 where it does not exist)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return 0.0
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_for_idle(max_wait: float) -> float:
    """Wait (up to ``max_wait`` s) until other processes use < 15% of the machine; returns
    the busy fraction seen last, which the table reports: other load skews every time."""
    deadline = time.monotonic() + max_wait
    busy = _cpu_busy()
    while busy > 0.15 and time.monotonic() < deadline:
        time.sleep(4)
        busy = _cpu_busy()
    return busy


