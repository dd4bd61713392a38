"""Tensor and pipeline parallelism in the engine: cut the model before ZeRO sees it, and the
pipeline's ``train_batch``.

Order at ``initialize``: every rank starts from rank 0's full model (one broadcast over the
world), the pipeline keeps this rank's stage(s) (``parallel/pipeline.py``), tensor
parallelism replaces the planned Linear/Embedding layers of what is left by their tp slices
(``parallel/tensor.py``), and ZeRO then shards the remaining local parameters over the
data-parallel ranks of the same (pp, tp) coordinate. Gradient norms add the tp and pp parts
(a tensor replicated over tp, or tied across pp stages, counted once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshzero.comm import CommStats, Communicator
from meshzero.config import Config
from meshzero.topology import Topology


def broadcast_from_world_rank0(model: nn.Module, topology: Topology) -> None:
    """Every rank starts from rank 0's parameters and buffers (before tp/pp cut them)."""
    from meshzero.engine import _broadcast_module

    if topology.world_size > 1:
        _broadcast_module(model, Communicator(dist.group.WORLD, "init", CommStats()), src=0)


def cut_model(model: nn.Module, config: Config, topology: Topology, device: torch.device, *,
              loss_fn: Callable | None, example_inputs: Any, pipeline_layout: Any,
              micro_batches: int, stats: CommStats):
    """``(module this rank trains, Pipeline or None)`` after pipeline and tensor cuts."""
    pipe = None
    pp, tp = config.pipeline_parallel, config.tensor_parallel
    plan = shipped_plan(tp.plan) if tp.size > 1 else None
    if plan is not None and pp.size > 1:  # check the plan on the whole model, before the cut
        from meshzero.parallel.plans import match_plan, parse_plan

        match_plan(model, parse_plan(plan))
    if pp.size > 1:
        from meshzero.parallel.pipeline import PipelineLayout, build_pipeline

        if loss_fn is None or example_inputs is None:
            raise ValueError(f"pipeline_parallel.size = {pp.size} needs initialize(loss_fn=..., "
                             "example_inputs=...): the last stage computes the loss, and one "
                             "micro-batch of inputs fixes the shapes sent between stages")
        if tp.sequence_parallel:
            raise ValueError("tensor_parallel.sequence_parallel with pipeline_parallel is not "
                             "supported: activations between stages would be split along the "
                             "sequence")
        layout = pipeline_layout or PipelineLayout(layers=pp.layers, first=tuple(pp.first),
                                                   last=tuple(pp.last))
        pipe = build_pipeline(model, pp_group=topology.groups["pp"], schedule=pp.schedule,
                              micro_batches=micro_batches, loss_fn=loss_fn,
                              example_inputs=example_inputs, layout=layout,
                              stages_per_rank=pp.stages_per_rank, boundaries=pp.boundaries,
                              device=device)
        model = pipe.module
    if tp.size > 1:
        from meshzero.parallel.tensor import apply_tensor_parallel

        if pipe is not None:  # only the patterns of modules on this rank's stage(s)
            names = [n for n, _ in model.named_modules()]
            plan = {k: v for k, v in plan.items() if any(fnmatchcase(n, k) for n in names)}
        tp_inter = topology.spans_nodes(topology.groups["tp"])

        def on_comm(op: str, nbytes: int) -> None:  # tp collectives, into comm_report()
            counted = stats.get("tp", op, tp_inter)
            counted.count += 1
            counted.bytes += nbytes

        model = apply_tensor_parallel(model, plan, topology.groups["tp"],
                                      sequence_parallel=tp.sequence_parallel, on_comm=on_comm)
        if pipe is not None and len(pipe.stages) > 1:
            _share_replaced_modules(model, [st.submod for st in pipe.stages])
        if pipe is not None:  # tied tensors across stages are now the tp slices
            for tied in pipe.tied_parameters:
                tied.param = next(p for n, p in model.named_parameters(remove_duplicate=False)
                                  if n in tied.names)
    return model, pipe


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


def shipped_plan(plan: str | dict) -> dict:
    """``tensor_parallel.plan``: a shipped plan's name, or the plan itself."""
    if not isinstance(plan, str):
        return plan
    from meshzero.parallel.plans import SHIPPED_PLANS as shipped

    if plan not in shipped:
        raise ValueError(f"tensor_parallel.plan = {plan!r} is not a shipped plan; valid: "
                         f"{', '.join(shipped)}, or a {{module pattern: style}} mapping")
    return shipped[plan]


def norm_weights(module: nn.Module, topology: Topology, pipe) -> dict[int, float] | None:
    """id(param) -> its weight in the global gradient norm: 1/tp for a tensor every tp rank
    holds whole, 0 for a tied tensor another pp rank owns; None when all weights are 1."""
    if topology.tp_size == 1 and pipe is None:
        return None
    from meshzero.parallel.tensor import is_tp_sharded

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


def train_batch(engine, data_iter: Iterator | None) -> torch.Tensor:
    """One optimizer step of ``micro_batches`` micro-batches through the pipeline; every pp
    rank returns the mean loss. ``data_iter`` yields ``(inputs, targets)`` micro-batches
    (needed on the first and last stage; every rank of a dp replica must see the same)."""
    pipe = engine.pipeline
    if pipe is None:
        raise ValueError("train_batch() drives a pipeline (pipeline_parallel.size > 1); "
                         "without one use engine(x), engine.backward(loss), engine.step()")
    inputs = targets = None
    if pipe.has_first_stage or pipe.has_last_stage:
        if data_iter is None:
            raise ValueError("train_batch() needs data_iter on the first and last stage")
        items = [next(data_iter) for _ in range(pipe.micro_batches)]
        inputs = torch.cat([x for x, _ in items]).to(engine.device)
        targets = torch.cat([y for _, y in items]).to(engine.device)
    engine._open_window()
    engine.comm_stats.phase = "backward"  # forward and backward interleave in a schedule
    pipe.loss_scale = engine.loss_scaler.scale
    engine.zero.reducer.enabled = False  # grads accumulate in .grad over the micro-batches
    hooks = _phase_hooks(engine, pipe)
    try:
        loss = pipe.step(inputs, targets, broadcast_loss=True)
    finally:
        engine.zero.reducer.enabled = True
        for h in hooks:
            h.remove()
    _count_p2p(engine, pipe)
    engine.zero.reducer.reduce_param_grads()
    engine.micro_steps += engine.grad_accum - 1
    engine.step()
    return loss


def _phase_hooks(engine, pipe) -> list:
    """Profiling a pipeline step: a stage's forward counts as forward, and what runs after
    it until the next forward (its backward) as backward."""
    if engine._profiler is None:
        return []
    counter = engine._profiler.counter
    hooks = []
    for stage in pipe.stages:
        module = stage.submod
        hooks.append(module.register_forward_pre_hook(
            lambda *_: counter.set_phase("forward")))
        hooks.append(module.register_forward_hook(lambda *_: counter.set_phase("backward")))
    return hooks


def _count_p2p(engine, pipe) -> None:
    """The activations and their gradients this rank sent between pipeline stages: the
    schedule's shapes are fixed, so the bytes are the stage shapes times the micro-batches."""
    from meshzero.parallel.pipeline import V_SCHEDULES, stage_rank

    topo = engine.topology
    v = pipe.schedule_name in V_SCHEDULES

    def send(stage: int, to_stage: int, tensors) -> None:
        peer = stage_rank(to_stage, pipe.pp_size, v_shape=v)
        if peer == pipe.pp_rank:
            return
        nbytes = pipe.micro_batches * sum(t.numel() * t.element_size() for t in tensors)
        inter = topo.node_of(dist.get_global_rank(pipe.pp_group, peer)) != topo.node_of(
            topo.rank)
        counted = engine.comm_stats.get("pp", "send_recv", inter)
        counted.count += pipe.micro_batches
        counted.bytes += nbytes

    for s, (inputs, outputs) in pipe.stage_shapes.items():
        if s < pipe.num_stages - 1:
            send(s, s + 1, outputs)  # forward activations
        if s > 0:
            send(s, s - 1, inputs)  # gradients of the inputs, in backward
