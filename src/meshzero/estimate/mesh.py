"""Tensor and pipeline parallelism in the estimate: each pipeline rank's module cut as the
engine cuts it (``parallel/compose.py``), and its activations under a schedule.

The engine keeps pp rank r's stage(s) of the layer list (``parallel/pipeline.py``: the same
``split_stages`` cut, the same stage-to-rank placement), replaces the planned Linear and
Embedding layers of what is left by their tp slices (``parallel/tensor.py``), and ZeRO shards
that local module over the dp = world / (tp * pp) ranks of its (pp, tp) coordinate. Here the
same functions run on a deep copy of the meta-device model, tensor parallelism over a fake
process group (``init_process_group("fake")``: collectives are no-ops), so the local modules
have exactly the engine's parameters in the engine's order. Every tp rank of a stage holds
the same shapes (the plan's sizes must divide by tp), so tp rank 0 stands for all.

Activations under a pipeline: a stage keeps the activations of every micro-batch whose
forward has run and whose backward has not. Assumed in flight at once on stage s of P
stages with M micro-batches: M (gpipe, looped_bfs), min(M, P - s) (1f1b), and M for the
other schedules (an upper bound). A stage's peak is then (k - 1) x what one micro-batch
keeps after its forward + the peak of one forward/backward; a rank's is the sum over its
stages (an upper bound when it runs two or more).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from meshzero.estimate.activations import (
    DTYPES,
    ActivationProfile,
    _drop_grad,
    _inputs,
    _LiveBytes,
    _loss,
    _swap_to_fake,
)
from meshzero.estimate.model import ModelSpec
from meshzero.estimate.settings import Settings

if TYPE_CHECKING:  # the parallel modules load lazily, when an estimate cuts a model
    from meshzero.parallel.pipeline_split import StageModule


@dataclass
class RankModule:
    """What one pp rank trains (tp rank 0): its module and its stage modules by index."""

    pp_rank: int
    module: nn.Module
    stages: dict[int, nn.Module] = field(default_factory=dict)  # empty without a pipeline
    num_stages: int = 1


@contextlib.contextmanager
def fake_tp_group(tp: int) -> Iterator[dist.ProcessGroup | None]:
    """A fake process group of ``tp`` ranks (this one rank 0) as the default group, for as
    long as the block runs; None when tp is 1."""
    if tp == 1:
        yield None
        return
    if dist.is_initialized():
        raise ValueError("estimating tensor parallelism builds the tp-local model over a fake "
                         "process group, which needs a process without one: run the estimate "
                         "outside torch.distributed (e.g. the meshzero estimate command)")
    _register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=tp)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _register_fake_backend() -> None:
    """torch implements the "fake" process group (every collective a no-op) in C++ but
    registers its Python constructor only from a private testing module; register it here
    (registering again replaces the entry, so this is safe to repeat)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common_opts, backend_opts):  # the extended_api signature
        return FakeProcessGroup._create_internal(common_opts.group_rank,
                                                 common_opts.group_size, backend_opts)

    dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "cuda"])


def pipeline_layout_of(spec: ModelSpec, s: Settings, given=None):
    """The layout the engine would get: ``given`` (initialize's pipeline_layout), else the
    config's layers/first/last."""
    from meshzero.parallel.pipeline import PipelineLayout

    if given is not None:
        return given
    return PipelineLayout(layers=s.pp_layers, first=s.pp_first, last=s.pp_last)


def _tp_plan(s: Settings) -> dict | None:
    if s.tp == 1 or s.tp_plan is None:  # the config requires a plan when tp > 1
        return None
    from meshzero.parallel.plans import shipped_plan

    return shipped_plan(s.tp_plan)


def rank_modules(spec: ModelSpec, s: Settings, layout, group) -> list[RankModule]:
    """Every pp rank's module after the pipeline and tensor cuts (call inside
    ``fake_tp_group(s.tp)``, passing its group)."""
    from meshzero.parallel.plans import match_plan, parse_plan
    from meshzero.parallel.tensor import apply_tensor_parallel

    plan = _tp_plan(s)
    model = copy.deepcopy(spec.model) if plan is not None else spec.model
    try:
        if plan is not None:
            match_plan(model, parse_plan(plan))
        if s.pp == 1:
            whole = apply_tensor_parallel(model, plan, group) if plan is not None else model
            return [RankModule(0, whole)]
        stage_modules, ranks = _cut(model, s, layout)
        shown: list[nn.Module] = list(stage_modules)  # a rank's tp-cut stage replaces its own
        out = []
        for r in range(s.pp):
            local = [st for st in range(len(stage_modules)) if ranks[st] == r]
            from meshzero.parallel.pipeline import _rank_module

            module = _rank_module(model, stage_modules, local)
            if plan is not None:  # only the patterns of modules on this rank (as cut_model)
                names = [n for n, _ in module.named_modules()]
                own = {k: v for k, v in plan.items() if any(fnmatchcase(n, k) for n in names)}
                module = apply_tensor_parallel(module, own, group)
                if len(local) == 1:
                    shown[local[0]] = module
            out.append(RankModule(r, module, {st: shown[st] for st in local}, len(shown)))
        return out
    except ValueError as exc:
        raise ValueError(f"{spec.name}: {exc}") from None


def _cut(model: nn.Module, s: Settings, layout) -> tuple[list[StageModule], list[int]]:
    from meshzero.parallel.pipeline import V_SCHEDULES, _cut, _stages_per_rank, stage_rank

    num_stages = s.pp * _stages_per_rank(s.pp_schedule, s.pp_stages_per_rank)
    stages = _cut(model, layout, num_stages, s.pp_boundaries)
    v = s.pp_schedule in V_SCHEDULES
    return stages, [stage_rank(st, s.pp, v_shape=v) for st in range(num_stages)]


def in_flight(s: Settings, stage: int, num_stages: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once (module docstring)."""
    m = s.grad_accum
    if s.pp_schedule == "1f1b":
        return min(m, num_stages - stage)
    return m


def stage_inputs(spec: ModelSpec, s: Settings, layout, micro_batch: int, seq_len: int | None
                 ) -> tuple[tuple, list[tuple[torch.Tensor, ...]]]:
    """(first stage's arguments, every stage's outputs as meta tensors) for one micro-batch,
    from the whole (uncut) model on the meta device, as build_pipeline infers them."""
    from meshzero.parallel.pipeline_split import infer_stage_shapes

    args, kwargs = _inputs(spec, micro_batch, seq_len, DTYPES[s.precision])
    if kwargs or not args:
        raise ValueError(f"{spec.name}: a pipeline estimate needs positional inputs (a pipeline "
                         "passes tensors between stages); give inputs=fn(micro_batch, seq_len)")
    stages, _ = _cut(spec.model, s, layout)  # skeletons only: the model is not changed
    return args, infer_stage_shapes(spec.model, stages, args)


def profile_rank(spec: ModelSpec, rank: RankModule, s: Settings, *, micro_batch: int,
                 seq_len: int | None, args: tuple, outputs: list, unit_paths: list[str]
                 ) -> ActivationProfile:
    """Activations (with the micro-batches in flight) and FLOPs of one micro-batch of a pp
    rank's stages, on fake tensors."""
    start = time.perf_counter()
    dtype = DTYPES[s.precision]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    restore = _swap_to_fake(rank.module, mode, dtype)
    order: list[int] = []
    handles = []
    peak = flops = 0
    try:
        for index, path in enumerate(unit_paths):
            module = rank.module.get_submodule(path)
            handles.append(module.register_forward_pre_hook(
                lambda _m, _a, index=index: order.append(index)))
            if s.activation_checkpointing and path:
                module.forward = functools.partial(checkpoint, module.forward,
                                                   use_reentrant=False, preserve_rng_state=False)
        with mode:
            for p in rank.module.parameters():
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(_drop_grad))
            for st, stage in sorted(rank.stages.items()):
                last = st == rank.num_stages - 1
                kept, one, f = _run_stage(spec, stage, args, outputs, st, last, dtype)
                peak += (in_flight(s, st, rank.num_stages) - 1) * kept + one
                flops += f
    finally:
        for h in handles:
            h.remove()
        for path in unit_paths:
            rank.module.get_submodule(path).__dict__.pop("forward", None)
        restore()
    return ActivationProfile(micro_batch, seq_len, peak, flops, tuple(order),
                             time.perf_counter() - start)


def _run_stage(spec: ModelSpec, stage: nn.Module, args: tuple, outputs: list, st: int,
               last: bool, dtype: torch.dtype) -> tuple[int, int, int]:
    """(bytes kept after forward, peak, FLOPs) of one micro-batch through one stage."""
    if st == 0:
        inputs = args
    else:  # received activations: fresh leaves in the compute dtype
        inputs = tuple(torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype)
                       .requires_grad_(t.requires_grad) for t in outputs[st - 1])
    preexisting = {t.untyped_storage()._cdata for t in
                   [*stage.parameters(), *stage.buffers(), *inputs]}
    counter = _LiveBytes(preexisting)
    with counter:
        out = stage(*inputs)
        kept = counter.live
        if last:
            targets = args[0] if not args[0].is_floating_point() else None
            loss = _loss(spec, out, (targets,) if targets is not None else (), {})
            loss.backward()
            del loss
        else:  # the gradient of the output arrives from the next stage
            outs = out if isinstance(out, tuple) else (out,)
            grads = [torch.ones_like(o) for o in outs if o.requires_grad]
            torch.autograd.backward([o for o in outs if o.requires_grad], grads)
            del grads, outs
        del out
    return kept, counter.peak, counter.flops


def mesh_note(s: Settings, dp: int, pp_rank: int, dp_rank: int) -> str:
    """What the per-GPU figures of a tp/pp estimate are."""
    text = (f"mesh: tp {s.tp} x pp {s.pp} x dp {dp}; model states of the rank holding the most "
            f"(pp rank {pp_rank}, dp rank {dp_rank}, tp rank 0: every tp rank holds the same "
            "shapes), ZeRO sharding over the dp ranks; activations and FLOPs per micro-batch: "
            "the largest pp rank's")
    if s.pp > 1:
        flight = ("min(micro-batches, stages - stage)" if s.pp_schedule == "1f1b"
                  else "all micro-batches")
        text += (f"; activations assume {flight} in flight per stage ({s.pp_schedule}, "
                 f"{s.grad_accum} micro-batches)")
    return text
