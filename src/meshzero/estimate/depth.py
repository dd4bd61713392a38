"""Counting a deep model at a few blocks and extending the counts to its full depth.

Fake tensors cost no memory, but every op still costs Python time: a 70 B model's 80 blocks
take 10 s or more per forward/backward. Its blocks are identical, so the stack (the longest
ModuleList/Sequential of children of one class with identical parameter shapes) is cut to
2, 3 and 4 blocks, and hooks on the blocks cut each run into segments: before the stack,
each block's forward, after the stack, the loss and head backward, each block's backward,
the rest. Every segment's peak of live bytes must be exactly linear in the depth (and, for
a block's segment, in the block's position); then each is extended to the full depth and the
largest is the peak, so a peak that moves (say from the loss at small depth to a block's
backward at full depth) is still found. FLOPs must grow by the same amount per block. If
anything is not exactly linear, the whole model runs. The cut is undone before returning.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

MIN_DEPTH = 6  # shallower stacks run whole
PROBES = (2, 3, 4)
SINGLE = ("pre", "post", "head", "end")  # segments that occur once per run

# a segment boundary: "post"/"end", or (kind, block index) with kind "f", "fe", "b" or "be"
Mark = str | tuple[str, int]


class MarkSink(Protocol):
    def mark(self, label: Mark) -> None: ...


class Counts(NamedTuple):
    peak: int
    flops: int
    order: tuple[int, ...]  # forward order of units
    marks: list[tuple[Mark, int]]  # (segment label, its peak)


class DepthProbe:
    """Marks segment boundaries on the counter around each block's forward and backward."""

    def __init__(self, blocks: list[nn.Module]):
        self.counter: MarkSink | None = None  # set by each run
        self.handles = []
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_pre_hook(self._before(i)))
            self.handles.append(block.register_forward_hook(self._after(i)))

    def _mark(self, label: Mark) -> None:
        if self.counter is not None:
            self.counter.mark(label)

    def _before(self, i: int):
        def hook(_module, args) -> None:
            self._mark(("f", i))
            grad_in = next((t for t in tree_flatten(args)[0]
                            if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if grad_in is not None and torch.is_grad_enabled():
                grad_in.register_hook(lambda _g: self._mark(("be", i)))

        return hook

    def _after(self, i: int):
        def hook(_module, _args, output) -> None:
            self._mark(("fe", i))
            outs = [t for t in tree_flatten(output)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs and torch.is_grad_enabled():
                register_multi_grad_hook(outs, lambda _g: self._mark(("b", i)), mode="any")

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _signature(module: nn.Module) -> tuple:
    return (type(module),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                  for n, p in module.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers()))


def find_stack(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(path, container) of the deepest stack of identical blocks, if at least MIN_DEPTH."""
    best: tuple[str, nn.Module] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        kids = list(module._modules.values())
        if len(kids) < MIN_DEPTH or any(k is None for k in kids):
            continue
        if not any(True for _ in kids[0].parameters()):
            continue
        first = _signature(kids[0])
        if all(_signature(k) == first for k in kids[1:]) and (
                best is None or len(kids) > len(best[1]._modules)):
            best = (path, module)
    return best


def extrapolate_depth(model: nn.Module, unit_paths: list[str],
                      count: Callable[[DepthProbe | None], Counts]
                      ) -> tuple[int, int, tuple[int, ...], str | None]:
    """(peak bytes, FLOPs, forward order, how) of the full model, from ``count()`` run on
    cut copies of its stack when that is exact, else on the whole model."""
    found = find_stack(model)
    if found is None:
        return (*count(None)[:3], None)
    path, stack = found
    full = stack._modules
    depth = len(full)
    probe = DepthProbe([m for m in full.values() if m is not None])  # a stack holds no None
    runs: dict[int, Counts] = {}
    try:
        for k in PROBES:
            stack._modules = OrderedDict(list(full.items())[:k])
            runs[k] = count(probe)
    except (ValueError, IndexError, KeyError, RuntimeError):
        runs = {}  # the model depends on its depth in other ways: run it whole
    finally:
        stack._modules = full
        probe.remove()
    peak = _extend_peak(runs, depth) if runs else None
    flops = [runs[k].flops for k in PROBES] if runs else []
    if peak is None or flops[2] - flops[1] != flops[1] - flops[0]:
        return (*count(None)[:3], None)
    k0 = PROBES[0]
    order = _full_order(runs[k0].order, unit_paths,
                        [f"{path}.{name}" if path else name for name in full])
    how = (f"{path or 'the model'}: {depth} blocks counted at {', '.join(map(str, PROBES))} "
           "blocks and extended (every segment exactly linear in the depth)")
    return peak, flops[0] + (depth - k0) * (flops[1] - flops[0]), order, how


def _segments(marks: list[tuple[Mark, int]], k: int) -> dict[str, dict[int, int]] | None:
    """{segment kind: {block index: peak}} of a run at depth ``k``; None if the marks are not
    the expected ones (blocks run once each, in sequence).

    A block's backward ends when the gradient of its input is computed, which is also when
    the previous block's backward starts: the two marks ('be', i) and ('b', i - 1) are the
    same boundary (their order is autograd's), and the segment between them is empty."""
    out: dict[str, dict[int, int]] = {}
    for label, value in marks:
        if label == ("f", 0):
            kind, i = "pre", 0  # before the stack
        elif label == ("b", k - 1):
            kind, i = "head", 0  # loss and head backward
        elif isinstance(label, str):
            kind, i = label, 0  # "post": after the stack and the loss; "end": before the stack
        elif label[0] == "b":
            kind, i = "be", label[1] + 1
        else:
            kind, i = label
        seen = out.setdefault(kind, {})
        seen[i] = max(seen.get(i, 0), value)
    expected = {"pre": {0}, "head": {0}, "post": {0}, "end": {0}, "f": set(range(1, k)),
                "fe": set(range(k)), "be": set(range(k))}
    if {kind: set(v) for kind, v in out.items()} != expected:
        return None
    return out


def _extend_peak(runs: dict[int, Counts], depth: int) -> int | None:
    """The largest segment peak at ``depth``, each segment fitted exactly as a + b*depth
    (+ c*position for a block's segment); None if any does not fit."""
    points: dict[str, dict[tuple[int, int], int]] = {}
    for k, counts in runs.items():
        segments = _segments(counts.marks, k)
        if segments is None:
            return None
        for kind, values in segments.items():
            for i, v in values.items():
                points.setdefault(kind, {})[(k, i)] = v
    # positions each block segment takes at full depth
    positions = {"f": (1, depth - 1), "fe": (0, depth - 1), "be": (0, depth - 1)}
    best = 0
    for kind, pts in points.items():
        lo, hi = (0, 0) if kind in SINGLE else positions[kind]
        fit = _fit(pts)
        if fit is None and hi > lo:
            # the first block may differ (it builds what the others reuse): fit it apart
            first = _fit({p: v for p, v in pts.items() if p[1] == lo})
            rest = _fit({p: v for p, v in pts.items() if p[1] > lo})
            if first is None or rest is None:
                return None
            best = max(best, first[0] + first[1] * depth + first[2] * lo)
            fit, lo = rest, lo + 1
        if fit is None:
            return None
        a, b, c = fit
        best = max(best, a + b * depth + max(c * lo, c * hi))
    return best


def _fit(points: dict[tuple[int, int], int]) -> tuple[int, int, int] | None:
    """Integers (a, b, c) with v = a + b*k + c*i at every point, or None."""
    k0, i0 = min(points)
    base = points[(k0, i0)]
    if (k0 + 1, i0) not in points:
        return None
    b = points[(k0 + 1, i0)] - base
    c = points[(k0 + 1, i0 + 1)] - points[(k0 + 1, i0)] if (k0 + 1, i0 + 1) in points else 0
    a = base - b * k0 - c * i0
    if any(v != a + b * k + c * i for (k, i), v in points.items()):
        return None
    return a, b, c


def _full_order(probe: tuple[int, ...], unit_paths: list[str], block_paths: list[str]
                ) -> tuple[int, ...]:
    """The forward order at full depth: the probe's units outside the stack around every
    unit inside the stack's blocks, in layout order (blocks run in sequence)."""
    def inside(unit: int) -> bool:
        p = unit_paths[unit]
        return any(p == b or p.startswith(b + ".") for b in block_paths)

    positions = [i for i, u in enumerate(probe) if inside(u)]
    if not positions:
        return probe
    first, last = positions[0], positions[-1]
    blocks = [u for u in range(len(unit_paths)) if inside(u)]
    return (*probe[:first], *blocks, *probe[last + 1:])
