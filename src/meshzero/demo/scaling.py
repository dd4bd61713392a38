"""``meshzero demo --scaling``: model-state bytes per rank at world sizes 1, 2, 4 against the
ZeRO-3 formula, and (with matplotlib) a PNG of memory per rank and the loss curves.

With fp32 AdamW at stage 3 a rank holds, for every element of its shard, a 4-byte parameter,
a 4-byte gradient and Adam's 4-byte m and v: 16 Ψ/N bytes, Ψ the parameter count and N the
world size. The exact figure adds what the layout pads and what Adam keeps per tensor:

    per flat group g of a rank's shard, S_g elements (padding included), R_g real elements,
    F_g parameter fragments (pieces of parameters) in it:
        params 4 S_g + grads 4 S_g + Adam m, v 8 R_g + Adam step counters 4 F_g
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshzero.demo.gpt import GPT, GPTConfig
from meshzero.zero.state import CATEGORIES
from meshzero.zero.units import build_layout

BYTES_PER_ELEMENT = 16  # fp32 param 4 + fp32 grad 4 + Adam m 4 + Adam v 4


@dataclass(frozen=True)
class Expected:
    formula: float  # 16 Ψ / N
    exact: int  # padding and Adam's step counters included
    padded_elements: int  # sum of S_g
    fragments: int  # sum of F_g


def expected_bytes(model_cfg: GPTConfig, world: int, rank: int) -> Expected:
    """What ``memory_report()`` should count for ``rank`` of ``world`` (stage 3, fp32 AdamW,
    stage3_param_persistence_threshold 0: every parameter sharded)."""
    with torch.device("meta"):  # shapes are all the layout needs
        model = GPT(model_cfg)
    layout = build_layout(model, num_shards=world, persistence_threshold=0)
    exact = padded = frags = 0
    for group in layout.groups():
        lo, hi = group.shard_range(rank)
        pieces = group.fragments(lo, hi)
        real = sum(f.numel for f in pieces)
        exact += 8 * group.shard_numel + 8 * real + 4 * len(pieces)
        padded += group.shard_numel
        frags += len(pieces)
    return Expected(BYTES_PER_ELEMENT * model.num_params() / world, exact, padded, frags)


def model_state_bytes(report: dict[str, Any]) -> int:
    """params + master_params + grads + optimizer_states of one memory_report(), all tiers."""
    return sum(sum(report[c].values()) for c in CATEGORIES)


def scaling_table(model_cfg: GPTConfig, results: dict[int, dict[str, Any]]) -> str:
    """``results``: world size -> rank 0's return value of train_rank (every rank's memory)."""
    with torch.device("meta"):
        psi = GPT(model_cfg).num_params()
    base = None
    head = ["world", "rank", "16*psi/N", "+ padding", "+ Adam steps", "= padded exact",
            "measured", "measured / N=1"]
    rows = []
    for world in sorted(results):
        for entry in results[world]["memory"]:
            exp = expected_bytes(model_cfg, world, entry["rank"])
            measured = model_state_bytes(entry["memory"])
            base = base or measured
            steps = 4 * exp.fragments
            rows.append([str(world), str(entry["rank"]), f"{exp.formula:.0f}",
                         f"{exp.exact - steps - exp.formula:.0f}", str(steps), str(exp.exact),
                         str(measured), f"{measured / base:.4f}"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([
        "",
        f"{'-' * 20} model-state bytes per rank, ZeRO-3, fp32 AdamW {'-' * 20}",
        f"psi = {psi} parameters (the tied embedding/head once), N = world size",
        "16*psi/N: the formula, fp32 param 4 + grad 4 + Adam m 4 + v 4 bytes per element",
        "+ padding: the flat groups are padded to N equal shards of a multiple of 4 elements "
        "(param + grad bytes of the padding; a rank's Adam m, v cover its real elements only)",
        "+ Adam steps: torch's AdamW keeps a 4-byte step count per tensor, i.e. per parameter "
        "fragment in the shard",
        "measured: params + master_params + grads + optimizer_states of engine.memory_report()",
        fmt(head), *(fmt(r) for r in rows), ""])


def loss_summary(results: dict[int, dict[str, Any]]) -> str:
    lines = ["same global batch at every world size, so the loss curves agree:"]
    for world in sorted(results):
        losses = results[world]["losses"]
        lines.append(f"  world {world}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over "
                     f"{len(losses)} steps ({results[world]['seconds']:.1f} s)")
    return "\n".join(lines)


def plot(model_cfg: GPTConfig, results: dict[int, dict[str, Any]], out: Path) -> Path | None:
    """Memory per rank against world size and the loss curves, as a PNG; None without
    matplotlib (``pip install 'meshzero[plot]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    worlds = sorted(results)
    measured = [max(model_state_bytes(e["memory"]) for e in results[w]["memory"]) / 2**20
                for w in worlds]
    formula = [expected_bytes(model_cfg, w, 0).formula / 2**20 for w in worlds]
    fig, (ax_mem, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    ax_mem.plot(worlds, formula, "-", color="gray", linewidth=4, alpha=0.5,
                label="16 Ψ / N (formula)")
    ax_mem.plot(worlds, measured, "o", color="C0", label="measured, largest rank")
    ax_mem.set_xscale("log", base=2)
    ax_mem.set_xticks(worlds, [str(w) for w in worlds])
    ax_mem.minorticks_off()
    ax_mem.set(xlabel="world size N", ylabel="model-state MiB per rank", ylim=(0, None),
               title="ZeRO-3 model states per rank (fp32 AdamW)")
    ax_mem.legend()
    styles = ["-", "--", ":", "-."]
    for i, w in enumerate(worlds):
        losses = results[w]["losses"]
        ax_loss.plot(range(len(losses)), losses, styles[i % len(styles)], linewidth=2,
                     label=f"N = {w}")
    ax_loss.xaxis.get_major_locator().set_params(integer=True)
    ax_loss.set(xlabel="optimizer step", ylabel="loss of the global batch",
                title="loss curves (the same global batch at every N)")
    ax_loss.legend()
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scaling.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
