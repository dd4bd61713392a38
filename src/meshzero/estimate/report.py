"""The text of an :class:`~meshzero.estimate.core.Estimate`: one table per GPU, one line per
node, the verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshzero.estimate.construction import construction_lines
from meshzero.estimate.states import total_bytes
from meshzero.profiling.report import si
from meshzero.zero.state import TIERS

if TYPE_CHECKING:
    from meshzero.estimate.core import Estimate

LABELS = {"params": "parameters", "grads": "gradients", "master_params": "master parameters",
          "optimizer_states": "optimizer states", "offload_buffers": "NVMe tile buffers"}


def fmt_bytes(n: int | float) -> str:
    """Decimal units, as --gpu-memory 80GB reads: '13.03 MB', '0 B'."""
    if n == 0:
        return "0 B"
    for factor, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{int(n)} B"


def _row(label: str, values: list[str]) -> str:
    return (f"  {label:<52}" + "".join(f"{v:>12}" for v in values)).rstrip()


def _one(label: str, value: int) -> str:
    return _row(label, [fmt_bytes(value), "", ""])


def format_estimate(e: Estimate) -> str:
    s, c = e.settings, e.cluster
    lines = [
        "meshzero estimate",
        f"model:     {e.model}: {si(e.num_params)} parameters in {e.num_units} units "
        f"(largest {si(e.largest_unit)})",
        f"cluster:   {c.nodes} node(s) x {c.gpus_per_node} GPUs = {c.world_size} ranks; "
        f"{fmt_bytes(c.gpu_memory)} per GPU, {fmt_bytes(c.host_memory)} host memory per node",
        f"settings:  {s.describe()}",
        "",
        _row(f"per GPU (rank {e.rank} of {c.world_size}, the one holding the most)",
             list(TIERS)),
    ]
    for category in e.model_states:
        if category == "offload_buffers" and s.offload_optimizer != "nvme":
            continue
        lines.append(_row(LABELS.get(category, category),
                          [fmt_bytes(e.model_states[category][t]) for t in TIERS]))
    lines.append(_row("= at rest (what engine.memory_report() reports)",
                      [fmt_bytes(total_bytes(e.model_states, t)) for t in TIERS]))
    if e.unfrozen_states is not None:
        lines.append(_row("  after unfreezing the frozen parameters (--trainable all)",
                          [fmt_bytes(total_bytes(e.unfrozen_states, t)) for t in TIERS]))
    lines.append(_one("gathered params + prefetch (stage 3)", e.gathered))
    lines.append(_one(f"reduce buckets (reduce_bucket_size {si(s.reduce_bucket_size)})",
                      e.reduce_buckets))
    lines.append(_one("all-gather buckets (in place)", e.allgather_buckets))
    if e.param_read_buffers:
        lines.append(_row("parameter shards read ahead from NVMe",
                          ["", fmt_bytes(e.param_read_buffers), ""]))
    seq = f" x {s.seq_len}" if s.seq_len is not None else ""
    lines.append(_one(f"activations (micro batch {s.micro_batch}{seq})", e.activations)
                 if e.activations is not None
                 else _row("activations", ["not counted", "", ""]))
    lines.append(_row("total", [fmt_bytes(e.gpu_bytes), fmt_bytes(e.host_bytes_per_rank),
                                fmt_bytes(total_bytes(e.model_states, "nvme"))]))
    lines.append(f"per node ({c.gpus_per_node} GPUs): host memory "
                 f"{fmt_bytes(e.host_bytes_per_node)} of {fmt_bytes(c.host_memory)}, NVMe "
                 f"{fmt_bytes(e.nvme_bytes_per_node)}")
    lines.extend(["", *construction_lines(e, fmt_bytes, _row)])
    if e.flops_per_micro_batch is not None:
        lines.append(f"FLOPs per micro-step per GPU: {si(e.flops_per_micro_batch)} (forward + "
                     "backward" + (" + recomputation" if s.activation_checkpointing else "")
                     + ")")
    lines.append("")
    lines.append(verdict(e))
    lines.extend(f"note: {n}" for n in e.notes)
    return "\n".join(lines)


def verdict(e: Estimate) -> str:
    c = e.cluster
    use = (f"{fmt_bytes(e.gpu_bytes)} of {fmt_bytes(c.gpu_memory)} per GPU "
           f"({e.gpu_bytes / c.gpu_memory:.1%}), host {fmt_bytes(e.host_bytes_per_node)} of "
           f"{fmt_bytes(c.host_memory)} per node ({e.host_bytes_per_node / c.host_memory:.1%})")
    text = ("verdict:   FITS: " if e.fits else "verdict:   DOES NOT FIT: ") + use
    if e.max_micro_batch is not None:
        text += (f"\nlargest micro batch that fits: {e.max_micro_batch}" if e.max_micro_batch
                 else "\nno micro batch fits (not even 1)")
    return text
