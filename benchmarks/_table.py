"""The markdown table ``benchmarks/compare.py`` prints, the summary lines under it (ratios
to meshzero and to the no-communication limit), and the entry it appends to RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

import torch
from _launch import deepspeed_version

# issue 15: meshzero's ZeRO-3 step against the one-process no-comm limit at W=2
LIMIT_TARGET = {"gpt": 1.8, "mlp": 1.4}


def _mb(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 1e6:,.2f} MB"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "-"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table, columns padded to their widest cell."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("| " + " | ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True))
                     + " |" for line in lines)


def _comm_kinds(row: dict) -> dict | None:
    """Bytes per collective kind: meshzero's own report, the c10d counter for the others."""
    return row.get("own_comm") if row["system"] == "meshzero" else row.get("counted")


def _comm(row: dict) -> int | None:
    src = _comm_kinds(row)
    return None if src is None else sum(src.values())


def render(rows: list[dict], nocomm: dict, args) -> str:
    ok = [r for r in rows if "step_s" in r]
    # x meshzero: against meshzero's row of the same stage and offload
    ref = {(r["stage"], r["offload"]): r for r in ok if r["system"] == "meshzero"}
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
        m = ref.get((r["stage"], r["offload"]), {})
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
        mz = by.get(("meshzero", False)) or by.get(("meshzero", True))
        if mz is None:
            continue
        for offload in (False, True):  # against the others with the same offload
            mine = by.get(("meshzero", offload))
            others = [by[k] for k in (("fsdp2", offload), ("deepspeed", offload)) if k in by]
            if mine is None or not others:
                continue
            best = min(others, key=lambda r: r["step_s"])
            out.append(f"- ZeRO-{stage}{' offload' if offload else ''}: meshzero step / fastest "
                       f"other ({best['system']}) = {mine['step_s'] / best['step_s']:.2f}"
                       + (" (issue 15 target <= 0.8)" if stage == 3 and not offload else "")
                       + f"; model states / smallest other = "
                       f"{mine['states'] / min(r['states'] or 1e30 for r in others):.3f}")
        if limit:
            vs = ", ".join(f"{r['system']}{' offload' if r['offload'] else ''} "
                           f"{r['step_s'] / limit:.2f}x" for r in by.values())
            out.append(f"- ZeRO-{stage} step / no-comm limit ({limit:.3f} s): {vs}"
                       + (f" (issue 15 target for meshzero <= {LIMIT_TARGET.get(args.model, 1.8)}x"
                          " at W=2)" if args.nproc == 2 else ""))
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
        own, counted = dict(mz.get("own_comm") or {}), mz.get("counted") or {}
        counted = dict(counted)
        # to the c10d counter: the unit-order check and the phase check are all-gathers; the
        # step's non-finite check is an all-reduce, or, where the phase check posts ahead
        # (not gloo: faults/phase.py), it rides on the phase exchange, an all-gather
        posts = "phase_check" in own
        for check in ("order_check", "phase_check", "step_check"):
            if check in own:
                kind = "all_reduce" if check == "step_check" and not posts else "all_gather"
                own[kind] = own.get(kind, 0) + own.pop(check)
        if "all_to_all" in counted:  # meshzero's reduce-scatter on gloo (comm/communicator.py)
            counted["reduce_scatter"] = counted.get("reduce_scatter", 0) + counted.pop("all_to_all")
        if "send" in counted:  # meshzero's gloo all-gather: sends to each peer (comm/)
            counted["all_gather"] = counted.get("all_gather", 0) + counted.pop("send")
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


