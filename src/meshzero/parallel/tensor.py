"""Tensor parallelism, Megatron-style, with plain local shards (no DTensor).

Usage::

    from meshzero.parallel import apply_tensor_parallel, gather_tensor_parallel_state_dict
    from meshzero.parallel.plans import GPT_PLAN

    model = GPT(cfg)                          # the full model, same seed on every tp rank
    apply_tensor_parallel(model, GPT_PLAN, tp_group, sequence_parallel=True)
    logits = model(idx)                       # every tp rank: the same batch, the same logits
    loss_fn(logits, targets).backward()       # grads of the local shards, complete
    torch.optim.AdamW(model.parameters()).step()
    full = gather_tensor_parallel_state_dict(model, tp_group)  # original names and shapes

``apply_tensor_parallel`` replaces, in place, the ``nn.Linear`` (or Hugging Face ``Conv1D``)
and ``nn.Embedding`` modules a plan names (see :mod:`meshzero.parallel.plans` for the plan
format) with :class:`ColumnParallelLinear`, :class:`RowParallelLinear` and
:class:`VocabParallelEmbedding`, each holding this tp rank's slice of the existing full
weights, so the parallel model computes what the original computed. Every rank of the tp group
must feed the same input (tensor parallelism splits the weights, not the batch).

Which parameters are sharded: the parallel layers record each of their parameters in a side
table (:func:`is_tp_sharded`, keyed by the parameter object; nothing is set on the tensor):
``True`` for a slice (each tp rank holds a different part: count it on every tp rank in a
gradient norm), ``False`` for a replicated one (a row-parallel bias; count it once).
Parameters of other modules are replicated and are not in the table (``None``).

Sequence parallelism (``sequence_parallel=True``): between a row-parallel layer and the next
column-parallel one, activations are split along the sequence (dimension -2 of (..., T, C)),
so norms and residual adds run on T/N positions: row-parallel layers reduce-scatter instead of
all-reducing, column-parallel layers all-gather their input. Replicated parameters that see
only a slice of the sequence (norms, named by the plan) get their gradients summed over the
tp group by a gradient hook, so every gradient is complete when backward returns and an
optimizer or ZeRO can treat them like any other. The sequence length must divide by tp.

For an engine composing this with data parallelism: tp ranks get the same batch, gradients
are averaged over the dp group only, and the global gradient norm squared is the tp all-reduce
of the sharded parameters' squares plus the replicated parameters' squares counted once (their
gradients are equal on every tp rank). The sequence-parallel gradient hooks are attached at
forward time, once per parameter object, so parameters rebuilt later get them too;
the table follows a deep copy of the model but not a new ``nn.Parameter`` (read it, or
``TensorParallelLayer.tp_layouts``, before rebuilding). Dropout inside a tensor-parallel region
draws the same random numbers on every tp rank (no per-rank RNG tracker).
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshzero.parallel.plans import (
    LAYER_STYLES,
    REGION_STYLES,
    PlanEntry,
    TensorParallelContext,
    linear_dims,
    match_plan,
    module_label,
    parse_plan,
    validate_entry,
)
from meshzero.parallel.shards import (  # noqa: F401  (re-exported)
    ShardLayout,
    is_tp_sharded,
    mark_tp_sharded,
    shard_tensor,
    unshard_tensor,
)
from meshzero.parallel.tensor_comms import (
    OnComm,
    all_reduce_sum,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)


def _divisible(what: str, size: int, tp_size: int) -> None:
    if size % tp_size:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel size {tp_size}")


class TensorParallelLayer(nn.Module):
    """Common state of the parallel layers: the group, and the layout of each sharded
    parameter (``tp_layouts``: name -> :class:`ShardLayout`; absent names are replicated)."""

    tp_layouts: dict[str, ShardLayout]

    def __init__(self, tp_group: dist.ProcessGroup | None, sequence_parallel: bool,
                 on_comm: OnComm | None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.sequence_parallel = sequence_parallel
        self.on_comm = on_comm
        self.tp_layouts = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorParallelLayer:
        """A copy shares the process group and ``on_comm`` (neither can be copied); its new
        parameters are recorded in the sharded table like the originals."""
        memo.setdefault(id(self.tp_group), self.tp_group)
        memo.setdefault(id(self.on_comm), self.on_comm)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            object.__setattr__(new, key, copy.deepcopy(value, memo))
        new._mark()
        return new

    def _mark(self) -> None:
        """Record every parameter of this layer as sharded or not (see the docstring)."""
        for name, param in self.named_parameters(recurse=False):
            mark_tp_sharded(param, name in self.tp_layouts)


class ColumnParallelLinear(TensorParallelLayer):
    """y = x A^T + b with A (out, in) split by rows: rank r computes out/N output features.

    Input (..., in), the same on every rank, or (..., T/N, in) with sequence parallelism
    (all-gathered here). Output (..., out/N), or (..., out) with ``gather_output``.
    ``num_fused``: the output is that many equal fused parts (q, k, v), each split by rank.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 tp_group: dist.ProcessGroup | None = None, gather_output: bool = False,
                 sequence_parallel: bool = False, num_fused: int = 1,
                 on_comm: OnComm | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(tp_group, sequence_parallel, on_comm)
        if out_features % (num_fused * self.tp_size):
            raise ValueError(
                f"ColumnParallelLinear: out_features {out_features} ({num_fused} fused part(s)) "
                f"is not divisible by {num_fused} x the tensor-parallel size {self.tp_size}")
        if gather_output and num_fused > 1:
            raise ValueError("ColumnParallelLinear: gather_output of a fused projection would "
                             "interleave the fused parts; gather each part instead")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.num_fused = gather_output, num_fused
        local = out_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias
                     else None)
        layout = ShardLayout(dim=0, num_fused=num_fused)
        self.tp_layouts = {"weight": layout, "bias": layout} if bias else {"weight": layout}
        self._mark()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default (kaiming_uniform with a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, c = self.tp_group, self.on_comm
        if self.sequence_parallel:  # (..., T/N, in) -> (..., T, in); backward reduce-scatters
            x = gather_from_sequence_parallel_region(x, g, c)
        else:  # every rank's input gradient is partial: summed in backward
            x = copy_to_tensor_parallel_region(x, g, c)
        y = F.linear(x, self.weight, self.bias)  # (..., out/N)
        return gather_from_tensor_parallel_region(y, g, c) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features // self.tp_size} per rank), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, num_fused={self.num_fused}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(TensorParallelLayer):
    """y = x A^T + b with A (out, in) split by columns: rank r multiplies its in/N input
    features and the partial sums are all-reduced (reduce-scattered along the sequence with
    sequence parallelism). The bias is replicated and added once, after the reduction.

    Input (..., in/N) (``input_is_parallel``, the output of a column-parallel layer) or
    (..., in) (split here). Output (..., out), or (..., T/N, out) with sequence parallelism.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 tp_group: dist.ProcessGroup | None = None, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, on_comm: OnComm | None = None,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(tp_group, sequence_parallel, on_comm)
        _divisible("RowParallelLinear: in_features", in_features, self.tp_size)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence parallelism needs input_is_parallel")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        local = in_features // self.tp_size
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias
                     else None)
        self.tp_layouts = {"weight": ShardLayout(dim=1)}
        self._mark()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)  # the full layer's fan-in
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, c = self.tp_group, self.on_comm
        if not self.input_is_parallel:  # (..., in) -> (..., in/N)
            x = scatter_to_tensor_parallel_region(x, g, c)
        y = F.linear(x, self.weight)  # (..., out): this rank's partial sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, g, c)  # (..., T/N, out)
        else:
            y = reduce_from_tensor_parallel_region(y, g, c)
        if self.bias is None:
            return y
        # Under sequence parallelism each rank adds the bias to its T/N positions only, so
        # its gradient is partial: copy_to's backward sums it over the group.
        bias = copy_to_tensor_parallel_region(self.bias, g, c) if self.sequence_parallel \
            else self.bias
        return y + bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features // self.tp_size} per rank), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(TensorParallelLayer):
    """Embedding with the vocabulary split: rank r holds rows [r V/N, (r+1) V/N). Ids outside
    a rank's rows look up zeros there; the sum over the group (all-reduce, or reduce-scatter
    along the sequence with sequence parallelism) is the full lookup.

    Input ids (..., T); output (..., T, C), or (..., T/N, C) with sequence parallelism.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None, *, tp_group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = False, on_comm: OnComm | None = None,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(tp_group, sequence_parallel, on_comm)
        _divisible("VocabParallelEmbedding: num_embeddings", num_embeddings, self.tp_size)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * local
        self.vocab_end = self.vocab_start + local
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        self._local_padding_idx = (padding_idx - self.vocab_start if padding_idx is not None
                                   and self.vocab_start <= padding_idx < self.vocab_end else None)
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        self.tp_layouts = {"weight": ShardLayout(dim=0)}
        self._mark()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self._local_padding_idx is not None:
            with torch.no_grad():
                self.weight[self._local_padding_idx].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g, c = self.tp_group, self.on_comm
        if self.tp_size == 1:
            out = F.embedding(ids, self.weight, self._local_padding_idx)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = torch.where(outside, 0, ids - self.vocab_start)
            out = F.embedding(local_ids, self.weight, self._local_padding_idx)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # (..., T, C), zero off-shard
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, g, c)
        return reduce_from_tensor_parallel_region(out, g, c)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.vocab_start}:"
                f"{self.vocab_end} here), sequence_parallel={self.sequence_parallel}")


def apply_tensor_parallel(model: nn.Module, plan: Mapping[str, str | Mapping[str, Any]],
                          tp_group: dist.ProcessGroup | None, *, sequence_parallel: bool = False,
                          on_comm: OnComm | None = None) -> nn.Module:
    """Shard ``model`` in place over ``tp_group`` (``None``: one rank) as ``plan`` says (format:
    :mod:`meshzero.parallel.plans`); returns it (a new object only if the plan replaces the
    root). Everything is checked before anything changes: a pattern that matches nothing, a
    module matched twice, a style on the wrong kind of module, a size that does not divide by
    tp or a tied weight sharded two ways is a ``ValueError`` naming the module.
    ``on_comm(op, nbytes)`` is called for every collective the parallel model issues (see
    :mod:`meshzero.parallel.tensor_comms`)."""
    entries = parse_plan(plan)
    ctx = TensorParallelContext(tp_group, group_size(tp_group), group_rank(tp_group),
                                sequence_parallel, on_comm)
    matched = match_plan(model, entries)
    for name, entry in matched.items():
        validate_entry(name, model.get_submodule(name), entry, ctx)
    # 0. the parallel layers, still without weights (on the meta device), and their layouts
    layers = {name: _empty_layer(model.get_submodule(name), entry, ctx)
              for name, entry in matched.items() if entry.style in LAYER_STYLES}
    _check_ties(model, layers)
    # 1. attribute fixes and hooks, before any layer changes: a hook may refuse the model, or
    #    swap a module for one that keeps the same child names.
    for name, entry in matched.items():
        module = model.get_submodule(name)
        for attr in entry.divide_attrs:
            setattr(module, attr, getattr(module, attr) // ctx.tp_size)
        if entry.hook is not None:
            new = entry.hook(name, module, ctx)
            if new is not None:
                model = _replace(model, name, new)
    # 2. the layers take this rank's slices of the full weights (tied weights stay tied)
    shards: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}
    for name, layer in layers.items():
        module = model.get_submodule(name)
        for pname in ("weight", "bias"):
            full = getattr(module, pname, None)
            if full is not None:
                setattr(layer, pname, _shard_param(full, layer.tp_layouts.get(pname), ctx, shards))
        layer._mark()
        model = _replace(model, name, layer.train(module.training))
    # 3. sequence-parallel region boundaries and gradient sums (forward and grad hooks)
    if sequence_parallel and ctx.tp_size > 1:
        grads = _SequenceParallelGrads(ctx)
        for name, entry in matched.items():
            if entry.style in REGION_STYLES:
                _sequence_region(name, model.get_submodule(name), entry.style, ctx, grads)
    return model


def _empty_layer(module: nn.Module, entry: PlanEntry, ctx: TensorParallelContext
                 ) -> TensorParallelLayer:
    """The parallel layer for ``module`` (validated), its parameters on the meta device."""
    common: dict[str, Any] = {
        "tp_group": ctx.tp_group, "on_comm": ctx.on_comm, "device": "meta",
        "dtype": module.weight.dtype,
        "sequence_parallel": ctx.sequence_parallel and entry.sequence_parallel}
    if entry.style == "vocab":
        assert isinstance(module, nn.Embedding)  # validate_entry refused any other module
        return VocabParallelEmbedding(module.num_embeddings, module.embedding_dim,
                                      module.padding_idx, **common)
    dims = linear_dims(module)
    assert dims is not None  # validate_entry refused a module that is not linear-like
    in_features, out_features, transposed = dims
    bias = module.bias is not None
    if entry.style == "rowwise":
        layer: TensorParallelLayer = RowParallelLinear(in_features, out_features, bias, **common)
    else:
        layer = ColumnParallelLinear(in_features, out_features, bias, num_fused=entry.fused,
                                     gather_output=entry.style == "colwise_gather", **common)
    if transposed:  # Conv1D: gather_tensor_parallel_state_dict returns the (in, out) original
        layer.tp_layouts["weight"] = replace(layer.tp_layouts["weight"], transposed=True)
    return layer


def _check_ties(model: nn.Module, layers: dict[str, TensorParallelLayer]) -> None:
    """A tensor shared by several modules must be sharded the same way by all of them."""
    planned: dict[int, tuple[str, ShardLayout]] = {}
    for name, layer in layers.items():
        module = model.get_submodule(name)
        for pname, layout in layer.tp_layouts.items():
            full = getattr(module, pname, None)
            if full is None:
                continue
            first, first_layout = planned.setdefault(id(full), (f"{name}.{pname}", layout))
            if first_layout != layout:
                raise ValueError(f"{name}.{pname} is tied to {first}, but the plan shards them "
                                 f"differently ({layout} vs {first_layout})")
    for prefix, module in model.named_modules(remove_duplicate=False):
        if prefix in layers:
            continue
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in planned:
                name = f"{prefix}.{pname}" if prefix else pname
                raise ValueError(f"parameter {name} is tied to {planned[id(param)][0]}, which "
                                 f"the plan shards; add a plan entry that shards {name} the "
                                 "same way")


def _shard_param(full: nn.Parameter, layout: ShardLayout | None, ctx: TensorParallelContext,
                 shards: dict[int, tuple[torch.Tensor, nn.Parameter]]) -> nn.Parameter:
    """This rank's shard of ``full`` as a new parameter, made once per tensor (ties stay
    ties); a replicated parameter (``layout`` None: a row-parallel bias) is kept as it is.
    ``shards`` holds each full tensor too, so that its id is not reused while applying."""
    if layout is None:
        return full
    if id(full) not in shards:
        data = full.detach().t() if layout.transposed else full.detach()
        local = shard_tensor(data, layout, ctx.tp_size, ctx.tp_rank)
        shards[id(full)] = (full, nn.Parameter(local, requires_grad=full.requires_grad))
    return shards[id(full)][1]


def _replace(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    if not name:
        return new
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)
    return model


def _sequence_region(name: str, module: nn.Module, style: str, ctx: TensorParallelContext,
                     grads: _SequenceParallelGrads) -> None:
    """Hooks for a region style under sequence parallelism (see plans.py)."""
    if style in ("sequence_parallel", "sequence_gather"):
        module.register_forward_pre_hook(grads)
    if style in ("sequence_scatter", "sequence_gather"):
        module.register_forward_hook(partial(_region_output, name=name, style=style, ctx=ctx))


class _SequenceParallelGrads:
    """Forward pre-hook of a module in the sequence-parallel region. The module sees T/N
    positions, so the gradients of its replicated parameters are partial: a gradient hook on
    each sums them over the tp group as they are computed, before any optimizer or ZeRO hook
    sees them. Hooks are added at forward time, once per parameter object, so parameters
    that are replaced later (a deep copy, a ZeRO rebuild) get theirs too."""

    def __init__(self, ctx: TensorParallelContext) -> None:
        self.ctx = ctx
        # id -> weak reference: a tensor's == is elementwise, so no WeakSet
        self.hooked: dict[int, weakref.ref[torch.Tensor]] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> _SequenceParallelGrads:
        return self  # shared by copies: holds the group and which tensors are hooked

    def __call__(self, module: nn.Module, args: Any) -> None:
        for sub in module.modules():
            if isinstance(sub, TensorParallelLayer):  # its own gradients are complete
                continue
            for param in sub.parameters(recurse=False):
                seen = self.hooked.get(id(param))
                if param.requires_grad and (seen is None or seen() is not param):
                    self.hooked[id(param)] = weakref.ref(param)
                    param.register_hook(partial(all_reduce_sum, group=self.ctx.tp_group,
                                                on_comm=self.ctx.on_comm))


def _region_output(module: nn.Module, args: Any, output: Any, *, name: str, style: str,
                   ctx: TensorParallelContext) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"{module_label(name)}: style {style!r} needs a module that returns one "
                         f"tensor, got {type(output).__name__}")
    if style == "sequence_scatter":  # (..., T, C) -> (..., T/N, C)
        return scatter_to_sequence_parallel_region(output, ctx.tp_group, ctx.on_comm)
    # (..., T/N, C) -> (..., T, C); the consumers hold whole gradients: backward splits
    return gather_from_sequence_parallel_region(output, ctx.tp_group, ctx.on_comm,
                                                tensor_parallel_output_grad=False)
