"""Stepping part of an optimizer, and stepping fp32 masters on 16-bit gradients.

The optimizer's leaves are fp32 views of the master shard. With fp32 gradients each leaf's
``.grad`` views the gradient shard and ``optimizer.step()`` runs as is. A gradient shard
held in bf16/fp16 (``data_types.grad_accum_dtype``) cannot be an fp32 leaf's ``.grad``, and
converting it whole would put back the fp32 copy it saves. So the leaves are stepped in
*chunks* of at most ``chunk_numel`` elements (leaves longer than that were cut when they
were made, :func:`split_fragment`): for each chunk the gradients are converted into one fp32
buffer of the chunk's size, times the step's scale, the chunk's leaves point ``.grad`` at it,
the optimizer steps them (:func:`step_subset`) and ``.grad`` is dropped. The buffer lives for
one step only; no fp32 gradient larger than one chunk ever exists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from meshzero.zero.offload.nvme_io import CUT
from meshzero.zero.units import Fragment

CHUNK_NUMEL = 1 << 24  # 16 Mi elements: 64 MiB of fp32 gradient converted at once


def chunk_numel(sub_group_size: int) -> int:
    """Elements of 16-bit gradient converted to fp32 at once: sub_group_size, at most
    CHUNK_NUMEL, a multiple of CUT."""
    return max(min(sub_group_size, CHUNK_NUMEL) // CUT * CUT, CUT)


def split_fragment(frag: Fragment, numel: int | None) -> list[Fragment]:
    """``frag`` cut into pieces of ``numel`` elements from its start (the last one shorter);
    ``numel`` is a multiple of CUT, so vectorised optimizer kernels see the same element-to-
    lane mapping and the update is bit-identical to the whole fragment's. None: uncut."""
    if numel is None or frag.numel <= numel:
        return [frag]
    return [Fragment(frag.slot, frag.start + a, frag.start + min(a + numel, frag.numel),
                     frag.local_offset + a) for a in range(0, frag.numel, numel)]


def step_subset(optimizer: torch.optim.Optimizer, subset: list[list[torch.Tensor]],
                skipped: frozenset[int] = frozenset()) -> None:
    """``optimizer.step()`` over ``subset[i]`` of param group i only (elementwise optimizers
    give each tensor the same update as a step over all of them), less the leaves whose id
    is in ``skipped`` (no gradient this step: torch.optim would skip them)."""
    if skipped:
        subset = [[t for t in ts if id(t) not in skipped] for ts in subset]
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, subset, strict=True):
            group["params"] = params
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = params


def subsets_by_group(optimizer: torch.optim.Optimizer,
                     leaves: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``leaves`` split by the optimizer's param groups, in each group's own order."""
    wanted = {id(t) for t in leaves}
    return [[p for p in g["params"] if id(p) in wanted] for g in optimizer.param_groups]


@dataclass
class Chunk:
    """Leaves stepped together, each with its 16-bit gradient view, ``numel`` in all."""

    leaves: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)
    numel: int = 0
    subset: list[list[torch.Tensor]] = field(default_factory=list)  # leaves per param group


def plan_chunks(optimizer: torch.optim.Optimizer,
                pairs: Iterable[tuple[nn.Parameter, torch.Tensor]], numel: int) -> list[Chunk]:
    """(leaf, gradient view) pairs, in order, packed into chunks of at most ``numel``
    elements (a longer leaf, which :func:`split_fragment` prevents, goes alone)."""
    chunks: list[Chunk] = []
    for leaf, grad in pairs:
        if not chunks or chunks[-1].numel + grad.numel() > numel:
            chunks.append(Chunk())
        chunks[-1].leaves.append((leaf, grad))
        chunks[-1].numel += grad.numel()
    for chunk in chunks:
        chunk.subset = subsets_by_group(optimizer, [leaf for leaf, _ in chunk.leaves])
    return chunks


def step_chunks(optimizer: torch.optim.Optimizer, chunks: list[Chunk], scale: float,
                skipped: frozenset[int] = frozenset()) -> None:
    """Step every chunk on its gradients converted to fp32 and multiplied by ``scale``;
    leaves whose id is in ``skipped`` keep ``.grad`` None (torch.optim skips them)."""
    if not chunks:
        return
    device = chunks[0].leaves[0][1].device
    buf = torch.empty(max(c.numel for c in chunks), dtype=torch.float32, device=device)
    for chunk in chunks:
        a = 0
        for leaf, grad in chunk.leaves:
            view = buf[a:a + grad.numel()]
            view.copy_(grad)  # to fp32 first: the scale is applied in fp32
            leaf.grad = view if id(leaf) not in skipped else None
            a += grad.numel()
        if scale != 1.0:
            buf[:a].mul_(scale)
        try:
            step_subset(optimizer, chunk.subset)
        finally:
            for leaf, _ in chunk.leaves:
                leaf.grad = None
