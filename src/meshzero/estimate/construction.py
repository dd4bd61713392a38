"""The memory of building the model, before the first step: eager construction against
``meshzero.zero_init``, per rank, beyond the model states at rest.

DeepSpeed's "cold" estimate counts construction, and machines are sized by it: a model built
eagerly exists whole, in fp32, on every rank (every process of a node builds it) before ZeRO
shards it, and ZeRO then copies it into flat buffers one unit at a time. Under ``zero_init``
the parameters are meta until the engine materialises them one unit at a time, the largest
first, straight into that unit's flat buffer (benchmarks/construction_peak.py measures it:
about one block beyond the states, eager about the whole model plus two units; the
largest unit is the bound given here).

    eager      host:   4 psi (the fp32 model)         device: 4 x largest unit (its flat buffer)
    zero_init  host:   4 x largest unit (on a GPU: materialised on the CPU, then copied)
               device: 4 x largest unit
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshzero.estimate.core import Estimate

FP32 = 4  # bytes: models are built in fp32 (torch's default dtype)


@dataclass(frozen=True)
class ConstructionPeak:
    """Bytes one rank holds while the engine is built, beyond the model states at rest."""

    eager_host: int
    eager_device: int
    zero_init_host: int | None  # None: zero_init is not supported here (tp or pp > 1)
    zero_init_device: int | None


def construction_peak(e: Estimate) -> ConstructionPeak:
    unit = FP32 * e.largest_unit
    sharded_ok = e.settings.model_parallel == 1
    return ConstructionPeak(
        eager_host=FP32 * e.num_params, eager_device=unit,
        zero_init_host=unit if sharded_ok else None,
        zero_init_device=unit if sharded_ok else None)


def construction_lines(e: Estimate, fmt_bytes, row) -> list[str]:
    """The estimate's construction rows (``fmt_bytes`` and ``row`` from estimate/report.py)."""
    peak = construction_peak(e)
    lines = [row("construction, beyond the states at rest (per rank)", ["device", "host", ""]),
             row("  eager (the whole fp32 model on every rank)",
                 [fmt_bytes(peak.eager_device), fmt_bytes(peak.eager_host), ""])]
    if peak.zero_init_host is None or peak.zero_init_device is None:
        lines.append(row("  zero_init: not supported with tensor/pipeline parallel", []))
    else:
        lines.append(row("  zero_init (one unit at a time)",
                         [fmt_bytes(peak.zero_init_device), fmt_bytes(peak.zero_init_host), ""]))
    gpus = e.cluster.gpus_per_node
    zero_init = ("" if peak.zero_init_host is None else
                 f", zero_init {fmt_bytes(e.host_bytes_per_node + gpus * peak.zero_init_host)}")
    lines.append(f"host memory per node while building: eager "
                 f"{fmt_bytes(e.host_bytes_per_node + gpus * peak.eager_host)}{zero_init}")
    return lines
