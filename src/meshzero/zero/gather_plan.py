"""Stage 3: which units stay gathered from the end of forward into backward (reuse).

DeepSpeed's ``stage3_max_reuse_distance`` and ``stage3_max_live_parameters``, with its
meaning: a unit is not released after its last forward use when its next use (in backward)
comes within ``max_reuse_distance`` elements, and what is kept is bounded by
``max_live_parameters``. The engine (zero/sharded_params.py) and the estimator
(estimate/states.py) both take the kept set from :func:`plan_reuse`, so the estimator's
gathered peak and communication volume are the engine's.

The step is a sequence of unit *uses*: ``forward`` (the units in the order their forwards
start) then ``backward`` (the order their output gradients arrive: the outermost unit, whose
output is the model's, first). Unit ``u`` is released after forward at position
``release[u]`` of ``forward`` (the position after its last forward use and every use nested
inside it). Its *reuse distance* is the elements of every use between that point and its
first backward use (a unit used twice counts twice, as DeepSpeed counts its trace)::

    distance(u) = sum(numel[v] for v in forward[release[u]:])
                + sum(numel[v] for v in backward[:backward.index(u)])

For a model of a root (embedding and head) and blocks 1..L run in order: the root's distance
is 0, block L's is numel(root), block k's numel(root) + 2 * numel(k+1..L).

Candidates (distance <= max_reuse_distance) are kept in order of distance, closest first
(the last units of forward), while

    sum(numel of kept) + numel(root, if not kept) + max(numel of a unit not kept)
        <= max_live_parameters

so that the kept units, the root (gathered while any block runs) and the one other unit that
must be gathered at a time fit in the bound (prefetch is bounded by it separately). A kept
unit is released as usual once its gradients are in (backward), so a step gathers
``2 * psi - sum(numel of kept)`` elements instead of ``2 * psi``. With DeepSpeed's defaults
(both 1e9) every unit of a model under ~1e9 elements is kept: one gather per unit per step
(as DeepSpeed), and the gathered peak is the whole model; ``stage3_max_reuse_distance: 0``
keeps none (only the root, whose distance is 0: set ``stage3_max_live_parameters`` below the
root's size to release it too).
"""

from __future__ import annotations

from collections.abc import Sequence


def reuse_distance(forward: Sequence[int], backward: Sequence[int], numel: Sequence[int],
                   unit: int, release: int) -> int | None:
    """Elements used between ``unit``'s release after forward (at ``release``, a position of
    ``forward``) and its first backward use; None if backward does not use it."""
    if unit not in backward:
        return None
    later = sum(numel[v] for v in forward[release:])
    return later + sum(numel[v] for v in backward[:backward.index(unit)])


def plan_reuse(forward: Sequence[int], backward: Sequence[int], numel: Sequence[int],
               release: dict[int, int], *, max_reuse_distance: int,
               max_live_parameters: int, root: int = 0) -> frozenset[int]:
    """The units kept gathered from their last forward use to their backward (see the
    module docstring). ``release[u]``: the position of ``forward`` at which ``u`` is released
    after its last forward use; ``numel[u]``: its gathered elements."""
    candidates = []
    for u in dict.fromkeys(forward):  # first-use order, each unit once
        if numel[u] == 0 or u not in release:
            continue
        distance = reuse_distance(forward, backward, numel, u, release[u])
        if distance is not None and distance <= max_reuse_distance:
            candidates.append((distance, u))
    kept: set[int] = set()
    for _, u in sorted(candidates, key=lambda c: (c[0], -c[1])):
        trial = kept | {u}
        others = [numel[v] for v in dict.fromkeys(forward) if v not in trial and v != root]
        bound = sum(numel[v] for v in trial) + max(others, default=0)
        if root not in trial and root < len(numel):
            bound += numel[root]
        if bound <= max_live_parameters:
            kept = trial
    return frozenset(kept)


def nested_orders(forward: Sequence[int], paths: Sequence[str]
                  ) -> tuple[dict[int, int], list[int]]:
    """(release positions, backward order) of a forward in which units run nested by module
    path (a unit's children run inside its forward): for the estimator, which has the
    forward order and the paths but runs no backward. A unit is released after the uses
    nested inside it; backward meets the units in the reverse order of their releases (the
    outermost, whose output is the model's, first), each unit once per use."""
    def inside(v: int, u: int) -> bool:
        return paths[u] == "" and v != u or paths[v].startswith(paths[u] + ".")

    release: dict[int, int] = {}
    events: list[tuple[int, int, int]] = []  # (release position, -depth, unit) per use
    for i, u in enumerate(forward):
        end = i + 1
        while end < len(forward) and inside(forward[end], u):
            end += 1
        release[u] = end
        depth = 0 if paths[u] == "" else paths[u].count(".") + 1
        events.append((end, -depth, u))
    return release, [u for *_, u in sorted(events, reverse=True)]
