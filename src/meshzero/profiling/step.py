"""Profile one whole optimizer step of an engine, or one forward/backward of a plain module.

The engine starts a :class:`StepProfiler` at the first micro-step of ``profile_step`` and
finishes it after ``step()``; other steps carry no hooks and no dispatch mode. The only
collective the profiler adds is one all-gather of each rank's numbers at the end (for the
min / max / sum across ranks), counted in its own statistics, not in the step's.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshzero.comm import CommStats, Communicator
from meshzero.profiling.flops import FlopCounter, device_peak_flops
from meshzero.profiling.report import ModuleRow, ProfileReport

logger = logging.getLogger(__name__)

_SHARDS = {0: "nothing (plain data parallelism)", 1: "optimizer states",
           2: "gradients and optimizer states", 3: "parameters, gradients and optimizer states"}


def describe_zero(stage: int | None, dp: int, shard: int | None = None, tp: int = 1,
                  pp: int = 1) -> str:
    if stage is None:
        return "not used (a plain module)"
    shard = dp if shard is None else shard
    where = (f"over {dp} data-parallel ranks" if shard == dp else
             f"over blocks of {shard} of the {dp} data-parallel ranks, replicated across blocks")
    model = ("this is data parallelism, not model parallelism" if tp == pp == 1 else
             f"the model itself is split tp={tp} x pp={pp} ways before ZeRO shards each piece")
    return f"ZeRO-{stage} shards {_SHARDS[stage]} {where}: {model}"


def model_numel(engine) -> int:
    """Parameters of the whole model: this rank's local ones, summed over the tp and pp
    ranks with a tensor every tp rank holds, or two pp stages tie, counted once."""
    weights = engine.norm_weights
    local = sum(p.numel() * (1.0 if weights is None else weights[id(p)])
                for p in engine.module.parameters())
    total = torch.tensor([local], dtype=torch.float64, device=engine.device)
    for comm in engine.model_parallel_comms:  # counted apart from the step's traffic
        Communicator(comm.group, comm.name, CommStats()).all_reduce(total).wait()
    return round(total.item())


def peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA allocator peak"
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def tokens_per_sample(args: tuple, kwargs: dict) -> int:
    """Tokens in one sample of the first tensor input: (B, T) token ids -> T; (B, T, D)
    features -> T; (B, D) -> 1."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            dims = value.shape[1:] if not value.is_floating_point() else value.shape[1:-1]
            return max(1, math.prod(dims))
    return 1


def module_rows(root: nn.Module, counter: FlopCounter, held: dict[int, int]) -> list[ModuleRow]:
    """One row per module: params of the model and held by this rank, FLOPs and latency.
    ``held`` maps id(param) -> elements of it this rank holds at rest. A container that is
    never called itself (a ModuleList) shows the sum of its children's FLOPs and time."""
    rows: dict[str, ModuleRow] = {}
    for path, module in reversed(list(root.named_modules())):  # children before parents
        params = list(module.parameters())  # deduplicated: a shared parameter counts once
        row = ModuleRow(
            path=path, depth=0 if not path else path.count(".") + 1,
            params_model=sum(p.numel() for p in params),
            params_per_rank=sum(held.get(id(p), p.numel()) for p in params),
            fwd_flops=counter.module_flops("forward", path),
            bwd_flops=counter.module_flops("backward", path),
            recompute_flops=counter.module_flops("recompute", path),
            fwd_latency_s=counter.latency["forward"][path],
            bwd_latency_s=counter.latency["backward"][path])
        if path not in counter.latency["forward"]:  # never called: add up its children
            kids = [rows[f"{path}.{n}" if path else n] for n, _ in module.named_children()]
            for name in ("fwd_flops", "bwd_flops", "recompute_flops", "fwd_latency_s",
                         "bwd_latency_s"):
                setattr(row, name, sum(getattr(k, name) for k in kids))
        rows[path] = row
    return list(reversed(rows.values()))


def _gather_rank_numbers(values: dict[str, float], group,
                         device: torch.device) -> dict[str, list[float]]:
    """min, max and sum of every value over the ranks of ``group`` (one all-gather; on the
    rank's device, since NCCL cannot gather CPU tensors)."""
    local = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    world = 1 if not dist.is_initialized() else dist.get_world_size(group)
    if world == 1:
        return {k: [v, v, v] for k, v in values.items()}
    out = torch.empty(world * local.numel(), dtype=torch.float64, device=device)
    Communicator(group or dist.group.WORLD, "profiler", CommStats()).all_gather(out, local).wait()
    table = out.view(world, -1)
    return {k: [table[:, i].min().item(), table[:, i].max().item(), table[:, i].sum().item()]
            for i, k in enumerate(values)}


class StepProfiler:
    """Collects one step of an engine; :meth:`finish` returns the report."""

    def __init__(self, engine, profile_step: int):
        self.engine = engine
        self.profile_step = profile_step
        sync = torch.cuda.synchronize if engine.device.type == "cuda" else None
        self.counter = FlopCounter(engine.module, sync=sync)
        self.tokens = 1
        self.started_at = 0.0

    def start(self, args: tuple, kwargs: dict) -> None:
        self.tokens = tokens_per_sample(args, kwargs)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(self.engine.device)
        self.started_at = time.perf_counter()
        self.counter.start()

    def finish(self, times: dict[str, float]) -> ProfileReport:
        self.counter.stop()
        e = self.engine
        iter_s = time.perf_counter() - self.started_at
        fcfg = e.config.flops_profiler
        peak, peak_source = device_peak_flops(e.device, fcfg.peak_flops)
        held = e.zero.held_numel_by_param()
        c = self.counter
        flops = c.total("forward") + c.total("backward") + c.total("recompute")
        mem_peak, mem_source = peak_memory(e.device)
        comm = e.comm_report()
        total_s = sum(v["seconds"] for v in comm.values())
        exposed_s = sum(v["exposed_seconds"] for v in comm.values())
        rank_values = {
            "params_per_rank": e.zero.held_numel(),
            "fwd_flops_per_rank": c.total("forward"), "bwd_flops_per_rank": c.total("backward"),
            "iter_latency_s": iter_s, "flops_per_second_per_rank": flops / iter_s,
            "comm_bytes": sum(v["bytes"] for v in comm.values()),
            "peak_memory_bytes": mem_peak,
        }
        spread = _gather_rank_numbers(rank_values, None, e.device)
        samples_s = e.train_batch_size() / iter_s
        return ProfileReport(
            world_size=e.topology.world_size, data_parallel_size=e.topology.dp_size,
            tensor_parallel_size=e.topology.tp_size, pipeline_parallel_size=e.topology.pp_size,
            zero_stage=e.zero_stage, zero_description=describe_zero(
                e.zero_stage, e.dp_comm.size, e.comm.size, e.topology.tp_size,
                e.topology.pp_size),
            params_total=model_numel(e), params_per_rank=e.zero.held_numel(),
            gathered_params_peak=e.zero.memory.peak // e.compute_dtype.itemsize,
            fwd_flops_per_rank=c.total("forward"), bwd_flops_per_rank=c.total("backward"),
            recompute_flops_per_rank=c.total("recompute"), step_flops_per_rank=c.total("step"),
            fwd_flops_model=int(spread["fwd_flops_per_rank"][2]),
            bwd_flops_model=int(spread["bwd_flops_per_rank"][2]),
            fwd_latency_s=times["forward"], bwd_latency_s=times["backward"],
            step_latency_s=times["step"], iter_latency_s=iter_s,
            samples_per_second=samples_s, tokens_per_second=samples_s * self.tokens,
            flops_per_second_per_rank=flops / iter_s, peak_flops=peak,
            peak_flops_source=peak_source, mfu=flops / iter_s / peak,
            memory=e.memory_report(), peak_memory_bytes=mem_peak, peak_memory_source=mem_source,
            comm=comm, comm_hidden_fraction=(1 - exposed_s / total_s) if total_s else None,
            modules=module_rows(e.module, c, held),
            rank_min_max={k: v[:2] for k, v in spread.items()},
            profile_step=self.profile_step, module_depth=fcfg.module_depth,
            sequence_parallel_size=e.topology.sp_size, tokens_per_rank=(
                e.sequence_parallel.local_tokens if e.sequence_parallel else None),
            top_modules=fcfg.top_modules, detailed=fcfg.detailed)


def emit(report: ProfileReport, output_file: str | None) -> None:
    """Print on rank 0 and write the JSON file if ``output_file`` ends in ``.json``."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(report, flush=True)
    if output_file is not None:
        path = Path(output_file)
        if path.suffix == ".json":
            path.write_text(json.dumps(report.to_dict(), indent=2))
        else:
            path.write_text(str(report) + "\n")


def get_model_profile(model: nn.Module, args: tuple = (), kwargs: dict | None = None,
                      backward: bool = True, module_depth: int = -1, top_modules: int = 1,
                      peak_flops: float | None = None) -> ProfileReport:
    """Profile one forward (and a backward of the outputs' sum) of a plain module."""
    kwargs = kwargs or {}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    counter = FlopCounter(model, sync=sync)
    counter.start()
    try:
        sync()
        t0 = time.perf_counter()
        out = model(*args, **kwargs)
        sync()
        t1 = time.perf_counter()
        if backward:
            counter.set_phase("backward")
            tensors = [out] if isinstance(out, torch.Tensor) else [
                t for t in (out.values() if isinstance(out, dict) else out)
                if isinstance(t, torch.Tensor)]
            sums = [t.float().sum() for t in tensors if t.requires_grad]
            if not sums:
                raise ValueError("profiling a backward needs an output that requires grad; "
                                 "the model returned none")
            sum(sums[1:], sums[0]).backward()
            counter.set_phase("step")
        sync()
        t2 = time.perf_counter()
    finally:
        counter.stop()
    params = sum(p.numel() for p in model.parameters())
    flops = counter.total("forward") + counter.total("backward")
    peak, source = device_peak_flops(device, peak_flops)
    mem_peak, mem_source = peak_memory(device)
    batch = next((a.shape[0] for a in (*args, *kwargs.values())
                  if isinstance(a, torch.Tensor) and a.dim() >= 1), 1)
    samples_s = batch / (t2 - t0)
    return ProfileReport(
        world_size=1, data_parallel_size=1, tensor_parallel_size=1, pipeline_parallel_size=1,
        zero_stage=None, zero_description=describe_zero(None, 1), params_total=params,
        params_per_rank=params, gathered_params_peak=params,
        fwd_flops_per_rank=counter.total("forward"), bwd_flops_per_rank=counter.total("backward"),
        recompute_flops_per_rank=counter.total("recompute"), step_flops_per_rank=0,
        fwd_flops_model=counter.total("forward"), bwd_flops_model=counter.total("backward"),
        fwd_latency_s=t1 - t0, bwd_latency_s=t2 - t1, step_latency_s=0.0, iter_latency_s=t2 - t0,
        samples_per_second=samples_s, tokens_per_second=samples_s * tokens_per_sample(args, kwargs),
        flops_per_second_per_rank=flops / (t2 - t0), peak_flops=peak, peak_flops_source=source,
        mfu=flops / (t2 - t0) / peak, memory={}, peak_memory_bytes=mem_peak,
        peak_memory_source=mem_source, comm={}, comm_hidden_fraction=None,
        modules=module_rows(model, counter, {}), module_depth=module_depth,
        top_modules=top_modules)

