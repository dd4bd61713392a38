"""The Engine: forward, backward and step with gradient accumulation, mixed precision,
clipping and ZeRO, behind DeepSpeed's ``initialize(model, config) -> engine`` habits."""

from __future__ import annotations

import logging
import math
import os
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from meshzero.build import build
from meshzero.checkpoint import StepCounters, TrainingState
from meshzero.checkpoint.methods import CheckpointMethods
from meshzero.comm import CommStats
from meshzero.compile import CompileMethods
from meshzero.config import Config, load_config
from meshzero.config.load import log_accepted
from meshzero.data import Repeating, micro_batch_from_data
from meshzero.data.window import AccumulationWindow
from meshzero.faults import StepGuard
from meshzero.log import setup_logging, warn_once
from meshzero.parallel.compose import count_p2p, stage_phase_hooks
from meshzero.precision import autocast, cast_inputs
from meshzero.profiling.monitor import Monitor, StepRecord, comm_events, comm_rows, step_events
from meshzero.profiling.report import ProfileReport
from meshzero.profiling.session import EngineProfiling
from meshzero.schedulers import LayerDropSchedule
from meshzero.topology import Topology
from meshzero.zero.state import ZeroModelState

logger = logging.getLogger(__name__)


def _counter(name: str) -> property:
    """An engine attribute that reads and writes ``engine.counters.<name>``."""
    return property(lambda self: getattr(self.counters, name),
                    lambda self, value: setattr(self.counters, name, value),
                    doc=f"StepCounters.{name}")


def release(stats: CommStats, zero: ZeroModelState, block: bool) -> None:
    """The end of an engine: wait for (``block``; not after an error: a peer may never join)
    the collectives in flight, close ``zero``, let go of the process groups. Idempotent."""
    if zero.closed:
        return
    try:
        left = stats.finish_pending(block=block)
    finally:
        zero.close()
        stats.drop_groups()
    if left:
        logger.warning("closed with %d collective(s) still in flight (a rank failed or a "
                       "collective was never matched); they were not waited on", left)


class Engine(AccumulationWindow, CheckpointMethods, CompileMethods, nn.Module):
    """Wraps the user's module; ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``."""

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        config: Config,
        *,
        optimizer: torch.optim.Optimizer | type | Callable | None = None,
        model_parameters: Iterable[Any] | None = None,
        lr_scheduler: Callable | None = None,
        loss_fn: Callable | None = None,
        example_inputs: Any = None,
        pipeline_layout: Any = None,
    ):
        super().__init__()
        setup_logging()  # with $RANK (torchrun's) until the process group says
        self.config = config
        Monitor.check(config)  # a missing monitor package fails before any work
        self.layer_drop = LayerDropSchedule.from_config(config.progressive_layer_drop, model)
        built = build(model, config, optimizer=optimizer, model_parameters=model_parameters,
                      lr_scheduler=lr_scheduler, loss_fn=loss_fn, example_inputs=example_inputs,
                      pipeline_layout=pipeline_layout)
        setup_logging(built.topology.rank)  # rank 0 logs INFO, every rank warnings (log.py)
        self.topology: Topology = built.topology
        self.device = built.topology.device
        self.compute_dtype = config.compute_dtype
        self.init_batch(built.batch, built.topology.dp_size)  # data/window.py
        self.monitor = Monitor.from_config(config, built.topology.rank)
        log_accepted(config)
        self.comm_stats = built.comms.stats
        self.comm_stats.group_holders += [h for h in (built.topology, built.pipeline) if h]
        self.dp_comm = built.comms.dp
        self.comm, self.replica_comm = built.comms.shard, built.comms.replica
        self.module, self.pipeline, self.zero = built.module, built.pipeline, built.zero
        self.optimizer, self.lr_scheduler = built.optimizer, built.lr_scheduler
        self.loss_scaler = built.loss_scaler
        self.model_parallel_comms = built.model_parallel_comms  # tp and pp, for norms
        self.norm_weights = built.norm_weights  # id(param) -> weight in the grad norm
        self.sequence_parallel = built.sequence  # Ulysses (parallel/sequence.py) or None
        self.counters = StepCounters()
        self.guard = StepGuard(mode=config.faults.nonfinite_grads, scales_loss=config.scales_loss,
                               comm=self.comm, model_parallel=self.model_parallel_comms,
                               rank=self.topology.rank,  # inf/nan gradients: faults/
                               phases=self.zero.phases)  # the step's phase check rides on it
        # let the ZeRO tier step each unit during backward when nothing global is needed
        # first (False: always in step(); the benchmark's serial baseline)
        self.overlap_offload_step = True
        self._window_open = False
        self._last_comm: dict = {}
        self._last_peak = self.zero.memory.peak
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._step_loss = 0.0  # mean loss of the step's micro-batches, for the monitors
        # the global grad norm (unscaled, before clipping) of the last applied step (None:
        # an fp16 overflow, units stepped during backward by the cpu tier, or no step yet)
        self.last_grad_norm: float | None = None
        self.compiler = built.compiler  # the unit forwards, compiled or not (compile/)
        self.profiling = EngineProfiling(self)  # the step clock; flops_profiler's step
        # close(), `with engine:`, or this hook (when the engine is collected, or from
        # atexit while alive): nothing of ours busy at interpreter exit (docs/lifecycle.md)
        self._finalizer = weakref.finalize(self, release, self.comm_stats, self.zero, False)

    # the step counters live in one StepCounters, which checkpoints save and restore
    global_steps = _counter("global_steps")
    micro_steps = _counter("micro_steps")
    skipped_steps = _counter("skipped_steps")

    # -- DeepSpeed-style accessors (the batch ones: data/window.py) ------------------------------
    def get_lr(self) -> list[float]:
        return [] if self.optimizer is None else [g["lr"] for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def zero_stage(self) -> int:
        return self.config.zero_optimization.stage

    # -- training --------------------------------------------------------------------------------
    def _open_window(self, args: tuple = (), kwargs: dict | None = None) -> None:
        """The first training micro-step of an optimizer step opens a new accounting window."""
        if self._window_open:
            return
        self._window_open = True
        self.comm_stats.step = self.global_steps  # named by a collective that fails
        self.comm_stats.reset()
        self.zero.memory.reset_peak()
        self.profiling.open_step(self.global_steps, args, kwargs or {})

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """Pipeline parallelism: one optimizer step over ``micro_batches`` micro-batches of
        ``(inputs, targets)`` from ``data_iter``; returns the mean loss on every pp rank.
        ``data_iter`` is needed on the first and last stage; every rank of a dp replica
        must see the same data."""
        pipe = self.pipeline
        if pipe is None:
            raise ValueError("train_batch() drives a pipeline (pipeline_parallel.size > 1); "
                             "without one use engine(x), engine.backward(loss), engine.step()")
        if data_iter is None and self.training_dataloader is not None:
            if self._data_iterator is None:  # initialize(training_data=...), restarting
                self._data_iterator = Repeating(self.training_dataloader)
            data_iter = self._data_iterator
        inputs = targets = None
        if pipe.has_first_stage or pipe.has_last_stage:
            if data_iter is None:
                raise ValueError("train_batch() needs data_iter on the first and last stage")
            items = [next(data_iter) for _ in range(pipe.micro_batches)]
            inputs = torch.cat([x for x, _ in items]).to(self.device)
            targets = torch.cat([y for _, y in items]).to(self.device)
        self._open_window()
        self.comm_stats.phase = "backward"  # forward and backward interleave in a schedule
        pipe.loss_scale = self.loss_scaler.scale
        hooks = [] if self.profiling.profiler is None else stage_phase_hooks(
            pipe, self.profiling.set_phase)
        try:
            with self.zero.gradients_held():  # grads accumulate over the micro-batches
                loss = pipe.step(inputs, targets, broadcast_loss=True)
        finally:
            for h in hooks:
                h.remove()
        count_p2p(pipe, self.topology, self.comm_stats)
        self.zero.reduce_held_gradients()
        self.micro_steps += self.grad_accum - 1
        assert loss is not None  # broadcast_loss=True: every stage returns the loss
        self._step_loss = float(loss)
        self.step()
        return loss

    def forward(self, *args, **kwargs):
        if self.pipeline is not None:
            raise ValueError("with pipeline_parallel.size > 1 train with engine.train_batch("
                             "data_iter); the model is split across ranks")
        if self.batch.pending:  # "auto" micro batch: this batch's leading dimension
            self.take_micro_batch(args, kwargs)
        if torch.is_grad_enabled():
            self._open_window(args, kwargs)
        if self.layer_drop is not None and self.module.training:
            kwargs = {**kwargs, **self.layer_drop.forward_kwargs()}
        self.comm_stats.phase = "forward"
        self.profiling.set_phase("forward")
        t0 = time.perf_counter()
        if self.compute_dtype != torch.float32:
            args, kwargs = cast_inputs(args, self.compute_dtype), cast_inputs(
                kwargs, self.compute_dtype)
        with self.zero.start_forward(), autocast(self.config.torch_autocast, self.device):
            sp = self.sequence_parallel  # Ulysses: runs this rank's sequence chunk
            out = sp.run(self.module, args, kwargs) if sp else self.module(*args, **kwargs)
        self._times["forward"] += time.perf_counter() - t0
        return out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale);
        ``retain_graph`` as in ``torch.Tensor.backward`` (a second backward on the graph)."""
        self.zero.require_states("backward")
        t0 = time.perf_counter()
        self.comm_stats.phase = "backward"
        self.profiling.set_phase("backward")
        step_scale = None
        if (self.overlap_offload_step and self.config.gradient_clipping == 0
                and not self.config.scales_loss):
            # nothing global to wait for: step per unit
            step_scale = self.zero.options.grad_predivide / self.dp_comm.size
        self.zero.start_backward(self.reduces_in_backward(), step_scale)
        # in fp32: a 16-bit loss times a 2**16 loss scale would overflow before backward starts
        (loss.float() * (self.loss_scaler.scale / self.grad_accum)).backward(
            self.guard.seed(loss),  # NaN for an inf/nan loss: its step is then skipped
            retain_graph=retain_graph)
        if self.monitor is not None:
            self._step_loss += loss.detach().float().item() / self.grad_accum
        self.profiling.end_backward()
        self.zero.finish_backward()
        self._times["backward"] += time.perf_counter() - t0
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> bool:
        """Optimizer step at the accumulation boundary (a counted no-op otherwise); returns
        whether it changed the weights (False: no boundary, or skipped: inf/nan gradients).
        ``lr_kwargs``: keyword arguments of the scheduler's ``step`` when it applies."""
        self.zero.require_states("step")
        self.check_step_allowed()  # not inside no_sync()
        self.guard.step_applied = False
        self.zero.refuse_lost_step()  # offload I/O lost gradients: until a new backward
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return False
        if self.layer_drop is not None:  # for the next forwards, skipped step or not
            self.layer_drop.update(self.global_steps)
        if self.zero.start_step():  # phase check, I/O failures: before any other collective
            self.micro_steps -= self.grad_accum - 1  # the whole window is run again
            self.zero.refuse_lost_step()
        if not self.zero.has_reduced_gradients():
            # all gradients are zero: AdamW would still apply weight decay and its momentum
            warn_once(logger, "engine.step() with no engine.backward() since the last step "
                      "is skipped (no optimizer step, no scheduler step, no count)")
            return False
        t0 = time.perf_counter()
        self.profiling.set_phase("step")
        clip = self.config.gradient_clipping
        state = self.zero.optim_state
        self.last_grad_norm = None
        if self.zero.finish_unit_steps():  # the tier stepped units in backward
            return self._after_unit_steps(t0, lr_kwargs)
        sq_norm, overflow = self.guard.grad_stats(state, clip=clip,
                                                  replicated_weight=self.norm_weights)
        if not overflow:
            inv = self._unscale()
            norm = None if sq_norm is None else math.sqrt(sq_norm) * inv
            self.last_grad_norm = norm
            coef = 1.0
            if clip > 0:
                assert norm is not None  # clipping always takes the norm
                coef = min(1.0, clip / (norm + 1e-6))
            self.zero.optimizer_step(inv * coef)
            state.sync_params()
        return self._finish_step(overflow, t0, lr_kwargs)

    def _unscale(self) -> float:
        """What turns the reduced gradients into the mean gradient: they were divided by
        grad_predivide before the sum, so the rest of 1 / dp, and the loss scale."""
        return self.zero.options.grad_predivide / (self.dp_comm.size * self.loss_scaler.scale)

    def _after_unit_steps(self, t0: float, lr_kwargs: dict[str, Any] | None) -> bool:
        """The tier stepped every unit during backward: the ranks agree on refusals, and
        the gradient norm comes from the norms each unit's finiteness was checked with
        (None where tensor or pipeline parallelism weights it per parameter)."""
        sq = None if self.norm_weights is not None else self.zero.unit_steps_sq_norm()
        overflow, sq = self.guard.check_unit_steps(*self.zero.unit_step_outcome(), sq,
                                                   step=self.global_steps)
        if not overflow:
            self.zero.optim_state.sync_params(copy=False)
            self.last_grad_norm = None if sq is None else math.sqrt(sq) * self._unscale()
        return self._finish_step(overflow, t0, lr_kwargs)

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` changed the weights (DeepSpeed's name)."""
        return self.guard.step_applied

    def _finish_step(self, overflow: bool, t0: float,
                     lr_kwargs: dict[str, Any] | None = None) -> bool:
        if overflow:
            self.guard.count_skip(self.counters, self.global_steps, self.loss_scaler.scale)
        if not overflow and self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.loss_scaler.update(overflow)
        self.zero.zero_grads()
        self.zero.after_step()
        self.global_steps += 1
        self.micro_steps += 1
        self._times["step"] += time.perf_counter() - t0
        self._close_window()
        return self.guard.finish(overflow, self.global_steps - 1)

    def _close_window(self) -> None:
        self._window_open, self.comm_stats.step = False, self.global_steps  # calls until next
        self._last_comm = self.comm_stats.by_op()
        self.zero.close_transfer_window()
        self._last_peak = self.zero.memory.peak
        self.profiling.close_step(self.global_steps - 1)
        self.compiler.close_step()
        if self.global_steps % self.config.steps_per_print == 0:
            logger.info("step %d lr %s loss_scale %g", self.global_steps, self.get_lr(),
                        self.loss_scaler.scale)
            if self.config.wall_clock_breakdown:
                logger.info("step %d time (s) forward %.4f backward %.4f step %.4f",
                            self.global_steps, *self._times.values())
            if self.topology.rank == 0:
                self._write_reports()
        self._times = dict.fromkeys(self._times, 0.0)
        self._step_loss = 0.0

    def _write_reports(self) -> None:
        """The monitors' events and the comms_logger lines of this step (rank 0)."""
        samples = self.global_steps * self.batch.global_batch
        events = []
        if self.config.comms_logger.enabled:
            rows = comm_rows(self.comm_stats.by_group(), self.config.comms_logger)
            for op, group, st in rows:
                logger.info("step %d comm %s group %s count %d bytes %d time %.6f s",
                            self.global_steps, op, group, st["count"], st["bytes"],
                            st["seconds"])
            events = comm_events(rows, samples)
        if self.monitor is not None:
            self.monitor.write(step_events(StepRecord(
                samples, self._step_loss, self.get_lr()[0], self.loss_scaler.scale,
                self.skipped_steps, self.profiling.clock.last_seconds(), self.last_grad_norm,
                self.memory_report(), self.comm_report())) + events)

    def gathered(self, params: Iterable[torch.Tensor], modifier_rank: int | None = None):
        """``with engine.gathered(params):`` the full values of ``params`` inside the block
        (stage 3 gathers them; stages 0-2 hold them full), like DeepSpeed's
        ``GatheredParameters``: a collective, enter it on every rank. With grad mode off the
        units gathered for it are released on exit.

        ``modifier_rank``: the data-parallel rank whose writes are kept: on exit its values
        reach every rank's shard, fp32 master (and so the optimizer) and compute parameters,
        at every stage (a custom init, rows copied by hand; shapes cannot change). None:
        read-only, a write inside the block is lost (docs/models.md)."""
        return self.zero.gathered(params, modifier_rank)

    def offload_states(self, include: Iterable[Any] | None = None, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move the states named in ``include`` (DeepSpeed's names; None: all) to host
        memory until :meth:`reload_states`; calls that read them are refused meanwhile
        (zero/offload/states.py, docs/zero-offload.md)."""
        self.zero.offload_states(include, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back to the device what :meth:`offload_states` moved."""
        self.zero.reload_states(non_blocking)

    # -- reports ---------------------------------------------------------------------------------
    @property
    def last_profile(self) -> ProfileReport | None:
        """The flops profiler's report (docs/profiling.md: when its headline is final)."""
        return self.profiling.report

    def memory_report(self) -> dict:
        """Bytes this rank holds at rest: ``{category: {"device", "host", "nvme"}}`` for
        params, master_params, grads and optimizer_states, plus ``gathered_params_peak`` (the
        most full-parameter bytes alive at once during the last step)."""
        report = self.zero.memory_report(self.optimizer)
        report["gathered_params_peak"] = self._last_peak
        return report

    def comm_report(self) -> dict:
        """``{op: {count, bytes, seconds, exposed_seconds}}`` of the last optimizer step."""
        return {op: dict(v) for op, v in self._last_comm.items()}

    def transfer_report(self) -> dict:
        """``{d2h, h2d, nvme_read, nvme_write: {bytes, seconds, exposed_seconds, count,
        pinned_count}}``: the offload copies of the last optimizer step (zero-offload.md)."""
        return self.zero.transfer_report()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{name: full fp32 CPU tensor}`` on every rank (a collective: call it on all)."""
        with self.zero.phases.entry("full_state_dict"), self.zero.materialized():
            return self.zero.full_state_dict()

    def close(self) -> None:
        """Wait for every collective still in flight, join the offload threads and remove
        this rank's NVMe files; the engine cannot train afterwards. Call it on every rank
        (it may wait on collectives), or use ``with engine:``. Optional: what it releases is
        released at exit too (docs/lifecycle.md). Idempotent."""
        self._finalizer.detach()
        self.profiling.close()  # a report still waiting for steady steps takes those there are
        release(self.comm_stats, self.zero, block=True)
        if self.monitor is not None:
            self.monitor.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # on an error a peer may never join a collective in flight: release, do not wait
        self._finalizer.detach()
        if exc_type is None:
            self.profiling.close()
        release(self.comm_stats, self.zero, block=exc_type is None)
        if self.monitor is not None:
            self.monitor.close()

    # -- checkpoints (the checkpoint package sees a TrainingState, not the engine) ------------
    def training_state(self) -> TrainingState:
        """The live objects a checkpoint saves and a load restores in place."""
        replica = self.replica_comm
        return TrainingState(
            module=self.module, zero=self.zero, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, loss_scaler=self.loss_scaler,
            topology=self.topology, counters=self.counters, stats=self.comm_stats,
            pipeline=self.pipeline, writes_state=replica is None or replica.rank == 0)


def initialize(
    args: Any = None,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | type | Callable | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Callable | None = None,
    config: Config | dict | str | os.PathLike | None = None,
    config_params: Config | dict | str | os.PathLike | None = None,
    *,
    loss_fn: Callable | None = None,
    example_inputs: Any = None,
    pipeline_layout: Any = None,
    collate_fn: Callable | None = None,
    engine_class: type[Engine] | None = None,
) -> tuple[Engine, torch.optim.Optimizer | None, Any, Any]:
    """Like ``deepspeed.initialize``: returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)``; the loader is None without ``training_data``.

    The config is a ds_config dict, a path to a JSON file, or a :class:`Config`; every key is
    validated before any work starts. Initialises the process group from torchrun's
    environment if needed (a world of one without torchrun). ``model`` may be a zero-argument
    callable: it is then built on the meta device and materialised unit by unit, as under
    :func:`meshzero.zero_init`.

    With ``pipeline_parallel.size > 1``: ``loss_fn(output, target)`` (run on the last stage),
    ``example_inputs`` (one micro-batch of the model's inputs) and optionally
    ``pipeline_layout`` (a :class:`meshzero.parallel.pipeline.PipelineLayout`, for models
    whose first stage is more than running modules in order) are required/used.

    ``training_data`` (a map-style torch Dataset, or a DataLoader: its dataset, collate_fn,
    shuffling and batch_size) gives back a loader of this rank's micro-batches: a
    DistributedSampler over the data-parallel ranks (``engine.data_loader``); with pipeline
    parallelism ``train_batch()`` without ``data_iter`` reads it, restarting at its end.
    ``collate_fn`` is the loader's. ``engine_class``: the :class:`Engine` subclass to build
    (default :class:`Engine`).
    """
    if model is None:
        raise ValueError("initialize() needs model=")
    if config is not None and config_params is not None:
        raise ValueError("pass config or config_params, not both")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("initialize() needs config= (a ds_config dict or JSON path)")
    cfg = load_config(config, model=model, tp_plan=lambda: _shipped_plan(model))
    cfg = micro_batch_from_data(cfg, training_data)  # "auto": a DataLoader's batch_size
    engine = (engine_class or Engine)(
        model, cfg, optimizer=optimizer, model_parameters=model_parameters,
        lr_scheduler=lr_scheduler, loss_fn=loss_fn, example_inputs=example_inputs,
        pipeline_layout=pipeline_layout)
    if training_data is not None:
        engine.training_dataloader = engine.data_loader(training_data, collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _shipped_plan(model: Any) -> str | None:
    """The shipped tp plan whose patterns all match `model` (AutoTP), None for a factory."""
    from meshzero.estimate.mesh_search import inferred_tp_plan

    return inferred_tp_plan(model) if isinstance(model, nn.Module) else None
