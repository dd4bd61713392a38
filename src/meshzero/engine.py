"""The Engine: forward, backward and step with gradient accumulation, mixed precision,
clipping and ZeRO, behind DeepSpeed's ``initialize(model, config) -> engine`` habits."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshzero import mesh_setup
from meshzero.comm import CommStats, Communicator
from meshzero.config import Config, load_config
from meshzero.log import setup_logging
from meshzero.optim import build_optimizer
from meshzero.precision import LossScaler
from meshzero.profiling.report import ProfileReport
from meshzero.profiling.step import StepProfiler, emit
from meshzero.schedulers import build_scheduler
from meshzero.topology import Topology, build_topology, init_distributed
from meshzero.zero.materialize import prepare_model
from meshzero.zero.offload import HOST, OffloadOptions
from meshzero.zero.state import ZeroModelState, ZeroOptions

logger = logging.getLogger(__name__)


def _cast_inputs(obj: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in (nested) args to the compute dtype, like FSDP's cast_forward_inputs."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple | list):
        return type(obj)(_cast_inputs(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_inputs(v, dtype) for k, v in obj.items()}
    return obj


def _broadcast_module(module: nn.Module, comm: Communicator, src: int) -> None:
    """Make every rank start from rank ``src``'s parameters and buffers (as DeepSpeed does)."""
    if comm.size == 1:
        return
    tensors = list(module.parameters()) + list(module.buffers())
    with torch.no_grad():
        for dtype in {t.dtype for t in tensors}:
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            dist.broadcast(flat, src=src, group=comm.group)
            offset = 0
            for t in same:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


class Engine(nn.Module):
    """Wraps the user's module; ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``."""

    def __init__(
        self,
        model: nn.Module,
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
        setup_logging()
        self.config = config
        init_distributed()
        self.topology: Topology = build_topology(
            config.tensor_parallel.size, config.pipeline_parallel.size,
            config.topology.ranks_per_node)
        if self.topology.world_size > 1 and self.topology.rank == 0:
            logger.info("%s", self.topology.rank_map())
        dp = self.topology.dp_size
        self.global_batch, self.micro_batch, self.grad_accum = config.resolve_batch(dp)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.comm_stats = CommStats()
        zc = config.zero_optimization
        self.dp_comm = Communicator(self.topology.dp_group, "dp", self.comm_stats,
                                    async_ops=zc.overlap_comm,
                                    inter_node=self.topology.spans_nodes(self.topology.dp_group))
        # the ranks ZeRO shards over: all of dp, or (MiCS) a block of them, replicated across
        self.comm, self.replica_comm = self._shard_comms(zc.mics_shard_size)
        self.device = self.topology.device
        self.compute_dtype = config.compute_dtype
        # a factory or a meta-device model is materialised unit by unit by ZeroModelState
        model, materializer = prepare_model(model, config, comm=self.dp_comm,
                                            device=self.device, src=self._dp_src())
        self.pipeline = None
        if materializer is None:
            model.to(self.device)
            if self.topology.tp_size == 1 and self.topology.pp_size == 1:
                _broadcast_module(model, self.dp_comm, src=self._dp_src())
            else:  # tp/pp slice the model: all ranks must start from the same one
                mesh_setup.broadcast_from_world_rank0(model, self.topology)
                self._check_pipeline_batches()
                model, self.pipeline = mesh_setup.cut_model(
                    model, config, self.topology, self.device, loss_fn=loss_fn,
                    example_inputs=example_inputs, pipeline_layout=pipeline_layout,
                    micro_batches=self.grad_accum, stats=self.comm_stats)
        elif self.topology.tp_size > 1 or self.topology.pp_size > 1:
            raise ValueError("zero_init / a model factory with tensor_parallel or "
                             "pipeline_parallel is not supported yet; build the model eagerly")
        self.module = model
        self._mp_comms = mesh_setup.model_parallel_comms(self.topology, self.comm_stats)
        self._norm_weights = mesh_setup.norm_weights(model, self.topology, self.pipeline)
        self.zero = ZeroModelState(model, self.comm, self.device, ZeroOptions(
            stage=zc.stage,
            compute_dtype=self.compute_dtype,
            comm_dtype=config.communication_dtype or torch.float32,
            unit_classes=zc.unit_classes,
            persistence_threshold=zc.stage3_param_persistence_threshold,
            reduce_bucket_numel=zc.reduce_bucket_size,
            allgather_bucket_numel=zc.allgather_bucket_size,
            prefetch_numel=zc.stage3_prefetch_bucket_size,
            max_live_numel=zc.stage3_max_live_parameters,
            max_reuse_distance=zc.stage3_max_reuse_distance,
            offload=OffloadOptions.from_config(zc),
        ), materialize=materializer, secondary_comm=self._hpz_comm(zc.zero_hpz_partition_size),
            replica_comm=self.replica_comm)
        self._cast_buffers()
        offloaded = self.zero.offload.optimizer != "none"
        if materializer is not None:  # meta parameters the caller passed -> the real ones
            optimizer, model_parameters = materializer.remap(optimizer, model_parameters)
        self.optimizer = build_optimizer(
            model=model, fragments=self.zero.optim_state.fragments,
            device=HOST if offloaded else self.device,
            optimizer=optimizer, model_parameters=model_parameters, config=config.optimizer)
        self.zero.attach_optimizer(self.optimizer)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.loss_scaler = LossScaler.from_config(config.fp16)
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None  # before clipping; set when clipping is on
        # host-tier offload: step each unit during backward when nothing global is needed
        # first (False: always in step(); the benchmark's serial baseline)
        self.overlap_offload_step = True
        self._window_open = False
        self._last_comm: dict = {}
        self._last_peak = self.zero.memory.peak
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._profiler: StepProfiler | None = None
        self.last_profile: ProfileReport | None = None  # the report of the profiled step

    def _check_pipeline_batches(self) -> None:
        pp = self.config.pipeline_parallel
        if pp.size > 1 and pp.micro_batches is not None and pp.micro_batches != self.grad_accum:
            raise ValueError(
                f"pipeline_parallel.micro_batches ({pp.micro_batches}) != the gradient "
                f"accumulation steps ({self.grad_accum}, from train_batch_size "
                f"{self.global_batch} / micro batch {self.micro_batch} / dp "
                f"{self.topology.dp_size}): the micro-batches of one pipeline step are its "
                "accumulation steps")

    def _shard_comms(self, mics: int) -> tuple[Communicator, Communicator | None]:
        """MiCS / hybrid sharding: shard over blocks of ``mics`` dp ranks, all-reduce the
        gradient shards across the blocks."""
        if mics in (-1, 0, 1) or mics == self.dp_comm.size:
            return self.dp_comm, None
        block, across = self.topology.dp_subgroups(mics)
        make = lambda g, name: Communicator(  # noqa: E731
            g, name, self.comm_stats, async_ops=self.dp_comm.async_ops,
            inter_node=self.topology.spans_nodes(g))
        return make(block, "dp_shard"), make(across, "dp_replica")

    def _hpz_comm(self, k: int) -> Communicator | None:
        """ZeRO++ hpZ: the communicator over this rank's block of k data-parallel ranks."""
        if k <= 1:
            return None
        block, _ = self.topology.dp_subgroups(k)
        return Communicator(block, "dp_hpz", self.comm_stats, async_ops=self.comm.async_ops,
                            inter_node=self.topology.spans_nodes(block))

    def _dp_src(self) -> int:
        group = self.topology.dp_group
        return 0 if group is None else dist.get_global_rank(group, 0)

    def _cast_buffers(self) -> None:
        if self.compute_dtype == torch.float32:
            return
        for module in self.module.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf.is_floating_point():
                    setattr(module, name, buf.to(self.compute_dtype))

    def _build_scheduler(self, lr_scheduler: Callable | None):
        if lr_scheduler is not None and self.config.scheduler is not None:
            raise ValueError("both lr_scheduler and the config key 'scheduler' are given; "
                             "pass one of them")
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ValueError("lr_scheduler must be a callable optimizer -> scheduler (e.g. "
                             "lambda opt: LambdaLR(opt, f)): meshzero builds the optimizer over "
                             "shard fragments, so a scheduler bound to another optimizer "
                             "cannot drive it")
        if lr_scheduler is not None:
            return lr_scheduler(self.optimizer)
        if self.config.scheduler is not None:
            return build_scheduler(self.optimizer, self.config.scheduler)
        return None

    # -- DeepSpeed-style accessors ---------------------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def train_batch_size(self) -> int:
        return self.global_batch

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.micro_batch

    def gradient_accumulation_steps(self) -> int:
        return self.grad_accum

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

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
        self.comm_stats.reset()
        self.zero.memory.reset_peak()
        fcfg = self.config.flops_profiler
        if fcfg.enabled and self.global_steps == fcfg.profile_step:
            self._profiler = StepProfiler(self, fcfg.profile_step)
            self._profiler.start(args, kwargs or {})

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Pipeline parallelism: one optimizer step over ``micro_batches`` micro-batches of
        ``(inputs, targets)`` from ``data_iter``; returns the mean loss on every rank."""
        return mesh_setup.train_batch(self, data_iter)

    def forward(self, *args, **kwargs):
        if self.pipeline is not None:
            raise ValueError("with pipeline_parallel.size > 1 train with engine.train_batch("
                             "data_iter); the model is split across ranks")
        if torch.is_grad_enabled():
            self._open_window(args, kwargs)
        self.comm_stats.phase = "forward"
        if self._profiler is not None:
            self._profiler.counter.set_phase("forward")
        t0 = time.perf_counter()
        if self.compute_dtype != torch.float32:
            args, kwargs = _cast_inputs(args, self.compute_dtype), _cast_inputs(
                kwargs, self.compute_dtype)
        self.zero.start_forward()
        out = self.module(*args, **kwargs)
        self._times["forward"] += time.perf_counter() - t0
        return out

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale)."""
        t0 = time.perf_counter()
        self.comm_stats.phase = "backward"
        if self._profiler is not None:
            self._profiler.counter.set_phase("backward")
        step_scale = None
        if (self.overlap_offload_step and self.zero.offload.optimizer == "cpu"
                and self.config.gradient_clipping == 0 and not self.config.fp16.enabled):
            step_scale = 1.0 / self.dp_comm.size  # nothing global to wait for: step per unit
        self.zero.start_backward(self.is_gradient_accumulation_boundary(), step_scale)
        # in fp32: a 16-bit loss times a 2**16 loss scale would overflow before backward starts
        (loss.float() * (self.loss_scaler.scale / self.grad_accum)).backward()
        if self._profiler is not None:
            self._profiler.counter.end_backward()
        self.zero.finish_backward()
        self._times["backward"] += time.perf_counter() - t0
        return loss

    def step(self) -> None:
        """Optimizer step at the accumulation boundary (a counted no-op otherwise)."""
        if not self.is_gradient_accumulation_boundary():
            self.micro_steps += 1
            return
        t0 = time.perf_counter()
        self.comm_stats.phase = "step"
        if self._profiler is not None:
            self._profiler.counter.set_phase("step")
        clip = self.config.gradient_clipping
        state = self.zero.optim_state
        if self.zero.finish_unit_steps():  # host tier: every unit was stepped in backward
            state.sync_params(copy=False)
            self._finish_step(overflow=False, t0=t0)
            return
        sq_norm, overflow = state.reduce_grad_stats(
            need_norm=clip > 0, need_overflow=self.config.fp16.enabled, nvme=self.zero.nvme,
            model_parallel=self._mp_comms, replicated_weight=self._norm_weights)
        if overflow:
            self.skipped_steps += 1
            logger.info("step %d: gradient overflow at loss scale %g, skipping the step",
                        self.global_steps, self.loss_scaler.scale)
        else:
            inv = 1.0 / (self.dp_comm.size * self.loss_scaler.scale)
            coef = 1.0
            if clip > 0:
                norm = math.sqrt(sq_norm) * inv
                self.last_grad_norm = norm
                coef = min(1.0, clip / (norm + 1e-6))
            self.zero.optimizer_step(inv * coef)
            state.sync_params()
        self._finish_step(overflow, t0)

    def _finish_step(self, overflow: bool, t0: float) -> None:
        if not overflow and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.loss_scaler.update(overflow)
        self.zero.zero_grads()
        self.global_steps += 1
        self.micro_steps += 1
        self._times["step"] += time.perf_counter() - t0
        self._close_window()

    def _close_window(self) -> None:
        self._window_open = False
        self._last_comm = self.comm_stats.by_op()
        self._last_peak = self.zero.memory.peak
        if self._profiler is not None:
            self.last_profile = self._profiler.finish(dict(self._times))
            self._profiler = None
            emit(self.last_profile, self.config.flops_profiler.output_file)
        if self.global_steps % self.config.steps_per_print == 0:
            logger.info("step %d lr %s loss_scale %g", self.global_steps, self.get_lr(),
                        self.loss_scaler.scale)
            if self.config.wall_clock_breakdown:
                logger.info("step %d time (s) forward %.4f backward %.4f step %.4f",
                            self.global_steps, *self._times.values())
        self._times = dict.fromkeys(self._times, 0.0)

    # -- reports ---------------------------------------------------------------------------------
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

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``{name: full fp32 CPU tensor}`` on every rank (a collective: call it on all)."""
        with self.zero.materialized():
            return self.zero.full_state_dict()

    def close(self) -> None:
        """Stop offload threads and remove this rank's NVMe files (also done at exit)."""
        self.zero.close()

    # -- checkpoints (see checkpoint.py) --
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: Any = None) -> str:
        """Sharded checkpoint ``save_dir/tag`` (default ``global_step{N}``); collective.
        ``client_state`` must be JSON-serialisable. Returns the tag's directory."""
        from meshzero import checkpoint

        with self.zero.materialized():
            return checkpoint.save_checkpoint(self, save_dir, tag, client_state)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True) -> tuple[str | None, Any]:
        """Load a tag (default: ``latest``) saved at any data-parallel size and stage, with
        the same tensor and pipeline parallel sizes; collective. Returns ``(path,
        client_state)``, or ``(None, None)`` if there is no ``latest``."""
        from meshzero import checkpoint

        with self.zero.materialized(write_back=True):
            return checkpoint.load_checkpoint(self, load_dir, tag, load_optimizer_states,
                                              load_lr_scheduler_states)

    def save_16bit_model(self, save_dir: str | os.PathLike,
                         save_filename: str = "model.safetensors") -> str | None:
        """The full model in the compute dtype as safetensors; collective (one file per
        pipeline stage, with an index, when pp > 1)."""
        from meshzero import checkpoint

        with self.zero.materialized():
            return checkpoint.save_16bit_model(self, save_dir, save_filename)

    def load_weights(self, path: str | os.PathLike) -> None:
        """Load safetensors weights (file, index or directory), each rank reading only its
        fragments; collective. Pickle files are refused."""
        from meshzero import checkpoint

        with self.zero.materialized(write_back=True):
            checkpoint.load_weights(self, path)


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
) -> tuple[Engine, torch.optim.Optimizer, None, Any]:
    """Like ``deepspeed.initialize``: returns ``(engine, optimizer, None, lr_scheduler)``.

    The config is a ds_config dict, a path to a JSON file, or a :class:`Config`; every key is
    validated before any work starts. Initialises the process group from torchrun's
    environment if needed (a world of one without torchrun). ``model`` may be a zero-argument
    callable: it is then built on the meta device and materialised unit by unit, as under
    :func:`meshzero.zero_init`.

    With ``pipeline_parallel.size > 1``: ``loss_fn(output, target)`` (run on the last stage),
    ``example_inputs`` (one micro-batch of the model's inputs) and optionally
    ``pipeline_layout`` (a :class:`meshzero.parallel.pipeline.PipelineLayout`, for models
    whose first stage is more than running modules in order) are required/used.
    """
    if model is None:
        raise ValueError("initialize() needs model=")
    if training_data is not None:
        raise ValueError("training_data is not supported: build a DataLoader with a "
                         "DistributedSampler over the data-parallel ranks yourself")
    if config is not None and config_params is not None:
        raise ValueError("pass config or config_params, not both")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("initialize() needs config= (a ds_config dict or JSON path)")
    cfg = load_config(config)
    engine = Engine(model, cfg, optimizer=optimizer, model_parameters=model_parameters,
                    lr_scheduler=lr_scheduler, loss_fn=loss_fn, example_inputs=example_inputs,
                    pipeline_layout=pipeline_layout)
    return engine, engine.optimizer, None, engine.lr_scheduler
