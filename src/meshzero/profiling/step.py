"""Profile one whole optimizer step of an engine, or one forward/backward of a plain module.

The engine starts a :class:`StepProfiler` at the first micro-step of step ``profile_step``
- 1, which counts FLOPs, and finishes it after the ``step()`` of ``profile_step``, which is
timed; other steps carry no hooks and no dispatch mode. The collectives the profiler adds
(one all-reduce of the model's size across tp / pp ranks when counting ends, one all-gather
of each rank's numbers at the end for the min / max / sum across ranks) are counted in their
own statistics, not in the step's.
"""

from __future__ import annotations

import json
import logging
import math
import resource
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshzero.comm import CommStats, Communicator
from meshzero.parallel.shards import is_tp_sharded
from meshzero.profiling.flops import FlopCounter
from meshzero.profiling.marks import ModuleTimer, marks_for, top_level_paths
from meshzero.profiling.monitor import tier_bytes
from meshzero.profiling.peaks import device_peak_flops
from meshzero.profiling.report import ModuleRow, ProfileReport
from meshzero.profiling.timing import StepClock, StepTime, timeline_for

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


def peak_memory(device: torch.device) -> tuple[int, int | None, str]:
    """(peak bytes, reserved peak bytes or None, where from): on CUDA the allocator's peaks
    since the profiled step began; on CPU the process's peak RSS (there is no allocator)."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
                "CUDA allocator peak during the profiled step")
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None, "process peak RSS"


def replicated_modules(root: nn.Module, tp_size: int) -> frozenset[str]:
    """Paths of modules every tensor-parallel rank runs whole: parameters, none of them a tp
    slice (an unsharded head, norms). Their FLOPs count once in model FLOPs."""
    if tp_size == 1:
        return frozenset()
    return frozenset(path for path, m in root.named_modules()
                     if (params := list(m.parameters()))
                     and not any(is_tp_sharded(p) for p in params))


def tokens_per_sample(args: tuple, kwargs: dict) -> int:
    """Tokens in one sample of the first tensor input: (B, T) token ids -> T; (B, T, D)
    features -> T; (B, D) -> 1."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            dims = value.shape[1:] if not value.is_floating_point() else value.shape[1:-1]
            return max(1, math.prod(dims))
    return 1


def module_rows(root: nn.Module, counter: FlopCounter, held: dict[int, int]
                ) -> tuple[list[ModuleRow], dict[str, list[str]]]:
    """One row per module, in tree order: params of the model and held by this rank, and
    FLOPs; latencies are filled in by :func:`time_rows`. ``held`` maps id(param) -> elements
    of it this rank holds at rest. Also, for each container never called itself (a
    ModuleList), its children's paths: its row shows their sum."""
    rows: list[ModuleRow] = []
    sums: dict[str, list[str]] = {}
    for path, module in root.named_modules():
        params = list(module.parameters())  # deduplicated: a shared parameter counts once
        rows.append(ModuleRow(
            path=path, depth=0 if not path else path.count(".") + 1,
            params_model=sum(p.numel() for p in params),
            params_per_rank=sum(held.get(id(p), p.numel()) for p in params),
            fwd_flops=counter.module_flops("forward", path),
            bwd_flops=counter.module_flops("backward", path),
            recompute_flops=counter.module_flops("recompute", path),
            fwd_latency_s=0.0, bwd_latency_s=None))
        if path not in counter.called:
            sums[path] = [f"{path}.{n}" if path else n for n, _ in module.named_children()]
    by_path = {r.path: r for r in rows}
    for row in reversed(rows):  # children before parents
        if (kids := sums.get(row.path)) is not None:
            for name in ("fwd_flops", "bwd_flops", "recompute_flops"):
                setattr(row, name, sum(getattr(by_path[k], name) for k in kids))
    return rows, sums


def time_rows(rows: list[ModuleRow], sums: dict[str, list[str]], timer: ModuleTimer) -> None:
    """Fill in each row's forward latency and, for the timer's ``backward_paths``, its
    backward latency (else None); a never-called container's are its children's sums."""
    fwd, bwd = timer.latency["forward"], timer.latency["backward"]
    by_path = {r.path: r for r in rows}
    for row in reversed(rows):  # children before parents
        kids = sums.get(row.path)
        if kids is None:
            row.fwd_latency_s = fwd.get(row.path, 0.0)
            row.bwd_latency_s = bwd.get(row.path) if row.path in timer.backward_paths else None
            continue
        row.fwd_latency_s = sum(by_path[k].fwd_latency_s for k in kids)
        timed = [t for k in kids if (t := by_path[k].bwd_latency_s) is not None]
        row.bwd_latency_s = sum(timed) if timed else None


def gather_rank_numbers(values: dict[str, float], device: torch.device) -> dict[str, list[float]]:
    """Every rank's value of every key, in rank order (one all-gather over the world; on the
    rank's device, since NCCL cannot gather CPU tensors; counted apart from the step)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return {k: [float(v)] for k, v in values.items()}
    local = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    out = torch.empty(world * local.numel(), dtype=torch.float64, device=device)
    Communicator(dist.group.WORLD, "profiler", CommStats()).all_gather(out, local).wait()
    table = out.view(world, -1).cpu()
    return {k: table[:, i].tolist() for i, k in enumerate(values)}


def flop_figures(counter: FlopCounter, tp_size: int) -> dict[str, Any]:
    """This rank's FLOPs: executed (hardware: fwd + bwd + recompute) and the model's share
    (fwd + bwd, work run whole on every tp rank counted 1/tp here, so the sum over ranks
    counts it once)."""
    once = (tp_size - 1) / tp_size
    fwd, bwd = counter.total("forward"), counter.total("backward")
    fwd_model = round(fwd - once * counter.replicated_total("forward"))
    bwd_model = round(bwd - once * counter.replicated_total("backward"))
    return {"fwd_flops_per_rank": fwd, "bwd_flops_per_rank": bwd,
            "recompute_flops_per_rank": counter.total("recompute"),
            "replicated_flops_per_rank": counter.replicated_total("forward")
            + counter.replicated_total("backward"),
            "fwd_flops_model_rank": fwd_model, "bwd_flops_model_rank": bwd_model,
            "model_flops_per_rank": fwd_model + bwd_model,
            "hardware_flops_per_rank": fwd + bwd + counter.total("recompute")}


def with_headline(r: ProfileReport, latency_s: float, steps: list[int], source: str,
                  final: bool) -> ProfileReport:
    """``r`` with its headline from a steady-state iteration latency: throughput, FLOP/s,
    MFU and HFU (job: all ranks' FLOPs over world size x peak; per rank: this rank's)."""
    peak = r.peak_flops

    def utilization(flops: float, devices: int) -> float | None:
        return None if peak is None else flops / (latency_s * devices * peak)

    samples = r.global_batch / latency_s
    return replace(
        r, iter_latency_s=latency_s, headline_steps=steps, headline_source=source,
        headline_final=final, samples_per_second=samples,
        tokens_per_second=samples * r.tokens_per_sample,
        model_flops_per_second_per_rank=r.model_flops_per_rank / latency_s,
        hardware_flops_per_second_per_rank=r.hardware_flops_per_rank / latency_s,
        mfu=utilization(r.model_flops, r.world_size),
        hfu=utilization(r.hardware_flops, r.world_size),
        mfu_per_rank=utilization(r.model_flops_per_rank, 1),
        hfu_per_rank=utilization(r.hardware_flops_per_rank, 1),
        profiled_step_overhead=r.profiled_step_s / latency_s,
        counting_step_overhead=(None if r.counting_step_s is None
                                else r.counting_step_s / latency_s))


def shape_signature(args: tuple, kwargs: dict) -> tuple:
    """The shapes of a call's tensor arguments (what decides its FLOPs), in order."""
    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return tuple(x.shape)
        if isinstance(x, list | tuple):
            return tuple(walk(i) for i in x)
        if isinstance(x, dict):
            return tuple((k, walk(v)) for k, v in x.items())
        return None
    return walk(args), walk(kwargs)


class StepProfiler:
    """Profiles ``profile_step`` P of an engine in two steps (docs/profiling.md): step P-1
    counts FLOPs (:meth:`start_counting`, a dispatch mode and module hooks: slow, so that
    step is not timed), step P is timed with cheap marks (:meth:`start_timing`), reusing P-1's
    counts when its inputs have the same shapes. At P = 0, or when the shapes differ, step P
    counts too, and the report says so. :meth:`finish` returns the report, its headline still
    the profiled step's own until :func:`with_headline` gives the steady state."""

    def __init__(self, engine, profile_step: int):
        self.engine = engine
        self.profile_step = profile_step
        self.counter: FlopCounter | None = None
        self.counting = False  # the dispatch mode is on
        self.flops_step: int | None = None
        self.flops_source = ""
        self.shapes: tuple | None = None  # the counting step's first inputs
        self.timer: ModuleTimer | None = None
        self.tokens = 1
        # what the counting step fixes, prepared when it ends (outside the timed step)
        self.rows: list[ModuleRow] = []
        self.sums: dict[str, list[str]] = {}
        self.flops: dict[str, Any] = {}
        self.params_total = 0

    # -- step P-1 (or P) ---------------------------------------------------------------------
    def start_counting(self, step: int, args: tuple, kwargs: dict) -> None:
        e = self.engine
        self.counter = FlopCounter(e.module, replicated_modules(e.module, e.topology.tp_size))
        self.flops_step, self.shapes = step, shape_signature(args, kwargs)
        self.tokens = tokens_per_sample(args, kwargs)
        self.counting = True
        self.counter.start()

    def stop_counting(self) -> None:
        """The end of the counting step: the mode goes, the next step's timer is made and
        its hooks registered here, outside the timed step."""
        self._end_count()
        self._make_timer()

    def _end_count(self) -> None:
        """The mode goes; the report's parts that the counts fix are prepared now: the
        module rows' params and FLOPs, the FLOP figures, the model's size."""
        assert self.counter is not None
        self.counter.stop()
        self.counting = False
        e = self.engine
        self.rows, self.sums = module_rows(e.module, self.counter, e.zero.held_numel_by_param())
        self.flops = flop_figures(self.counter, e.topology.tp_size)
        self.params_total = model_numel(e)

    def _make_timer(self) -> None:
        """The timer of step P, its hooks registered and its CUDA events made here. The pool
        holds the marks the counting step's calls would take (a step that needs more grows
        it: an event made in the step costs more, nothing else)."""
        e = self.engine
        assert self.counter is not None
        backward = top_level_paths(e.module)
        calls = self.counter.calls or sum(1 for _ in e.module.modules()) * e.grad_accum
        # enter + exit per forward call and per timed backward, a few phase marks per micro-step
        size = 2 * calls + (2 * len(backward) + 8) * e.grad_accum
        self.timer = ModuleTimer(e.module, marks_for(e.device, size), backward)
        self.timer.register()

    # -- step P --------------------------------------------------------------------------------
    def start_timing(self, args: tuple, kwargs: dict) -> None:
        p = self.profile_step
        if self.counter is None or shape_signature(args, kwargs) != self.shapes:
            self.flops_source = (
                f"counted in step {p} itself (no earlier step to count in: the overhead "
                "includes counting)" if self.counter is None else
                f"counted in step {p} itself: its inputs' shapes differ from step "
                f"{self.flops_step}'s (the overhead includes counting)")
            self.start_counting(p, args, kwargs)
            if self.timer is None:  # else step P-1 made it, with its hooks
                self._make_timer()
        else:
            self.flops_source = (f"counted in step {self.flops_step} (same input shapes), "
                                 f"not in the timed step {p}")
        if self.engine.device.type == "cuda":  # host-side bookkeeping: no synchronisation
            torch.cuda.reset_peak_memory_stats(self.engine.device)
        assert self.timer is not None
        self.timer.arm()

    def set_phase(self, phase: str) -> None:
        if self.counting:
            assert self.counter is not None
            self.counter.set_phase(phase)
        if self.timer is not None and self.timer.armed:
            self.timer.set_phase(phase)

    def end_backward(self) -> None:
        if self.counting:
            assert self.counter is not None
            self.counter.end_backward()
        if self.timer is not None and self.timer.armed:
            self.timer.end_backward()

    def stop(self) -> None:
        """Remove whatever is still hooked (the engine closes before step P ends)."""
        if self.counting:
            self.stop_counting()
        if self.timer is not None:
            self.timer.stop()

    def finish(self, step: StepTime, clock: StepClock) -> ProfileReport:
        """The report of ``step`` (the clock's record of the profiled step)."""
        assert self.timer is not None and self.counter is not None
        self.timer.stop()
        if self.counting:  # counted in this step
            self._end_count()
        self.timer.read()  # one wait, for the timer's last mark
        time_rows(self.rows, self.sums, self.timer)
        profiled_s = clock.seconds(step)
        counted = [s for s in clock.steps if s.step == self.flops_step and s.timed]
        counting_s = (clock.seconds(counted[-1]) if counted and self.flops_step != step.step
                      else None)
        report = self._report(profiled_s, self.counter, self.timer)
        return replace(report, counting_step_s=counting_s, flops_step=self.flops_step,
                       flops_source=self.flops_source)

    def _report(self, profiled_s: float, c: FlopCounter, timer: ModuleTimer) -> ProfileReport:
        e = self.engine
        times = timer.phase_latency
        fcfg = e.config.flops_profiler
        peak, peak_source = device_peak_flops(e.device, fcfg.peak_flops)
        flops = self.flops
        mem_peak, reserved, mem_source = peak_memory(e.device)
        memory = e.memory_report()
        comm = e.comm_report()
        total_s = sum(v["seconds"] for v in comm.values())
        exposed_s = sum(v["exposed_seconds"] for v in comm.values())
        rank_values = {
            "params_per_rank": e.zero.held_numel(), **flops,
            "comm_bytes": sum(v["bytes"] for v in comm.values()),
            "peak_memory_bytes": mem_peak, "reserved_memory_bytes": reserved or 0,
            "model_state_bytes": tier_bytes(memory)["device"], "profiled_step_s": profiled_s}
        per_rank = gather_rank_numbers(rank_values, e.device)
        report = ProfileReport(
            world_size=e.topology.world_size, data_parallel_size=e.topology.dp_size,
            tensor_parallel_size=e.topology.tp_size, pipeline_parallel_size=e.topology.pp_size,
            zero_stage=e.zero_stage, zero_description=describe_zero(
                e.zero_stage, e.dp_comm.size, e.comm.size, e.topology.tp_size,
                e.topology.pp_size),
            params_total=self.params_total, params_per_rank=e.zero.held_numel(),
            gathered_params_peak=e.zero.memory.peak // e.compute_dtype.itemsize,
            step_flops_per_rank=c.total("step"),
            **{k: v for k, v in flops.items() if not k.endswith("_model_rank")},
            fwd_flops_model=round(sum(per_rank["fwd_flops_model_rank"])),
            bwd_flops_model=round(sum(per_rank["bwd_flops_model_rank"])),
            model_flops=round(sum(per_rank["model_flops_per_rank"])),
            hardware_flops=round(sum(per_rank["hardware_flops_per_rank"])),
            fwd_latency_s=times["forward"], bwd_latency_s=times["backward"],
            step_latency_s=times["step"], profiled_step_s=profiled_s,
            peak_flops=peak, peak_flops_source=peak_source,
            memory=memory, peak_memory_bytes=mem_peak, peak_memory_source=mem_source,
            reserved_memory_bytes=reserved, model_state_bytes=rank_values["model_state_bytes"],
            comm=comm, comm_hidden_fraction=(1 - exposed_s / total_s) if total_s else None,
            global_batch=e.train_batch_size(), tokens_per_sample=self.tokens,
            modules=self.rows,
            rank_min_max={k: [min(per_rank[k]), max(per_rank[k])] for k in SPREAD_KEYS
                          if k != "reserved_memory_bytes" or reserved is not None},
            transfers=e.transfer_report() if hasattr(e, "transfer_report") else None,
            per_rank=per_rank, profile_step=self.profile_step, module_depth=fcfg.module_depth,
            sequence_parallel_size=e.topology.sp_size, tokens_per_rank=(
                e.sequence_parallel.local_tokens if e.sequence_parallel else None),
            top_modules=fcfg.top_modules, detailed=fcfg.detailed, **UNSET_HEADLINE)
        return with_headline(report, profiled_s, [self.profile_step],
                             "the profiled step itself (no steady-state step measured yet)",
                             final=False)


# the per-rank numbers whose min / max the summary prints (all are in ``per_rank``)
SPREAD_KEYS = ("params_per_rank", "fwd_flops_per_rank", "bwd_flops_per_rank",
               "model_flops_per_rank", "hardware_flops_per_rank", "comm_bytes",
               "peak_memory_bytes", "reserved_memory_bytes", "model_state_bytes",
               "profiled_step_s")

# placeholders that with_headline() fills in
UNSET_HEADLINE: dict = dict(
    iter_latency_s=0.0, headline_steps=[], headline_source="", headline_final=False,
    samples_per_second=0.0, tokens_per_second=0.0, model_flops_per_second_per_rank=0.0,
    hardware_flops_per_second_per_rank=0.0, mfu=None, hfu=None, mfu_per_rank=None,
    hfu_per_rank=None, profiled_step_overhead=0.0, counting_step_overhead=None)


def write_report(report: ProfileReport, output_file: str | None, show: bool) -> None:
    """On rank 0: print the report (``show``) and write ``output_file`` (the JSON form if it
    ends in ``.json``, else the text)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if show:
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
    """Profile one forward (and a backward of the outputs' sum) of a plain module. Its
    headline is that one call (there are no other steps to take a median of)."""
    kwargs = kwargs or {}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    timeline = timeline_for(device)
    counter, timer = FlopCounter(model), ModuleTimer(model, marks_for(device, 64))
    timer.register()
    counter.start()
    timer.arm()
    try:
        t0 = timeline.mark()
        out = model(*args, **kwargs)
        t1 = timeline.mark()
        if backward:
            for part in (counter, timer):
                part.set_phase("backward")
            _sum_outputs(out).backward()
            for part in (counter, timer):
                part.set_phase("step")
        t2 = timeline.mark()
    finally:
        counter.stop()
        timer.stop()
    timer.read()
    rows, sums = module_rows(model, counter, {})
    time_rows(rows, sums, timer)
    timeline.wait(t2)
    fwd_s, whole_s = timeline.seconds(t0, t1), timeline.seconds(t0, t2)
    params = sum(p.numel() for p in model.parameters())
    flops = flop_figures(counter, 1)
    peak, source = device_peak_flops(device, peak_flops)
    mem_peak, reserved, mem_source = peak_memory(device)
    batch = next((a.shape[0] for a in (*args, *kwargs.values())
                  if isinstance(a, torch.Tensor) and a.dim() >= 1), 1)
    report = ProfileReport(
        world_size=1, data_parallel_size=1, tensor_parallel_size=1, pipeline_parallel_size=1,
        zero_stage=None, zero_description=describe_zero(None, 1), params_total=params,
        params_per_rank=params, gathered_params_peak=params, step_flops_per_rank=0,
        **{k: v for k, v in flops.items() if not k.endswith("_model_rank")},
        fwd_flops_model=flops["fwd_flops_model_rank"],
        bwd_flops_model=flops["bwd_flops_model_rank"],
        model_flops=flops["model_flops_per_rank"], hardware_flops=flops["hardware_flops_per_rank"],
        fwd_latency_s=fwd_s, bwd_latency_s=whole_s - fwd_s, step_latency_s=0.0,
        profiled_step_s=whole_s, peak_flops=peak, peak_flops_source=source, memory={},
        peak_memory_bytes=mem_peak, peak_memory_source=mem_source,
        reserved_memory_bytes=reserved, model_state_bytes=0, comm={},
        comm_hidden_fraction=None, global_batch=batch,
        tokens_per_sample=tokens_per_sample(args, kwargs),
        modules=rows, module_depth=module_depth,
        top_modules=top_modules, flops_source="counted in the profiled call itself",
        **UNSET_HEADLINE)
    return with_headline(report, whole_s, [], "the profiled call itself (a plain module)",
                         final=True)


def _sum_outputs(out) -> torch.Tensor:
    tensors = [out] if isinstance(out, torch.Tensor) else [
        t for t in (out.values() if isinstance(out, dict) else out)
        if isinstance(t, torch.Tensor)]
    sums = [t.float().sum() for t in tensors if t.requires_grad]
    if not sums:
        raise ValueError("profiling a backward needs an output that requires grad; "
                         "the model returned none")
    return sum(sums[1:], sums[0])
