"""Tensor and pipeline parallelism applied to a whole model, for ``build.py``: cut the
pipeline, replace the planned layers by their tp slices, and what the engine needs of the
result (gradient-norm weights, communicators over the tp and pp axes, pp byte counts).

Gradient norms add the tp and pp parts: a tensor replicated over tp, or tied across pp
stages, is counted once (``norm_weights``).
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshzero.comm import CommStats, Communicator
from meshzero.parallel.pipeline import (
    V_SCHEDULES,
    Pipeline,
    PipelineLayout,
    build_pipeline,
    stage_rank,
)
from meshzero.parallel.plans import match_plan, parse_plan
from meshzero.parallel.tensor import apply_tensor_parallel, is_tp_sharded
from meshzero.topology import Topology


def check_plan(model: nn.Module, plan: dict) -> None:
    """ValueError naming the pattern or module, on the whole model (before any cut)."""
    match_plan(model, parse_plan(plan))


def cut_pipeline(model: nn.Module, pp: Any, *, topology: Topology, device: torch.device,
                 loss_fn: Callable | None, example_inputs: Any, pipeline_layout: Any,
                 micro_batches: int, sequence_parallel: bool, stats: CommStats) -> Pipeline:
    """This rank's stage(s) of ``model`` (``pp``: the pipeline_parallel config section)."""
    if loss_fn is None or example_inputs is None:
        raise ValueError(f"pipeline_parallel.size = {pp.size} needs initialize(loss_fn=..., "
                         "example_inputs=...): the last stage computes the loss, and one "
                         "micro-batch of inputs fixes the shapes sent between stages")
    if sequence_parallel:
        raise ValueError("tensor_parallel.sequence_parallel with pipeline_parallel is not "
                         "supported: activations between stages would be split along the "
                         "sequence")
    layout = pipeline_layout or PipelineLayout(layers=pp.layers, first=tuple(pp.first),
                                               last=tuple(pp.last))
    pp_group = topology.groups["pp"]
    assert pp_group is not None  # a pipeline is cut only when pp.size > 1, which makes the group
    pipe = build_pipeline(model, pp_group=pp_group, schedule=pp.schedule,
                          micro_batches=micro_batches, loss_fn=loss_fn,
                          example_inputs=example_inputs, layout=layout,
                          stages_per_rank=pp.stages_per_rank, boundaries=pp.boundaries,
                          device=device)
    pipe.on_comm = stats.counter("pp", topology.spans_nodes(topology.groups["pp"]))
    return pipe


def apply_tp(model: nn.Module, plan: dict, *, topology: Topology, sequence_parallel: bool,
             stats: CommStats, pipe: Pipeline | None) -> nn.Module:
    """Replace the planned layers of this rank's module by their tp slices; tp collectives
    are counted into ``stats`` (group "tp")."""
    if pipe is not None:  # only the patterns of modules on this rank's stage(s)
        names = [n for n, _ in model.named_modules()]
        plan = {k: v for k, v in plan.items() if any(fnmatchcase(n, k) for n in names)}
    tp_group = topology.groups["tp"]
    model = apply_tensor_parallel(model, plan, tp_group, sequence_parallel=sequence_parallel,
                                  on_comm=stats.counter("tp", topology.spans_nodes(tp_group)))
    if pipe is not None and len(pipe.stages) > 1:
        _share_replaced_modules(model, [st.submod for st in pipe.stages])
    if pipe is not None:  # tied tensors across stages are now the tp slices
        for tied in pipe.tied_parameters:
            tied.param = next(p for n, p in model.named_parameters(remove_duplicate=False)
                              if n in tied.names)
    return model


def _share_replaced_modules(holder: nn.Module, stages: list[nn.Module]) -> None:
    """A rank running several stages holds them under one skeleton module; tensor
    parallelism replaced modules in that skeleton, so point each stage at the same ones."""
    for stage in stages:
        for name, module in list(stage.named_modules()):
            if not name:
                continue
            current = holder.get_submodule(name)
            if current is not module:
                parent, _, child = name.rpartition(".")
                setattr(stage.get_submodule(parent) if parent else stage, child, current)


def norm_weights(module: nn.Module, topology: Topology, pipe: Pipeline | None
                 ) -> dict[int, float] | None:
    """id(param) -> its weight in the global gradient norm: 1/tp for a tensor every tp rank
    holds whole, 0 for a tied tensor another pp rank owns; None when all weights are 1."""
    if topology.tp_size == 1 and pipe is None:
        return None
    weights = {}
    for p in module.parameters():
        w = 1.0 if is_tp_sharded(p) else 1.0 / topology.tp_size
        if pipe is not None and not pipe.owns_parameter(p):
            w = 0.0
        weights[id(p)] = w
    return weights


def model_parallel_comms(topology: Topology, stats: CommStats) -> list[Communicator]:
    """Communicators over the tp and pp axes (for the gradient norm and overflow)."""
    return [Communicator(topology.groups[axis], axis, stats,
                         inter_node=topology.spans_nodes(topology.groups[axis]))
            for axis in ("tp", "pp") if topology.groups[axis] is not None]


def stage_phase_hooks(pipe: Pipeline, set_phase: Callable[[str], None]) -> list:
    """Profiling a pipeline step: a stage's forward counts as forward, and what runs after
    it until the next forward (its backward) as backward. Returns the hook handles."""
    hooks = []
    for stage in pipe.stages:
        module = stage.submod
        hooks.append(module.register_forward_pre_hook(lambda *_: set_phase("forward")))
        hooks.append(module.register_forward_hook(lambda *_: set_phase("backward")))
    return hooks


def count_p2p(pipe: Pipeline, topology: Topology, stats: CommStats) -> None:
    """The activations and their gradients this rank sent between pipeline stages (the
    schedule runs them inside torch's pipelining, so they are counted here): the schedule's
    shapes are fixed, so the bytes are the stage shapes times the micro-batches."""
    v = pipe.schedule_name in V_SCHEDULES

    def send(to_stage: int, tensors) -> None:
        peer = stage_rank(to_stage, pipe.pp_size, v_shape=v)
        if peer == pipe.pp_rank:
            return
        nbytes = pipe.micro_batches * sum(t.numel() * t.element_size() for t in tensors)
        inter = topology.node_of(dist.get_global_rank(pipe.pp_group, peer)) != topology.node_of(
            topology.rank)
        counted = stats.get("pp", "send_recv", inter)
        counted.count += pipe.micro_batches
        counted.bytes += nbytes

    for s, (inputs, outputs) in pipe.stage_shapes.items():
        if s < pipe.num_stages - 1:
            send(s + 1, outputs)  # forward activations
        if s > 0:
            send(s - 1, inputs)  # gradients of the inputs, in backward
