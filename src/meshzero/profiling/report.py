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
    bwd_latency_s: float


@dataclass
class ProfileReport:
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
    fwd_flops_model: int
    bwd_flops_model: int
    fwd_latency_s: float
    bwd_latency_s: float
    step_latency_s: float
    iter_latency_s: float
    samples_per_second: float
    tokens_per_second: float
    flops_per_second_per_rank: float
    peak_flops: float
    peak_flops_source: str
    mfu: float
    memory: dict[str, Any]
    peak_memory_bytes: int
    peak_memory_source: str
    comm: dict[str, Any]
    comm_hidden_fraction: float | None
    modules: list[ModuleRow] = field(default_factory=list)
    rank_min_max: dict[str, list[float]] = field(default_factory=dict)
    profile_step: int | None = None
    module_depth: int = -1
    sequence_parallel_size: int = 1  # Ulysses: ranks that split each sequence
    tokens_per_rank: int | None = None  # with sp > 1: tokens of this rank's last micro-batch
    top_modules: int = 1
    detailed: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return "\n".join(summary_lines(self) + module_lines(self))


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


def summary_lines(r: ProfileReport) -> list[str]:
    title = "meshzero profile" + (f" of step {r.profile_step}" if r.profile_step is not None
                                  else "")
    lines = [f"{'-' * 20} {title} {'-' * 20}", "(per rank unless it says model)",
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
             _line("fwd FLOPs per rank / model", f"{si(r.fwd_flops_per_rank)} / "
                   f"{si(r.fwd_flops_model)}"),
             _line("bwd FLOPs per rank / model", f"{si(r.bwd_flops_per_rank)} / "
                   f"{si(r.bwd_flops_model)}"),
             _line("recompute FLOPs per rank", si(r.recompute_flops_per_rank)),
             _line("optimizer-step FLOPs per rank",
                   f"{si(r.step_flops_per_rank)} (matmul-class ops only, as torch counts)"),
             _line("fwd / bwd / step / iteration latency",
                   " / ".join(seconds(x) for x in (r.fwd_latency_s, r.bwd_latency_s,
                                                   r.step_latency_s, r.iter_latency_s))),
             _line("achieved FLOP/s per rank", si(r.flops_per_second_per_rank, "FLOP/s")),
             _line("MFU", f"{r.mfu:.2%} of {si(r.peak_flops, 'FLOP/s')} ({r.peak_flops_source})"
                   if r.mfu == r.mfu else f"n/a ({r.peak_flops_source})"),
             _line("samples/s (all data-parallel ranks)", f"{r.samples_per_second:.2f}"),
             _line("tokens/s (all data-parallel ranks)", f"{r.tokens_per_second:.2f}")]
    lines += comm_lines(r) + memory_lines(r)
    for key, (lo, hi) in r.rank_min_max.items():
        lines.append(_line(f"min / max across ranks: {key}", f"{lo:.6g} / {hi:.6g}"))
    return lines


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
                     f"{seconds(m.bwd_latency_s):>11}{m.fwd_flops / total:>8.1%}")
    return lines
