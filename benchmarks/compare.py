"""meshzero vs PyTorch FSDP2 vs DeepSpeed, side by side: same model, data, steps, world size
and threads per rank, one system after another, each under torchrun (gloo on CPU).

    python benchmarks/compare.py                                  # GPT ~84 M, W=2, ZeRO-2 and 3
    python benchmarks/compare.py --model mlp                      # issue 6's 16.8 M MLP baseline
    python benchmarks/compare.py --nproc 4 --stages 3 --bf16 --write-results
    python benchmarks/compare.py --systems meshzero,fsdp2 --tiny --steps 2 --warmup 1   # CI

Flags: --model gpt|mlp, --hidden --layers --heads --vocab --seq --batch (per rank) override the
model; --tiny shrinks it to a few hundred K parameters; --nproc ranks; --threads
OMP_NUM_THREADS per rank (default 1); --steps timed steps after --warmup; --stages 2 3;
--offload none|cpu|both; --bf16 (bf16 compute, fp32 master and fp32 gradient reduction in
every system); --systems meshzero,fsdp2,deepspeed; --repeat R runs everything R times in
alternating order and keeps each row's fastest run; --wait-idle S waits up to S seconds before
each run for other processes to go quiet (the "other load" column is the share of the
machine's CPU time that processes other than the benchmark used during the run: on a shared
2-core machine a busy neighbour changes every time); --write-results appends the table, the
command and the machine to benchmarks/RESULTS.md; --profile PREFIX writes a cProfile of rank
0's timed steps per system and stage (read it with ``python -m pstats``).

What each column is, per system and stage (AdamW, fused on CPU, in every system):

- step s: the median over the timed steps of the slowest rank's wall time of one step
  (forward, backward, optimizer step, zeroing the gradients).
- model states/rank: bytes of parameters, fp32 master, gradients and optimizer states that rank
  0 holds. meshzero: the sum of ``memory_report()``'s categories. FSDP2: the local shards of
  the DTensor parameters, gradients and optimizer states, taken after backward. DeepSpeed: its
  flat partitions (ZeRO-2: full 16-bit flat params, fp32 master partition, reduced gradient
  partitions; ZeRO-3: param partitions + persistent params, fp32 master, gradient partition
  buffer) plus the optimizer's state, storages counted once, taken after backward.
- peak RSS/rank: ``ru_maxrss``, the maximum over ranks (interpreter and torch included).
- comm/step/rank: bytes one rank sends per step under ring algorithms (all-gather and
  reduce-scatter B (N-1)/N, all-reduce 2B (N-1)/N, as meshzero's comm_report counts).
  meshzero: its ``comm_report()`` of the last timed step. FSDP2 and DeepSpeed: measured by
  a TorchDispatchMode that sees every c10d collective of one extra, untimed step (the same
  counter checks meshzero's own figure; a mismatch is printed under the table).
- exposed comm s: meshzero only, the median time per step the caller was blocked in waits.
- no-comm limit: the same per-rank work (one rank's batch) in one process with the same
  threads, no sharding and a plain ``torch.optim.AdamW(fused=True)`` (``torch.autocast`` to
  bf16 with --bf16). With more ranks than cores the ranks share cores and the limit is not a
  fair floor; the table says so.

DeepSpeed runs only where ``import deepspeed`` works (it is not a dependency of meshzero).
meshzero refuses offload keys today, so its offload rows say so; FSDP2's CPUOffloadPolicy is
tried in a one-process probe first and reported with its error where it cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _models import ModelSpec, build_model, gpt_spec, loss_fn, make_batches, mlp_spec
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("meshzero", "fsdp2", "deepspeed")
LR, WEIGHT_DECAY = 1e-4, 0.01


# -- counting collectives ------------------------------------------------------------------------
def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(_nbytes(t) for t in x)
    return 0


class CommCounter(TorchDispatchMode):
    """Ring bytes one rank sends, per collective kind, from the c10d ops seen at dispatch."""

    # c10d op -> (kind, index of the "full" argument, factor of B (N-1)/N)
    OPS = {"_allgather_base_": ("all_gather", 0, 1), "allgather_": ("all_gather", 0, 1),
           "allgather_into_tensor_coalesced_": ("all_gather", 0, 1),
           "_reduce_scatter_base_": ("reduce_scatter", 1, 1),
           "reduce_scatter_": ("reduce_scatter", 1, 1),
           "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 1),
           "allreduce_": ("all_reduce", 0, 2), "allreduce_coalesced_": ("all_reduce", 0, 2),
           "broadcast_": ("broadcast", 0, None)}

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._opname
            kind, idx, factor = self.OPS.get(name, (name, None, None))
            full = _nbytes(args[idx]) if idx is not None else 0
            if name == "allgather_" or name == "reduce_scatter_":
                full = _nbytes(args[idx][0])  # list of per-rank lists: one rank's view
            n = self.world
            sent = full if factor is None else factor * full * (n - 1) // n
            self.bytes[kind] = self.bytes.get(kind, 0) + sent
        return func(*args, **(kwargs or {}))


# -- the systems ---------------------------------------------------------------------------------
class Meshzero:
    def __init__(self, model, spec: ModelSpec, job: dict):
        import meshzero

        config = {"train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW",
                                "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
                  "bf16": {"enabled": job["bf16"]}, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": job["stage"]}}
        self.spec = spec
        self.engine, *_ = meshzero.initialize(model=model, config=config)

    def forward_backward(self, x, y) -> float:
        loss = loss_fn(self.spec, self.engine(x), y)
        self.engine.backward(loss)
        return loss.item()

    def optimizer_step(self) -> None:
        self.engine.step()

    def state_bytes(self) -> int:
        return sum(v["device"] + v["host"] + v["nvme"]
                   for v in self.engine.memory_report().values() if isinstance(v, dict))

    def comm_report(self) -> dict:
        return self.engine.comm_report()


class FSDP2:
    def __init__(self, model, spec: ModelSpec, job: dict):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kw = {}
        if job["bf16"]:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        if job["offload"]:
            kw["offload_policy"] = CPUOffloadPolicy()
        reshard = job["stage"] == 3  # ZeRO-2 equivalent: keep params gathered fwd -> bwd
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard, **kw)
        fully_shard(model, reshard_after_forward=reshard, **kw)
        self.model, self.spec = model, spec
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                     fused=True)

    def forward_backward(self, x, y) -> float:
        loss = loss_fn(self.spec, self.model(x), y)
        loss.backward()
        return loss.item()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        def local(t):
            return _nbytes(t.to_local() if hasattr(t, "to_local") else t)

        total = sum(local(p) + (local(p.grad) if p.grad is not None else 0)
                    for p in self.model.parameters())
        return total + sum(local(t) for s in self.opt.state.values() for t in s.values()
                           if isinstance(t, torch.Tensor))


class DeepSpeed:
    def __init__(self, model, spec: ModelSpec, job: dict):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        zero = {"stage": job["stage"]}
        config = {"train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": zero, "steps_per_print": 10**9,
                  "bf16": {"enabled": job["bf16"]}}
        if job["bf16"]:
            config["communication_data_type"] = "fp32"  # as meshzero's and FSDP2's reduction
        optimizer = None
        if job["offload"]:  # DeepSpeedCPUAdam, DeepSpeed's own optimizer for ZeRO-Offload
            zero["offload_optimizer"] = {"device": "cpu"}
            config["optimizer"] = {"type": "AdamW",
                                   "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                          fused=True)
        self.engine, self.opt, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                         config=config)
        self.spec, self.bf16, self.stage = spec, job["bf16"], job["stage"]

    def forward_backward(self, x, y) -> float:
        if self.bf16 and x.is_floating_point():
            x = x.to(torch.bfloat16)
        loss = loss_fn(self.spec, self.engine(x), y)
        self.engine.backward(loss)
        return loss.item()

    def optimizer_step(self) -> None:
        self.engine.step()

    def state_bytes(self) -> int | None:
        o = self.opt
        if self.stage == 3:
            held = [o.fp16_partitioned_groups_flat, o.fp32_partitioned_groups_flat,
                    o.grad_partitions_flat_buffer,
                    [p.data for p in self.engine.module.parameters()
                     if p.ds_persist]]  # persistent params stay whole
        else:
            held = [o.bit16_groups_flat, o.single_partition_of_fp32_groups,
                    list(o.averaged_gradients.values())]
        held.append([t for s in o.optimizer.state.values() for t in s.values()])
        seen: dict[int, int] = {}

        def walk(x):
            if isinstance(x, torch.Tensor) and x.numel():
                st = x.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
            elif isinstance(x, list | tuple):
                for y in x:
                    walk(y)

        walk(held)
        return sum(seen.values())


class NoComm:
    """One process, no sharding: the same per-rank work with plain fused AdamW."""

    def __init__(self, model, spec: ModelSpec, job: dict):
        self.model, self.spec, self.bf16 = model, spec, job["bf16"]
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                     fused=True)

    def forward_backward(self, x, y) -> float:
        ctx = torch.autocast("cpu", torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with ctx:
            out = self.model(x)
        loss = loss_fn(self.spec, out, y)
        loss.backward()
        return loss.item()

    optimizer_step = FSDP2.optimizer_step
    state_bytes = FSDP2.state_bytes


RUNNERS = {"meshzero": Meshzero, "fsdp2": FSDP2, "deepspeed": DeepSpeed, "nocomm": NoComm}


# -- one run (a rank) ----------------------------------------------------------------------------
def _spec(job: dict) -> ModelSpec:
    make = gpt_spec if job["model"] == "gpt" else mlp_spec
    return make(job["tiny"], **job["sizes"])


def worker(job: dict) -> None:
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(job["threads"])
    spec = _spec(job)
    n_steps = job["warmup"] + job["steps"]
    batches = make_batches(spec, job["seed"], rank, n_steps + 1)
    model = build_model(spec, job["seed"])
    psi = sum(p.numel() for p in model.parameters())
    run = RUNNERS[job["system"]](model, spec, job)
    times, exposed, loss = [], [], 0.0
    profile = None
    for i, (x, y) in enumerate(batches[:n_steps]):
        if i == job["warmup"] and job.get("profile") and rank == 0:
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        t0 = time.perf_counter()
        loss = run.forward_backward(x, y)
        run.optimizer_step()
        times.append(time.perf_counter() - t0)
        if isinstance(run, Meshzero):
            exposed.append(sum(v["exposed_seconds"] for v in run.comm_report().values()))
    if profile is not None:
        profile.disable()
        profile.dump_stats(f"{job['profile']}.{job['system']}.zero{job['stage']}.prof")
    own_comm = run.comm_report() if isinstance(run, Meshzero) else None  # last timed step
    counter = CommCounter(world)
    with counter:  # one extra, untimed step: count the collectives, take the model states
        run.forward_backward(*batches[n_steps])
        states = run.state_bytes()
        run.optimizer_step()
    mine = {"times": times, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        result = {"psi": psi, "step_s": statistics.median(
                      max(r["times"][i] for r in everyone) for i in range(job["warmup"], n_steps)),
                  "states": states, "rss": max(r["rss"] for r in everyone), "loss": loss,
                  "counted": counter.bytes,
                  "own_comm": {k: v["bytes"] for k, v in own_comm.items()} if own_comm else None,
                  "own_exposed": {k: round(v["exposed_seconds"], 4) for k, v in own_comm.items()}
                  if own_comm else None,
                  "exposed_s": statistics.median(exposed[job["warmup"]:]) if exposed else None}
        print("RESULT " + json.dumps(result), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown of torch (seconds per rank on 2 cores)


# -- the driver ----------------------------------------------------------------------------------
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
    cmd = [sys.executable, __file__, "--worker", json.dumps(job)]
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
            return f"cannot run here: `{type(e).__name__}: {str(e).splitlines()[0]}`"
        finally:
            dist.destroy_process_group()


def meshzero_offload_note() -> str:
    import meshzero

    try:
        meshzero.load_config({"train_batch_size": 2, "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu"}}})
    except ValueError as e:
        msg = [ln for ln in str(e).splitlines() if "offload" in ln]
        return "not supported yet: " + (f"`{msg[0].strip()}`" if msg else "config refused")
    return "accepted by the config, but not run by this benchmark"


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


def _plan(args) -> tuple[list[dict], list[tuple[dict, dict, int | None]]]:
    """Rows of the table, and the (row, job, nproc) runs that fill them."""
    base = {"model": args.model, "tiny": args.tiny, "sizes": args.sizes, "seed": args.seed,
            "threads": args.threads, "steps": args.steps, "warmup": args.warmup,
            "bf16": args.bf16, "profile": args.profile and os.path.abspath(args.profile)}
    notes = {"deepspeed": deepspeed_note() if "deepspeed" in args.systems else None}
    offloads = {"none": [False], "cpu": [True], "both": [False, True]}[args.offload]
    if True in offloads:
        notes["meshzero_offload"] = meshzero_offload_note()
        if "fsdp2" in args.systems:
            notes["fsdp2_offload"] = fsdp2_offload_note()
    rows, runs = [], []
    for stage in args.stages:
        for offload in offloads:
            for system in args.systems:
                row = {"system": system, "stage": stage, "offload": offload}
                skip = notes["deepspeed"] if system == "deepspeed" else None
                skip = skip or (notes.get(f"{system}_offload") if offload else None)
                if skip:
                    row["note"] = skip
                else:
                    runs.append((row, dict(base, system=system, stage=stage, offload=offload),
                                 args.nproc))
                rows.append(row)
    nocomm = {"system": "nocomm", "stage": 0, "offload": False}
    rows.append(nocomm)
    runs.append((nocomm, dict(base, system="nocomm", stage=0, offload=False), None))
    if args.nproc > 1 and not args.tiny:  # N independent processes at once: sharing cores
        both = {"system": "nocomm_concurrent", "stage": 0, "offload": False}
        rows.append(both)
        runs.append((both, dict(base, system="nocomm", stage=0, offload=False), args.nproc))
    return rows, runs


def run_all(args) -> tuple[list[dict], dict]:
    """Every run ``--repeat`` times, in alternating order; a row keeps its fastest run."""
    rows, runs = _plan(args)
    for rep in range(args.repeat):
        for row, job, nproc in runs if rep % 2 == 0 else runs[::-1]:
            busy = wait_for_idle(args.wait_idle)
            label = f"{job['system']}{'' if nproc else ' (1 process)'} ZeRO-{job['stage']}"
            print(f"[{rep + 1}/{args.repeat}] {label}{' offload' if job['offload'] else ''} "
                  f"(other load before {busy:.0%}) ...", file=sys.stderr, flush=True)
            result = launch(job, nproc, args.timeout)
            if "error" in result:
                row["error"] = result["error"]  # a failure in any repeat fails the run
            elif "step_s" not in row or result["step_s"] < row["step_s"]:
                row.update(result)
    nocomm = next(r for r in rows if r["system"] == "nocomm")
    both = next((r for r in rows if r["system"] == "nocomm_concurrent"), None)
    if both is not None:
        nocomm["concurrent"] = both
    return [r for r in rows if not r["system"].startswith("nocomm")], nocomm


# -- the table -----------------------------------------------------------------------------------
def _mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 1e6:,.2f} MB"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def _comm_kinds(row: dict) -> dict | None:
    """Bytes per collective kind: meshzero's own report, the c10d counter for the others."""
    return row.get("own_comm") if row["system"] == "meshzero" else row.get("counted")


def _comm(row: dict) -> int | None:
    src = _comm_kinds(row)
    return None if src is None else sum(src.values())


def render(rows: list[dict], nocomm: dict, args) -> str:
    ok = [r for r in rows if "step_s" in r]
    ref = {r["stage"]: r for r in ok if r["system"] == "meshzero" and not r["offload"]}
    best = f", best of {args.repeat} runs" if args.repeat > 1 else ""
    head = (f"| system | ZeRO | offload | step s (median{best}) | x meshzero | model states/rank | "
            "x meshzero | peak RSS/rank | comm/step/rank | x meshzero | exposed comm s | "
            "loss | other load |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        name, off = r["system"], ("cpu" if r["offload"] else "-")
        if "step_s" not in r:
            lines.append(f"| {name} | {r['stage']} | {off} | "
                         + (r.get("note") or "failed: " + r.get("error", "?")) + " |" * 10)
            continue
        m = ref.get(r["stage"], {})
        exposed = "-" if r.get("exposed_s") is None else f"{r['exposed_s']:.3f}"
        lines.append(
            f"| {name} | {r['stage']} | {off} | {r['step_s']:.3f} | "
            f"{_ratio(r['step_s'], m.get('step_s'))} | {_mb(r['states'])} | "
            f"{_ratio(r['states'], m.get('states'))} | {_mb(r['rss'])} | {_mb(_comm(r))} | "
            f"{_ratio(_comm(r), _comm(m) if m else None)} | {exposed} | {r['loss']:.4f} | "
            f"{r['other_load']:.0%} |")
    if "step_s" in nocomm:
        lines.append(f"| no-comm limit (1 process) | - | - | {nocomm['step_s']:.3f} | - | "
                     f"{_mb(nocomm['states'])} | - | {_mb(nocomm['rss'])} | 0 | - | - | "
                     f"{nocomm['loss']:.4f} | {nocomm['other_load']:.0%} |")
    else:
        lines.append("| no-comm limit (1 process) | - | - | failed: "
                     + nocomm.get("error", "?") + " |" * 10)
    both = nocomm.get("concurrent")
    if both and "step_s" in both:
        lines.append(f"| no-comm, {args.nproc} processes at once | - | - | {both['step_s']:.3f} "
                     f"| - | {_mb(both['states'])} | - | {_mb(both['rss'])} | 0 | - | - | "
                     f"{both['loss']:.4f} | {both['other_load']:.0%} |")
    return "\n".join(lines + [""] + summary(ok, nocomm, args))


def summary(ok: list[dict], nocomm: dict, args) -> list[str]:
    out = []
    limit = nocomm.get("step_s")
    out += [f"- {r['system']} ZeRO-{r['stage']}{' offload' if r['offload'] else ''} failed in "
            f"a repeat: {r['error']}" for r in ok if r.get("error")]
    for stage in args.stages:
        by = {(r["system"], r["offload"]): r for r in ok if r["stage"] == stage}
        mz = by.get(("meshzero", False))
        if mz is None:
            continue
        others = [by[k] for k in (("fsdp2", False), ("deepspeed", False)) if k in by]
        if others:
            best = min(others, key=lambda r: r["step_s"])
            out.append(f"- ZeRO-{stage}: meshzero step / fastest other ({best['system']}) = "
                       f"{mz['step_s'] / best['step_s']:.2f}"
                       + (" (target <= 0.95)" if stage == 3 else "")
                       + f"; model states / smallest other = "
                       f"{mz['states'] / min(r['states'] or 1e30 for r in others):.3f}")
        if limit:
            vs = ", ".join(f"{r['system']}{' offload' if r['offload'] else ''} "
                           f"{r['step_s'] / limit:.2f}x" for r in by.values())
            out.append(f"- ZeRO-{stage} step / no-comm limit ({limit:.3f} s): {vs}"
                       + (" (target for meshzero <= 1.5x at W=2)" if args.nproc == 2 else ""))
        both = (nocomm.get("concurrent") or {}).get("step_s")
        if both:
            out.append(f"- ZeRO-{stage} meshzero step / no-comm with {args.nproc} processes at "
                       f"once ({both:.3f} s): {mz['step_s'] / both:.2f}x")
        out.append(f"- ZeRO-{stage} bytes per collective kind: " + "; ".join(
            f"{r['system']}{' offload' if r['offload'] else ''} "
            + ", ".join(f"{k} {_mb(v)}" for k, v in sorted((_comm_kinds(r) or {}).items()) if v)
            for r in by.values()))
        if mz.get("own_exposed"):
            out.append(f"- ZeRO-{stage} meshzero exposed comm seconds by op (last timed step): "
                       + ", ".join(f"{k} {v:.3f}" for k, v in mz["own_exposed"].items()))
        own, counted = mz.get("own_comm") or {}, mz.get("counted") or {}
        if own != {k: v for k, v in counted.items() if k in own or v}:
            out.append(f"- ZeRO-{stage}: meshzero comm_report {own} differs from the c10d "
                       f"counter {counted}")
    if args.nproc > (os.cpu_count() or 1) // args.threads:
        out.append(f"- {args.nproc} ranks x {args.threads} thread(s) on {os.cpu_count()} cores: "
                   "ranks share cores, so the one-process no-comm limit is not a fair floor.")
    return out


def machine() -> str:
    version = deepspeed_version()[0]
    extra = f", DeepSpeed {version}" if version else ", DeepSpeed not installed"
    return (f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), "
            f"PyTorch {torch.__version__}{extra}, Python {platform.python_version()}, gloo")


def write_results(table: str, args, psi: int | None) -> None:
    cmd = "python benchmarks/compare.py " + shlex.join(sys.argv[1:])
    what = f"{args.model.upper()}{' (tiny)' if args.tiny else ''}"
    size = f", psi = {psi:,} parameters" if psi else ""
    text = (f"\n## compare.py: {what} at W={args.nproc}{', bf16' if args.bf16 else ', fp32'}\n\n"
            f"{datetime.date.today().isoformat()}; {machine()}; {args.threads} thread(s) per "
            f"rank; {args.warmup} warm-up + {args.steps} timed steps{size}.\n\n"
            f"```\n{cmd}\n```\n\n{table}\n")
    with open(Path(__file__).with_name("RESULTS.md"), "a") as f:
        f.write(text)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    for name in ("hidden", "layers", "heads", "vocab", "seq", "batch"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3], choices=(2, 3))
    p.add_argument("--offload", choices=("none", "cpu", "both"), default="both")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per system run")
    p.add_argument("--repeat", type=int, default=1,
                   help="run everything R times, alternating the order; keep each row's fastest")
    p.add_argument("--wait-idle", type=float,
                   help="seconds to wait before each run for other processes to go quiet "
                        "(default 120, 0 with --tiny)")
    p.add_argument("--write-results", action="store_true")
    p.add_argument("--profile", metavar="PREFIX",
                   help="cProfile rank 0's timed steps into PREFIX.<system>.zero<stage>.prof")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "vocab", "seq",
                                                "batch")}
    if args.wait_idle is None:
        args.wait_idle = 0 if args.tiny else 120
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    rows, nocomm = run_all(args)
    psi = next((r["psi"] for r in rows + [nocomm] if "psi" in r), None)
    table = render(rows, nocomm, args)
    print(table)
    if args.write_results:
        write_results(table, args, psi)
    failed = [r for r in rows if "error" in r] + ([nocomm] if "error" in nocomm else [])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
