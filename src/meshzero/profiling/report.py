"""The profile report: what one rank really holds, computes and sends in one step.

``str(report)`` is the printed summary and module tree; ``report.to_dict()`` the JSON form
(FLOPs and parameter counts as plain integers).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class ModuleRow:
    path: str
    depth: int
    params_model: int
    params_per_rank: int
    fwd_flops: int
    bwd_flops: int
    recompute_flops: int
    fwd_latency_s: float
    bwd_latency_s: float | None  # None: backward not timed per module (docs/profiling.md)


@dataclass
class ProfileReport:
    """One profiled step beside the steady-state headline; see docs/profiling.md for where
    each figure comes from. FLOPs: ``*_flops_per_rank`` are what this rank executed;
    ``model_flops`` counts the model once (one plain forward and backward of the global
    batch: tp-replicated work once, recomputation excluded), ``hardware_flops`` what all
    ranks executed (replicated and recomputed work included)."""

    world_size: int
    data_parallel_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    zero_stage: int | None
    zero_description: str
    params_total: int
    params_per_rank: int
    gathered_params_peak: int
    fwd_flops_per_rank: int
    bwd_flops_per_rank: int
    recompute_flops_per_rank: int
    step_flops_per_rank: int
    replicated_flops_per_rank: int  # fwd + bwd inside tp-replicated modules
    fwd_flops_model: int
    bwd_flops_model: int
    model_flops_per_rank: int
    hardware_flops_per_rank: int
    model_flops: int
    hardware_flops: int
    # the profiled step (its module breakdown is ``modules``)
    fwd_latency_s: float
    bwd_latency_s: float
    step_latency_s: float
    profiled_step_s: float
    # the headline: steady state, from ``headline_steps`` (see ``headline_source``)
    iter_latency_s: float
    headline_steps: list[int]
    headline_source: str
    headline_final: bool
    samples_per_second: float
    tokens_per_second: float
    model_flops_per_second_per_rank: float
    hardware_flops_per_second_per_rank: float
    peak_flops: float | None
    peak_flops_source: str
    mfu: float | None  # the job's; None when the peak is unknown
    hfu: float | None
    mfu_per_rank: float | None  # this rank's
    hfu_per_rank: float | None
    profiled_step_overhead: float  # profiled_step_s / iter_latency_s
    counting_step_overhead: float | None  # counting_step_s / iter_latency_s
    memory: dict[str, Any]
    peak_memory_bytes: int
    peak_memory_source: str
    reserved_memory_bytes: int | None  # CUDA allocator's reserved peak; None on CPU
    model_state_bytes: int  # memory_report()'s device tier at rest
    comm: dict[str, Any]
    comm_hidden_fraction: float | None
    global_batch: int = 1
    tokens_per_sample: int = 1
    report_build_s: float = 0.0  # host seconds to build this report, after the step
    # FLOPs come from step ``flops_step``: P-1 (a step of its own, excluded from the headline)
    # or P itself (then the profiled step's overhead includes counting); see flops_source
    flops_step: int | None = None
    flops_source: str = ""
    counting_step_s: float | None = None  # the counting step's time, when it is not P
    transfers: dict[str, Any] | None = None  # engine.transfer_report(), where it exists
    modules: list[ModuleRow] = field(default_factory=list)
    rank_min_max: dict[str, list[float]] = field(default_factory=dict)
    per_rank: dict[str, list[float]] = field(default_factory=dict)
    profile_step: int | None = None
    module_depth: int = -1
    sequence_parallel_size: int = 1  # Ulysses: ranks that split each sequence
    tokens_per_rank: int | None = None  # with sp > 1: tokens of this rank's last micro-batch
    top_modules: int = 1
    detailed: bool = True
    # engine.compile_report() at the profiled step (None: not compiled); the profiled and
    # counting steps run the units eager, the headline's steps compiled (compile/)
    compile: dict[str, Any] | None = None

    @property
    def other_memory_bytes(self) -> int:
        """Of the measured peak, what is not model states at rest: activations, gathered
        parameters, communication and allocator buffers (on CPU, the process itself too)."""
        return self.peak_memory_bytes - self.model_state_bytes

    def headline(self) -> dict[str, Any]:
        """The steady-state figures, by the names profile.json and the monitors use."""
        return {k: getattr(self, k) for k in HEADLINE_KEYS}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "other_memory_bytes": self.other_memory_bytes}

    def __str__(self) -> str:
        return "\n".join(summary_lines(self) + module_lines(self) + footer_lines(self))


HEADLINE_KEYS = ("iter_latency_s", "samples_per_second", "tokens_per_second",
                 "model_flops_per_second_per_rank", "hardware_flops_per_second_per_rank",
                 "mfu", "hfu", "mfu_per_rank", "hfu_per_rank", "profiled_step_s",
                 "profiled_step_overhead", "counting_step_overhead", "peak_memory_bytes",
                 "model_state_bytes", "other_memory_bytes")


def si(value: float, unit: str = "") -> str:
    """1.23 G, 45.6 M ... (no absurd magnitudes such as '1.8 Gs' for seconds)."""
    if value != value:  # nan
        return "n/a"
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= factor:
            return f"{value / factor:.2f} {prefix}{unit}"
    return f"{value:.4g} {unit}".rstrip()


def seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.3f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.1f} us"


def _line(label: str, text: str) -> str:
    return f"{label + ':':<56}{text}"


def _percent(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2%}"


def summary_lines(r: ProfileReport) -> list[str]:
    title = "meshzero profile" + (f" of step {r.profile_step}" if r.profile_step is not None
                                  else "")
    step = "call" if r.profile_step is None else f"step {r.profile_step}"
    peak = (f"{si(r.peak_flops, 'FLOP/s')} per device ({r.peak_flops_source})"
            if r.peak_flops is not None else r.peak_flops_source)
    lines = [f"{'-' * 20} {title} {'-' * 20}",
             "(per rank unless it says model or job)",
             _line("world size", str(r.world_size)),
             _line("data-parallel size", str(r.data_parallel_size)),
             _line("tensor-parallel size", str(r.tensor_parallel_size)),
             _line("pipeline-parallel size", str(r.pipeline_parallel_size)),
             *([_line("sequence-parallel size (Ulysses)", f"{r.sequence_parallel_size}, "
                      f"{r.tokens_per_rank} tokens per rank per micro-batch")]
               if r.sequence_parallel_size > 1 else []),
             _line("ZeRO", r.zero_description),
             _line("params of the model", f"{si(r.params_total)} (shared parameters once)"),
             _line("params held by this rank at rest",
                   f"{si(r.params_per_rank)} (shards + persistent, padding included)"),
             _line("peak of gathered params in the step", si(r.gathered_params_peak)),
             f"{'-' * 10} headline: steady state {'-' * 10}",
             _line("headline from", r.headline_source),
             _line("iteration latency", seconds(r.iter_latency_s)),
             _line("samples/s (all data-parallel ranks)", f"{r.samples_per_second:.2f}"),
             _line("tokens/s (all data-parallel ranks)", f"{r.tokens_per_second:.2f}"),
             _line("model FLOPs per step: job / this rank",
                   f"{si(r.model_flops)} / {si(r.model_flops_per_rank)}"),
             _line("hardware FLOPs per step: job / this rank",
                   f"{si(r.hardware_flops)} / {si(r.hardware_flops_per_rank)}"),
             _line("achieved FLOP/s per rank: model / hardware",
                   f"{si(r.model_flops_per_second_per_rank, 'FLOP/s')} / "
                   f"{si(r.hardware_flops_per_second_per_rank, 'FLOP/s')}"),
             _line("peak", peak),
             _line("MFU: job / this rank", f"{_percent(r.mfu)} / {_percent(r.mfu_per_rank)}"),
             _line("HFU: job / this rank", f"{_percent(r.hfu)} / {_percent(r.hfu_per_rank)}"),
             *per_rank_utilization(r),
             f"{'-' * 10} the profiled {step}{_counted_in(r)} {'-' * 10}",
             _line("fwd FLOPs per rank / model", f"{si(r.fwd_flops_per_rank)} / "
                   f"{si(r.fwd_flops_model)}"),
             _line("bwd FLOPs per rank / model", f"{si(r.bwd_flops_per_rank)} / "
                   f"{si(r.bwd_flops_model)}"),
             _line("recompute FLOPs per rank", si(r.recompute_flops_per_rank)),
             _line("tp-replicated FLOPs per rank", si(r.replicated_flops_per_rank)),
             _line("optimizer-step FLOPs per rank",
                   f"{si(r.step_flops_per_rank)} (matmul-class ops only, as torch counts)"),
             _line("fwd / bwd / step / whole profiled step",
                   " / ".join(seconds(x) for x in (r.fwd_latency_s, r.bwd_latency_s,
                                                   r.step_latency_s, r.profiled_step_s)))]
    lines += comm_lines(r) + transfer_lines(r) + memory_lines(r) + compile_lines(r)
    for key, (lo, hi) in r.rank_min_max.items():
        lines.append(_line(f"min / max across ranks: {key}", f"{lo:.6g} / {hi:.6g}"))
    return lines


def _counted_in(r: ProfileReport) -> str:
    """Where the section's FLOPs come from, when not from the timed step itself."""
    if r.flops_step is None or r.flops_step == r.profile_step:
        return ""
    return f" (FLOPs counted in step {r.flops_step})"


def per_rank_utilization(r: ProfileReport) -> list[str]:
    """min / max over ranks of MFU and HFU (each rank's FLOPs over the headline latency)."""
    if r.peak_flops is None or len(r.per_rank.get("model_flops_per_rank", [])) < 2:
        return []
    lines = []
    for name, key in (("MFU", "model_flops_per_rank"), ("HFU", "hardware_flops_per_rank")):
        values = [f / (r.iter_latency_s * r.peak_flops) for f in r.per_rank[key]]
        lines.append(_line(f"{name} per rank: min / max", f"{min(values):.2%} / {max(values):.2%}"))
    return lines


def transfer_lines(r: ProfileReport) -> list[str]:
    """engine.transfer_report() of the profiled step, where the engine has one."""
    return [_line(f"transfers {direction}", ", ".join(f"{k} {v:.6g}" if isinstance(v, float)
                                                    else f"{k} {v}" for k, v in stats.items())
                  if isinstance(stats, dict) else str(stats))
            for direction, stats in (r.transfers or {}).items()]


def compile_lines(r: ProfileReport) -> list[str]:
    """engine.compile_report()'s totals, when the units are compiled."""
    c = r.compile
    if c is None:
        return []
    return [_line("compiled units", f"{c['units']} with backend {c['backend']!r}: "
                  f"{c['graph_breaks']} graph breaks, {c['recompiles']} recompiles, "
                  f"{seconds(c['compile_seconds'])} compiling (dynamo's counters)")]


def comm_lines(r: ProfileReport) -> list[str]:
    if not r.comm:
        return [_line("communication", "none")]
    lines = []
    for op, s in r.comm.items():
        lines.append(_line(f"comm {op}", f"{si(s['bytes'], 'B')} in {s['count']} ops, "
                           f"{seconds(s['seconds'])} ({seconds(s['exposed_seconds'])} exposed)"))
    if r.comm_hidden_fraction is not None:
        lines.append(_line("comm hidden behind compute", f"{r.comm_hidden_fraction:.1%}"))
    return lines


def memory_lines(r: ProfileReport) -> list[str]:
    lines = []
    for category, tiers in r.memory.items():
        if isinstance(tiers, dict):
            text = ", ".join(f"{tier} {si(b, 'B')}" for tier, b in tiers.items())
            lines.append(_line(f"memory {category}", text))
    lines.append(_line("measured peak memory", f"{si(r.peak_memory_bytes, 'B')} "
                       f"({r.peak_memory_source})"))
    lines.append(_line("  of which model states at rest / the rest",
                       f"{si(r.model_state_bytes, 'B')} / {si(r.other_memory_bytes, 'B')} "
                       "(activations, gathered params, buffers)"))
    if r.reserved_memory_bytes is not None:
        lines.append(_line("reserved by the CUDA allocator (peak)",
                           si(r.reserved_memory_bytes, "B")))
    return lines


def module_lines(r: ProfileReport) -> list[str]:
    rows = [m for m in r.modules if r.module_depth < 0 or m.depth <= r.module_depth]
    if not rows:
        return []
    total = max(r.fwd_flops_per_rank, 1)
    lines = ["", f"{'-' * 20} modules (fwd FLOPs share of the model) {'-' * 20}"]
    depths = sorted({m.depth for m in rows})
    for depth in depths:
        top = sorted((m for m in rows if m.depth == depth), key=lambda m: -m.fwd_flops)
        names = ", ".join(f"{m.path or '(root)'} {m.fwd_flops / total:.1%}"
                          for m in top[: r.top_modules])
        lines.append(f"top {r.top_modules} at depth {depth}: {names}")
    if not r.detailed:
        return lines
    lines.append(f"{'module':<40}{'params model':>14}{'params/rank':>13}{'fwd FLOPs':>12}"
                 f"{'bwd FLOPs':>12}{'fwd time':>11}{'bwd time':>11}{'share':>8}")
    for m in rows:
        name = "  " * m.depth + (m.path.rsplit(".", 1)[-1] if m.path else "(root)")
        lines.append(f"{name[:39]:<40}{si(m.params_model):>14}{si(m.params_per_rank):>13}"
                     f"{si(m.fwd_flops):>12}{si(m.bwd_flops):>12}{seconds(m.fwd_latency_s):>11}"
                     f"{_maybe_seconds(m.bwd_latency_s):>11}{m.fwd_flops / total:>8.1%}")
    return lines


def _maybe_seconds(value: float | None) -> str:
    return "-" if value is None else seconds(value)


def footer_lines(r: ProfileReport) -> list[str]:
    counted_apart = r.flops_step is not None and r.flops_step != r.profile_step
    cost = "timing marks only" if counted_apart else "timing marks and FLOP counting"
    lines = ["", _line("FLOPs and module FLOPs from", r.flops_source),
             _line("profiled step overhead",
                   f"{r.profiled_step_overhead:.3f}x the headline's latency "
                   f"({seconds(r.profiled_step_s)} vs {seconds(r.iter_latency_s)}; {cost})")]
    if counted_apart and r.counting_step_overhead is not None:
        lines.append(_line(f"FLOP-counting step {r.flops_step} (not in the headline)",
                           f"{r.counting_step_overhead:.3f}x the headline's latency "
                           f"({seconds(r.counting_step_s or 0.0)}; dispatch mode and hooks)"))
    return lines + [_line("building this report, after the step", seconds(r.report_build_s))]
