"""Pipeline parallelism: a model's layer list cut into stages, run by a schedule of
``torch.distributed.pipelining`` over the pipeline-parallel process group.

Usage (every rank of the pp group runs the same code)::

    from meshzero.demo.layout import GPT_LAYOUT
    from meshzero.parallel.pipeline import build_pipeline

    pipe = build_pipeline(
        model,                          # the full model, on every rank (CPU, GPU or meta)
        pp_group=pp_group,              # the ranks of one pipeline, in stage order
        layout=GPT_LAYOUT,              # embeddings | blocks | ln_f + head
        schedule="1f1b",                # see SCHEDULES
        micro_batches=4,
        loss_fn=loss_fn,                # loss_fn(output, target) -> mean loss of a micro-batch
        example_inputs=torch.zeros(2, 64, dtype=torch.long),  # ONE micro-batch, any device
    )
    optimizer = torch.optim.AdamW(pipe.module.parameters())  # this rank's layers only
    loss = pipe.step(x, y, broadcast_loss=True)  # x on the first stage, y on the last
    optimizer.step(); optimizer.zero_grad()

What ``build_pipeline`` does:

- ``split_stages`` splits ``layout.layers`` into ``pp_size * stages_per_rank`` contiguous
  stages, balanced by parameter count (or at explicit ``boundaries``); the layout's first
  part (embeddings) joins stage 0, its last part (final norm, head) the last stage.
- Stage s lives on pp rank ``s % pp_size`` (looped schedules) or, for the V schedules
  (``zbv_zero_bubble``, ``dualpipev``: two stages per rank), rank ``s`` for ``s < pp_size``
  and ``2 * pp_size - 1 - s`` after.
- ``pipe.module`` holds only this rank's layers, under the original model's names
  (``blocks.2.attn.qkv.weight``); the other layers' tensors are freed (``free_unused``), so
  the model object passed in must not be used afterwards.
- Activation shapes between stages come from running the chain once on the meta device and
  are passed to ``PipelineStage`` explicitly (static mode: no shape inference at run time).
- A tensor used by two stages on different ranks (a head tied to the embedding) is held by
  both; after each step its gradient contributions are summed on every holder
  (``sync_tied_grads``), so both holders apply the same update.

Loss and gradient scaling: ``loss_fn`` returns the mean loss of one micro-batch; every
micro-batch backpropagates ``loss * loss_scale / micro_batches``, so after ``step`` each
stage's ``.grad`` holds ``loss_scale`` times the gradient of the mean loss over the
``micro_batches`` micro-batches (the whole local batch), added to what ``.grad`` held before.
``step`` returns that mean loss (unscaled, detached) on the rank holding the last stage, or
on every rank with ``broadcast_loss=True``.

The caller (the engine) owns everything around a step: zeroing grads, averaging them over
data-parallel replicas, clipping (count a tied tensor once: ``owns_parameter``), the
optimizer step, and ``loss_scale`` for fp16 loss scaling or gradient accumulation over
several ``step`` calls. ``pipeline_state.gather_pipeline_state_dict`` reassembles full
tensors under the original names (for tests and small models).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from meshzero.comm import OnComm, broadcast, exchange
from meshzero.parallel.pipeline_split import (
    PipelineLayout,
    StageModule,
    infer_stage_shapes,
    layer_list,
    prune_into,
    split_stages,
)

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PipelineLayout",
    "TiedParameter",
    "build_pipeline",
    "schedule_class",
    "split_stages",
]

logger = logging.getLogger(__name__)

# Our names (as in the config's pipeline_parallel.schedule) -> torch's schedule classes.
SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
SINGLE_STAGE_SCHEDULES = frozenset({"gpipe", "1f1b"})  # exactly one stage per rank
V_SCHEDULES = frozenset({"zbv_zero_bubble", "dualpipev"})  # exactly two, placed as a V


def _normalized(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def schedule_class(name: str) -> tuple[str, type]:
    """(our name, torch class) of a schedule; case, '_' and '-' are ignored, so torch's own
    names ("GPipe", "Interleaved1F1B") work too."""
    for ours, cls in SCHEDULES.items():
        if _normalized(name) == _normalized(ours):
            return ours, cls
    raise ValueError(
        f"unknown pipeline schedule {name!r}; valid schedules: {', '.join(SCHEDULES)}"
    )


def stage_rank(stage: int, pp_size: int, *, v_shape: bool) -> int:
    """The pp rank that runs ``stage``: looped (s % pp) or V-shaped (0..p-1, p-1..0)."""
    if v_shape and stage >= pp_size:
        return 2 * pp_size - 1 - stage
    return stage % pp_size


@dataclass
class TiedParameter:
    """A tensor held by stages on more than one pp rank (e.g. an embedding tied to the
    head): ``names`` are its names in the original model, ``ranks`` the holding pp ranks."""

    param: nn.Parameter
    names: tuple[str, ...]
    ranks: tuple[int, ...]


class Pipeline:
    """This rank's part of a pipeline: its stage module(s), PipelineStages and the schedule.
    Built by ``build_pipeline``; ``step`` runs one schedule step of ``micro_batches``."""

    def __init__(
        self,
        *,
        module: nn.Module,
        stage_modules: dict[int, StageModule],
        stage_shapes: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]],
        num_stages: int,
        schedule: str,
        micro_batches: int,
        loss_fn: Callable[[object, torch.Tensor], torch.Tensor],
        pp_group: dist.ProcessGroup,
        device: torch.device,
        tied: list[TiedParameter],
        state_dict_keys: list[str],
    ) -> None:
        self.schedule_name, cls = schedule_class(schedule)
        self.module = module
        self.stage_indices = sorted(stage_modules)
        self.num_stages = num_stages
        self.micro_batches = micro_batches
        self.pp_group = pp_group
        self.on_comm: OnComm | None = None  # counts the pp collectives (CommStats.counter)
        self.pp_rank = dist.get_rank(pp_group)
        self.pp_size = dist.get_world_size(pp_group)
        self.device = device
        self.tied_parameters = tied
        self.state_dict_keys = state_dict_keys
        self.stage_shapes = stage_shapes  # (inputs, outputs) of each local stage, on meta
        self.loss_scale = 1.0  # the engine sets it: fp16 loss scale, 1 / accumulation steps
        self.has_first_stage = 0 in stage_modules
        self.has_last_stage = num_stages - 1 in stage_modules
        self.last_stage_rank = stage_rank(
            num_stages - 1, self.pp_size, v_shape=self.schedule_name in V_SCHEDULES
        )
        self._loss_fn = loss_fn
        self._losses: list[torch.Tensor] = []
        self._inputs = stage_shapes[0][0] if self.has_first_stage else ()
        self.stages = [
            PipelineStage(
                stage_modules[s],
                stage_index=s,
                num_stages=num_stages,
                device=device,
                input_args=stage_shapes[s][0],
                output_args=stage_shapes[s][1],
                group=pp_group,
            )
            for s in self.stage_indices
        ]
        # scale_grads=False: the 1 / micro_batches is in the loss (_scaled_loss) instead.
        stages = self.stages[0] if self.schedule_name in SINGLE_STAGE_SCHEDULES else self.stages
        self.schedule = cls(stages, micro_batches, loss_fn=self._scaled_loss, scale_grads=False)

    def drop_groups(self) -> None:
        """The engine closed: hold the pp group no more (comm.CommStats.drop_groups)."""
        del self.pp_group, self.stages, self.schedule

    def _scaled_loss(self, output: object, target: torch.Tensor) -> torch.Tensor:
        loss = self._loss_fn(output, target)
        self._losses.append(loss.detach())
        return loss * (self.loss_scale / self.micro_batches)

    def step(
        self,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
        targets: torch.Tensor | None = None,
        *,
        broadcast_loss: bool = False,
    ) -> torch.Tensor | None:
        """One schedule step over ``micro_batches`` micro-batches of the local batch.

        ``inputs`` (first stage) and ``targets`` (last stage) are whole local batches of
        ``micro_batches * micro_batch_size`` samples (dim 0); other ranks may pass None.
        Gradients are added to the stage parameters' ``.grad`` (see the module docstring)
        and tied gradients are summed across their holders. Returns the mean loss on the
        last stage's rank (every rank with ``broadcast_loss``), else None.
        """
        args, target = self._local_batch(inputs, targets, "step")
        self.schedule.step(*args, target=target, return_outputs=False)
        self.sync_tied_grads()
        loss = self._mean_loss()
        return self.broadcast_loss(loss) if broadcast_loss else loss

    def _local_batch(self, inputs: torch.Tensor | Sequence[torch.Tensor] | None,
                     targets: torch.Tensor | None, call: str) -> tuple[tuple, torch.Tensor | None]:
        """This rank's part of a schedule call: the first stage's inputs, the last stage's
        targets (checked to split into micro-batches); the losses of the last call cleared."""
        args = self._check_inputs(inputs) if self.has_first_stage else ()
        target = None
        if self.has_last_stage:
            if targets is None:
                raise ValueError(f"Pipeline.{call} needs targets on the rank of the last stage")
            target = self._check_batch(targets, "targets")
        self._losses.clear()
        return args, target

    def _mean_loss(self) -> torch.Tensor | None:
        """The mean loss of the last call's micro-batches on the last stage's rank, else None."""
        if not self.has_last_stage:
            return None
        return torch.stack(self._losses[-self.micro_batches:]).float().mean()

    def evaluate(
        self,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
        targets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, object]:
        """Forward only, without gradients, over ``micro_batches`` micro-batches of the local
        batch (taken as :meth:`step` takes them): ``(mean loss on every rank of the pp group,
        the model's outputs of the whole batch on the last stage's rank, else None)``; a
        collective."""
        if not hasattr(self.schedule, "eval"):
            raise NotImplementedError("evaluating a pipeline needs torch's schedule.eval "
                                      f"(a newer torch than {torch.__version__})")
        args, target = self._local_batch(inputs, targets, "evaluate")
        with torch.no_grad():
            outputs = self.schedule.eval(*args, target=target)
        return self.broadcast_loss(self._mean_loss()), outputs if self.has_last_stage else None

    def _check_batch(self, batch: torch.Tensor, what: str) -> torch.Tensor:
        if batch.dim() == 0 or batch.shape[0] % self.micro_batches:
            raise ValueError(
                f"Pipeline.step {what} of shape {tuple(batch.shape)}: dim 0 must split into "
                f"micro_batches={self.micro_batches} equal micro-batches"
            )
        return batch.to(self.device)

    def _check_inputs(self, inputs) -> tuple[torch.Tensor, ...]:
        if inputs is None:
            raise ValueError("Pipeline.step needs inputs on the rank of the first stage")
        batch = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        if len(batch) != len(self._inputs):
            raise ValueError(
                f"Pipeline.step got {len(batch)} inputs, example_inputs had {len(self._inputs)}"
            )
        for i, (got, ex) in enumerate(zip(batch, self._inputs, strict=True)):
            want = (self.micro_batches * ex.shape[0], *ex.shape[1:])
            if tuple(got.shape) != want or got.dtype != ex.dtype:
                raise ValueError(
                    f"Pipeline.step input {i}: expected {want} {ex.dtype} (micro_batches="
                    f"{self.micro_batches} x example_inputs {tuple(ex.shape)}), got "
                    f"{tuple(got.shape)} {got.dtype}; activation shapes are static"
                )
        return tuple(t.to(self.device) for t in batch)

    def broadcast_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss (fp32 scalar) on every rank of the pp group (a collective)."""
        if self.has_last_stage:
            assert loss is not None, "the last stage's rank must pass its loss"
            buf = loss.detach().float().reshape(1).to(self.device)
        else:
            buf = torch.zeros(1, dtype=torch.float32, device=self.device)
        src = dist.get_global_rank(self.pp_group, self.last_stage_rank)
        broadcast(buf, src, self.pp_group, self.on_comm)
        return buf[0]

    def sync_tied_grads(self) -> None:
        """Sum each tied tensor's gradient over the ranks that hold it, in rank order, so
        every holder has the identical full gradient (as one module using it twice)."""
        for tied in self.tied_parameters:
            p = tied.param
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            peers = [r for r in tied.ranks if r != self.pp_rank]
            received = {r: torch.empty_like(grad) for r in peers}
            exchange([(dist.get_global_rank(self.pp_group, r), grad, received[r]) for r in peers],
                     self.pp_group, self.on_comm)
            parts = {**received, self.pp_rank: grad}
            total = parts[tied.ranks[0]].clone()
            for r in tied.ranks[1:]:
                total += parts[r]
            if p.grad is None:
                p.grad = total
            else:
                p.grad.copy_(total)  # keep the grad tensor: it may view a flat buffer

    def owns_parameter(self, param: torch.Tensor) -> bool:
        """Whether this rank counts ``param`` (in a gradient norm, a parameter count): every
        local parameter, except a tied one whose lowest holding rank is another rank."""
        for tied in self.tied_parameters:
            if tied.param is param:
                return tied.ranks[0] == self.pp_rank
        return True

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()


def build_pipeline(
    model: nn.Module | Sequence[nn.Module],
    *,
    pp_group: dist.ProcessGroup,
    schedule: str,
    micro_batches: int,
    loss_fn: Callable[[object, torch.Tensor], torch.Tensor],
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    layout: PipelineLayout | None = None,
    stages_per_rank: int | None = None,
    boundaries: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    free_unused: bool = True,
) -> Pipeline:
    """This rank's part of ``model`` cut into pipeline stages (see the module docstring).

    ``example_inputs``: one micro-batch of the first stage's inputs (shapes and dtypes
    only; meta tensors are fine). ``stages_per_rank``: virtual stages per rank, default 1
    (2 for the interleaved and V schedules). ``boundaries``: see ``split_stages``.
    ``device``: default cuda's current device under NCCL, else CPU.
    """
    schedule, _ = schedule_class(schedule)
    if isinstance(model, Sequence):
        model = nn.Sequential(*model)
    layout = layout or PipelineLayout()
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    spr = _stages_per_rank(schedule, stages_per_rank)
    pp_rank, pp_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    num_stages = pp_size * spr
    stage_modules = _cut(model, layout, num_stages, boundaries)
    _check_coverage(model, stage_modules)
    examples = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    examples = tuple(torch.empty_like(t, device="meta") for t in examples)
    outputs = infer_stage_shapes(model, stage_modules, examples)
    v_shape = schedule in V_SCHEDULES
    ranks = [stage_rank(s, pp_size, v_shape=v_shape) for s in range(num_stages)]
    local = [s for s in range(num_stages) if ranks[s] == pp_rank]
    module = _rank_module(model, stage_modules, local)
    tied = _tied_parameters(model, stage_modules, ranks, pp_rank)
    if free_unused:
        _free_unused(model, module)
    device = _default_device(pp_group) if device is None else torch.device(device)
    if not any(p.is_meta for p in module.parameters()):
        module.to(device)
    _log_stages(stage_modules, local, pp_rank)
    return Pipeline(
        module=module,
        stage_modules={s: stage_modules[s] for s in local},
        stage_shapes={s: (examples if s == 0 else outputs[s - 1], outputs[s]) for s in local},
        num_stages=num_stages,
        schedule=schedule,
        micro_batches=micro_batches,
        loss_fn=loss_fn,
        pp_group=pp_group,
        device=device,
        tied=tied,
        state_dict_keys=list(model.state_dict().keys()),
    )


def _log_stages(stage_modules: list[StageModule], local: list[int], pp_rank: int) -> None:
    for s in local:
        logger.info(
            "pipeline stage %d of %d on pp rank %d: %s (%d parameters)",
            s, len(stage_modules), pp_rank, ", ".join(stage_modules[s].layer_names),
            sum(p.numel() for p in stage_modules[s].parameters()),
        )


def _cut(
    model: nn.Module, layout: PipelineLayout, num_stages: int, boundaries: Sequence[int] | None
) -> list[StageModule]:
    """A stage module for every stage (skeletons over the model's own submodules)."""
    layers = layer_list(model, layout)
    parts = split_stages([m for _, m in layers], num_stages, boundaries=boundaries)
    return [
        StageModule(
            model,
            layout,
            [layers[i][0] for i in part],
            is_first=s == 0,
            is_last=s == num_stages - 1,
        )
        for s, part in enumerate(parts)
    ]


def _stages_per_rank(schedule: str, requested: int | None) -> int:
    if schedule in SINGLE_STAGE_SCHEDULES:
        if requested not in (None, 1):
            raise ValueError(
                f"schedule {schedule!r} runs one stage per rank, got stages_per_rank="
                f"{requested}; use interleaved_1f1b for more"
            )
        return 1
    if schedule in V_SCHEDULES and requested not in (None, 2):
        raise ValueError(
            f"schedule {schedule!r} runs exactly two stages per rank, got stages_per_rank="
            f"{requested}"
        )
    if requested is not None and requested < 1:
        raise ValueError(f"stages_per_rank must be >= 1, got {requested}")
    return requested or 2


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer name, aliases of tied tensors included."""
    return [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]


def _check_coverage(model: nn.Module, stage_modules: Sequence[nn.Module]) -> None:
    """Every parameter and buffer name of the model must be held by some stage."""
    held = {name for stage in stage_modules for name, _ in _named_tensors(stage)}
    missing = [name for name, _ in _named_tensors(model) if name not in held]
    if missing:
        raise ValueError(
            f"the pipeline layout leaves {len(missing)} tensors on no stage: "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; name their "
            f"modules in PipelineLayout.first / .last"
        )


def _rank_module(model: nn.Module, stage_modules: list[StageModule], local: list[int]) -> nn.Module:
    """The module holding this rank's tensors: its stage, or a skeleton over its stages."""
    if len(local) == 1:
        return stage_modules[local[0]]
    holder = nn.Module()
    prune_into(holder, model, [n for s in local for n in stage_modules[s].pruned_names])
    return holder


def _tied_parameters(
    model: nn.Module, stage_modules: list[StageModule], ranks: list[int], pp_rank: int
) -> list[TiedParameter]:
    """Tensors held on more than one pp rank and held here, in the model's order."""
    holders: dict[int, set[int]] = {}
    for s, stage in enumerate(stage_modules):
        for p in stage.parameters():
            holders.setdefault(id(p), set()).add(ranks[s])
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = []
    for p in model.parameters():
        held = sorted(holders[id(p)])
        if len(held) > 1 and pp_rank in held:
            tied.append(TiedParameter(p, tuple(names[id(p)]), tuple(held)))
    return tied


def _free_unused(model: nn.Module, module: nn.Module) -> None:
    """Release the storage of every model tensor this rank's module does not hold."""
    kept = {id(t) for _, t in _named_tensors(module)}
    for _, t in _named_tensors(model):
        if id(t) not in kept and not t.is_meta:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def _default_device(pp_group: dist.ProcessGroup) -> torch.device:
    if "nccl" in str(dist.get_backend(pp_group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
