"""Run every check of the corpus and score it: an entry works when all its checks pass.

World-size-1 checks run in one fresh process, world-size-2 checks in one gloo group of two
(tests/distributed.py). Should a group die (a check that hangs or kills its process), its
checks run again one per group, so the others still get a result.
"""

from __future__ import annotations

import importlib
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from tests.deepspeed_corpus.calls import CALLS, Call
from tests.deepspeed_corpus.context import REGISTRY, Context, Registered
from tests.distributed import DistributedTestError, run_distributed

CHECK_MODULES = ("checks_entry", "checks_zero", "checks_engine", "checks_ckpt", "checks_misc",
                 "checks_layers")
# Checks that change the process group: run after every other check of their world size.
LAST = ("deepspeed.init_distributed", "deepspeed.comm.destroy_process_group")


def load_checks() -> dict[str, Registered]:
    for name in CHECK_MODULES:
        importlib.import_module(f"tests.deepspeed_corpus.{name}")
    return REGISTRY


def _one_line(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames)
                  if "deepspeed_corpus" in f.filename), "")
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''} ({where})"


def run_in_group(rank: int, world_size: int, root: str, names: list[str]) -> dict[str, str]:
    """Each check by name on this rank; "" for a pass, one line for a failure."""
    load_checks()
    ctx = Context(rank, world_size, Path(root))
    results: dict[str, str] = {}
    for name in names:
        try:
            REGISTRY[name].fn(ctx)
            results[name] = ""
        except Exception as exc:  # noqa: BLE001 - a failing check is a result
            results[name] = _one_line(exc) or "failed"
        if not dist.is_initialized() and REGISTRY[name].api not in LAST:
            break  # the group is gone: the rest cannot run here
    return results


def _ordered(world_size: int) -> list[str]:
    names = [n for n, r in load_checks().items() if r.world_size == world_size]
    return sorted(names, key=lambda n: REGISTRY[n].api in LAST)


def run_all(tmp: Path, timeout: float = 240.0) -> dict[str, str]:
    """Every registered check: name -> "" (pass) or the failure (the worst over ranks)."""
    results: dict[str, str] = {}
    for world_size in (1, 2):
        names = _ordered(world_size)
        root = tmp / f"w{world_size}"
        root.mkdir(parents=True, exist_ok=True)
        try:
            per_rank = run_distributed(run_in_group, world_size, root, str(root), names,
                                       timeout=timeout)
        except DistributedTestError:
            per_rank = _one_by_one(world_size, root, names)
        for name in names:
            fails = [r.get(name, "did not run: an earlier check ended the group")
                     for r in per_rank]
            results[name] = next((f for f in fails if f), "")
    return results


def _one_by_one(world_size: int, root: Path, names: list[str]) -> list[dict[str, str]]:
    merged: list[dict[str, str]] = [{} for _ in range(world_size)]
    for i, name in enumerate(names):
        sub = root / f"single{i}"
        sub.mkdir(parents=True, exist_ok=True)
        try:
            out = run_distributed(run_in_group, world_size, sub, str(sub), [name], timeout=60)
        except DistributedTestError as exc:
            line = str(exc).strip().splitlines()
            out = [{name: f"rank died or hung: {line[0][:160] if line else ''}"}] * world_size
        for rank in range(world_size):
            merged[rank].update(out[rank])
    return merged


@dataclass(frozen=True)
class Score:
    call: Call
    failures: tuple[str, ...]  # empty: works

    @property
    def works(self) -> bool:
        return not self.failures


def score(results: dict[str, str]) -> list[Score]:
    """One Score per corpus entry, in corpus order."""
    out = []
    for call in CALLS:
        names = [n for n, r in REGISTRY.items() if r.api == call.api]
        outcome = {n: results.get(n, "did not run") for n in names}
        fails = [f"{n}: {outcome[n]}" if n != call.api else outcome[n]
                 for n in names if outcome[n]]
        if not names:
            fails = ["no check"]
        out.append(Score(call, tuple(fails)))
    return out


def _share(scores: list[Score]) -> str:
    works = [s for s in scores if s.works]
    weight = sum(s.call.weight for s in scores)
    got = sum(s.call.weight for s in works)
    return (f"{len(works)} of {len(scores)} APIs work as called; weighted by projects: "
            f"{got} of {weight} ({100 * got / max(weight, 1):.0f} %)")


def table(scores: list[Score]) -> str:
    lines = [f"{'ok' if s.works else '--'}  {s.call.api}  (x{s.call.weight})"
             + ("" if s.works else f"  {s.failures[0]}") for s in scores]
    core = [s for s in scores if not s.call.needs]
    needs = sorted({s.call.needs for s in scores if s.call.needs})
    lines += ["", _share(scores),
              f"without the {len(scores) - len(core)} that need a DeepSpeed feature meshzero "
              f"has no engine for ({', '.join(needs)}): {_share(core)}"]
    return "\n".join(lines)


def main_env() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
