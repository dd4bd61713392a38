"""Cutting a model into pipeline stages: which layers go where, and the stage modules.

A model is described as a chain (``PipelineLayout``): an optional *first* part (embeddings),
a list of *layers* (the repeated blocks) and an optional *last* part (final norm, head). The
layers are split into contiguous stages (``split_stages``); the first part rides on stage 0
and the last part on the final stage.

A stage module (``StageModule``) is a *pruned skeleton* of the original model: it holds the
original submodules that belong to the stage under their original dotted names (stage 1 of
a 4-block GPT has ``blocks.2`` and ``blocks.3``, not ``0`` and ``1``), so parameter names,
state-dict keys and checkpoints match the unsplit model exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

Activation = torch.Tensor | tuple[torch.Tensor, ...]
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class PipelineLayout:
    """How a model reads as a chain ``last(layers[n-1](...layers[0](first(inputs))))``.

    ``layers``: dotted path of the layer list (an ``nn.ModuleList`` / ``nn.Sequential``; its
    children in order), ``""`` for the model itself (an ``nn.Sequential``).
    ``first`` / ``last``: dotted names of the modules, parameters or buffers that only the
    first / last stage keeps. ``first_fn(stage_module, *inputs)`` / ``last_fn(stage_module,
    x)`` compute those parts (they see the original attribute names on ``stage_module``);
    without a function, the ``first`` / ``last`` modules are applied in order.
    """

    layers: str = ""
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    first_fn: Callable[..., Activation] | None = None
    last_fn: Callable[..., Any] | None = None


def layer_list(model: nn.Module, layout: PipelineLayout) -> list[tuple[str, nn.Module]]:
    """The (dotted name, module) of every layer the layout names, in order."""
    try:
        container = model.get_submodule(layout.layers) if layout.layers else model
    except AttributeError as exc:
        raise ValueError(
            f"PipelineLayout.layers={layout.layers!r} is not a submodule of "
            f"{type(model).__name__}"
        ) from exc
    prefix = f"{layout.layers}." if layout.layers else ""
    layers = [(prefix + name, child) for name, child in container.named_children()]
    if not layers:
        raise ValueError(f"PipelineLayout.layers={layout.layers!r} has no child layers")
    return layers


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def split_stages(
    layers: Sequence[nn.Module] | nn.Sequential | nn.ModuleList,
    num_stages: int,
    *,
    boundaries: Sequence[int] | None = None,
) -> list[list[int]]:
    """Split ``len(layers)`` layers into ``num_stages`` contiguous stages of layer indices.

    Without ``boundaries`` the split is balanced by parameter count: the largest stage is as
    small as possible (ties fill earlier stages first). ``boundaries`` gives the index of the
    first layer of stages 1..num_stages-1 instead, e.g. ``[2]`` splits 4 layers as
    ``[[0, 1], [2, 3]]``. Every stage gets at least one layer.
    """
    num_layers = len(layers)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} pipeline stages: every stage "
            f"needs at least one layer (use fewer stages or stages_per_rank)"
        )
    if boundaries is not None:
        cuts = list(boundaries)
        if len(cuts) != num_stages - 1:
            raise ValueError(
                f"boundaries must list the first layer of stages 1..{num_stages - 1} "
                f"({num_stages - 1} indices), got {len(cuts)}: {cuts}"
            )
        if any(not 0 < c < num_layers for c in cuts) or cuts != sorted(set(cuts)):
            raise ValueError(
                f"boundaries must be strictly increasing layer indices in 1..{num_layers - 1}, "
                f"got {cuts}"
            )
    else:
        cuts = _balanced_cuts([_num_params(layer) for layer in layers], num_stages)
    edges = [0, *cuts, num_layers]
    return [list(range(edges[s], edges[s + 1])) for s in range(num_stages)]


def _balanced_cuts(weights: list[int], num_stages: int) -> list[int]:
    """Cut points of the contiguous partition whose heaviest part is lightest."""
    lo, hi = max(weights), sum(weights)
    while lo < hi:  # smallest feasible maximum, by bisection
        mid = (lo + hi) // 2
        if _greedy_cuts(weights, num_stages, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    cuts = _greedy_cuts(weights, num_stages, lo)
    assert cuts is not None
    return cuts


def _greedy_cuts(weights: list[int], num_stages: int, limit: int) -> list[int] | None:
    """Fill stages front to back up to ``limit``, leaving one layer per later stage; the
    cuts, or None when ``limit`` needs more than ``num_stages`` stages."""
    cuts: list[int] = []
    load = 0
    for i, w in enumerate(weights):
        stages_left = num_stages - len(cuts) - 1  # stages after the current one
        must_cut = len(weights) - i == stages_left  # one layer per remaining stage
        if i > 0 and (load + w > limit or must_cut) and stages_left > 0:
            cuts.append(i)
            load = 0
        elif load + w > limit:
            return None
        load += w
    return cuts if load <= limit else None


def _resolve(root: nn.Module, name: str) -> tuple[nn.Module, str, str]:
    """(owner module, leaf name, kind) of a dotted module / parameter / buffer name."""
    owner_name, _, leaf = name.rpartition(".")
    try:
        owner = root.get_submodule(owner_name)
    except AttributeError:
        owner = None
    if owner is not None:
        for kind, table in (
            ("module", owner._modules),
            ("parameter", owner._parameters),
            ("buffer", owner._buffers),
        ):
            if table.get(leaf) is not None:
                return owner, leaf, kind
    raise ValueError(
        f"{name!r} (in PipelineLayout) is not a module, parameter or buffer of "
        f"{type(root).__name__}"
    )


def prune_into(skeleton: nn.Module, root: nn.Module, names: Sequence[str]) -> None:
    """Register in ``skeleton``, under the same dotted names, the original objects ``names``
    point to in ``root``; intermediate modules become empty containers holding only them."""
    for name in names:
        owner, leaf, kind = _resolve(root, name)
        dst, src = skeleton, root
        for part in name.split(".")[:-1]:
            child = src._modules[part]
            assert child is not None  # _resolve found ``name``: every module on its path exists
            src = child
            if dst._modules.get(part) is None:
                # Same container type keeps ZeRO's "repeated siblings" unit policy working;
                # other classes may need constructor arguments, so a plain Module stands in.
                holder = type(src)() if type(src) in _CONTAINERS else nn.Module()
                dst._modules[part] = holder
            next_dst = dst._modules[part]
            assert next_dst is not None  # set just above if it was missing
            dst = next_dst
        if kind == "module":
            dst._modules[leaf] = owner._modules[leaf]
        elif kind == "parameter":
            dst.register_parameter(leaf, owner._parameters[leaf])
        else:
            persistent = leaf not in owner._non_persistent_buffers_set
            dst.register_buffer(leaf, owner._buffers[leaf], persistent=persistent)


class StageModule(nn.Module):
    """One pipeline stage: the original submodules of its part of the chain, under their
    original names, and a forward that runs that part."""

    def __init__(
        self,
        root: nn.Module,
        layout: PipelineLayout,
        layer_names: Sequence[str],
        *,
        is_first: bool,
        is_last: bool,
    ) -> None:
        super().__init__()
        first = layout.first if is_first else ()
        last = layout.last if is_last else ()
        self.pruned_names = [*first, *layer_names, *last]
        prune_into(self, root, self.pruned_names)
        # Names, looked up at every forward: tensor parallelism may replace a module in place
        self._first = list(first) if layout.first_fn is None else []
        self._layers = list(layer_names)
        self._last = list(last) if layout.last_fn is None else []
        self._first_fn = layout.first_fn if is_first else None
        self._last_fn = layout.last_fn if is_last else None
        self.layer_names = list(layer_names)

    def forward(self, *inputs: torch.Tensor) -> Any:
        x: Any = inputs if len(inputs) > 1 else inputs[0]
        if self._first_fn is not None:
            x = self._first_fn(self, *inputs)
        for name in (*self._first, *self._layers):
            module = self.get_submodule(name)
            x = module(*x) if isinstance(x, tuple) else module(x)
        if self._last_fn is not None:
            return self._last_fn(self, x)
        for name in self._last:
            module = self.get_submodule(name)
            x = module(*x) if isinstance(x, tuple) else module(x)
        return x


def infer_stage_shapes(
    root: nn.Module,
    stage_modules: Sequence[nn.Module],
    example_inputs: tuple[torch.Tensor, ...],
) -> list[tuple[torch.Tensor, ...]]:
    """Outputs of every stage for one micro-batch, as meta tensors (shape, dtype,
    requires_grad), by running the whole chain on the meta device: no compute, no
    communication, no numpy. Entry s is stage s's output and stage s+1's input."""
    # Keyed by tensor identity: a tied tensor has another name on each stage that holds it.
    meta_of = {
        id(t): torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
        for t in (*root.parameters(), *root.buffers())
    }
    x: tuple[torch.Tensor, ...] = tuple(torch.empty_like(t, device="meta") for t in example_inputs)
    outputs = []
    for stage in stage_modules:
        state = {
            name: meta_of[id(t)]
            for name, t in (
                *stage.named_parameters(remove_duplicate=False),
                *stage.named_buffers(remove_duplicate=False),
            )
        }
        with torch.enable_grad():
            out = functional_call(stage, state, x)
        out = out if isinstance(out, tuple) else (out,)
        if not all(isinstance(t, torch.Tensor) for t in out):
            raise ValueError(
                f"pipeline stage outputs must be tensors or tuples of tensors, got "
                f"{[type(t).__name__ for t in out]}"
            )
        outputs.append(out)
        # The next stage receives fresh leaves: same shape and dtype, contiguous on the wire.
        x = tuple(
            torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)
            for t in out
        )
    return outputs
