"""How a model becomes a trainable engine: the one place that orders the parallelisms.

:func:`build` prepares a model in this order, each step needing the ones before it:

1. process groups and communicators (with ``faults.comm_timeout``; every rank's config and
   model checked to agree first, so a mismatch is an error and never a hang; the (pp, dp,
   sp, tp) mesh; ZeRO's shard, MiCS and hpZ communicators over dp x sp; Ulysses' sp group)
2. materialise (a factory or meta-device model, unit by unit, later by ZeRO) or broadcast
   (an eager model: every rank starts from one rank's parameters)
3. pipeline cut (this rank keeps its stage(s))
4. tensor-parallel replacement (the planned layers of what is left become tp slices)
5. ZeRO state (shards the parameters that remain on this rank over its dp ranks)
6. optimizer (over ZeRO's fp32 master fragments), scheduler, loss scaler
7. compile (``compile.enabled``; later ``engine.compile()``): each leaf ZeRO unit's own forward,
   after ZeRO, whose hooks stay eager around it (meshzero/compile/)

The engine (``engine.py``) then only runs steps on what this returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshzero.comm import CommStats, Communicator, broadcast_module
from meshzero.compile import UnitCompiler
from meshzero.config import Config
from meshzero.faults import check_ranks_agree
from meshzero.optim import (
    bind_caller_optimizer,
    bind_data_parallel,
    bind_to_shards,
    build_optimizer,
    check_forward_only,
)
from meshzero.parallel.compose import (
    apply_tp,
    check_plan,
    cut_pipeline,
    model_parallel_comms,
    norm_weights,
)
from meshzero.parallel.pipeline import Pipeline
from meshzero.parallel.plans import shipped_plan
from meshzero.parallel.sequence import SequenceParallel, check_heads
from meshzero.parallel.sequence_hf import use_ulysses
from meshzero.precision import LossScaler
from meshzero.schedulers import build_scheduler, check_scheduler_object, is_scheduler_object
from meshzero.topology import Topology, build_topology, init_distributed
from meshzero.zero.materialize import prepare_model
from meshzero.zero.offload import OffloadOptions
from meshzero.zero.quantized_grads import HierarchicalReduceScatter
from meshzero.zero.state import ZeroModelState, ZeroOptions
from meshzero.zero.trainability import listed_parameters, param_group_of
from meshzero.zero.units import check_no_lazy_parameters

logger = logging.getLogger(__name__)


@dataclass
class Comms:
    """The data-parallel communicators; all count into ``stats``."""

    stats: CommStats
    dp: Communicator  # all data-parallel ranks (gradient averaging, the broadcast)
    shard: Communicator  # the ranks ZeRO shards over: dp, or a MiCS block of it
    replica: Communicator | None  # MiCS: the same shard across blocks, else None
    hpz: Communicator | None  # ZeRO++ hpZ: a block holding a secondary param shard
    qgz: HierarchicalReduceScatter | None = None  # ZeRO++ qgZ: node hop, then across nodes


@dataclass
class Built:
    """What :func:`build` prepared; the engine keeps these."""

    topology: Topology
    comms: Comms
    # (train_batch_size, micro batch per rank, accumulation); the first two None while an
    # "auto" micro batch waits for the first batch (Config.micro_batch_pending)
    batch: tuple[int | None, int | None, int]
    module: nn.Module
    pipeline: Pipeline | None
    zero: ZeroModelState
    optimizer: torch.optim.Optimizer | None  # None: no optimizer, a forward-only engine
    lr_scheduler: Any
    loss_scaler: LossScaler
    model_parallel_comms: list[Communicator]  # over tp and pp, for norms and overflow
    norm_weights: dict[int, float] | None  # id(param) -> weight in the global grad norm
    compiler: UnitCompiler  # compiles the unit forwards (now or on engine.compile())
    sequence: SequenceParallel | None = None  # Ulysses, when sequence_parallel_size > 1


def build(model: nn.Module | Callable[[], nn.Module], config: Config, *,
          optimizer: Any = None, model_parameters: Iterable[Any] | None = None,
          lr_scheduler: Any = None, loss_fn: Callable | None = None,
          example_inputs: Any = None, pipeline_layout: Any = None) -> Built:
    """Prepare ``model`` for training under ``config``, in the order of the module
    docstring; collective over the world."""
    if isinstance(model, nn.Module):
        check_no_lazy_parameters(model)  # before any collective: a local error
    forward_only = optimizer is None and config.optimizer is None
    if forward_only:  # before any collective: a local error
        check_forward_only(config, lr_scheduler, model_parameters)
    # 1. groups first: every later step runs collectives on them
    timeout = timedelta(seconds=config.faults.comm_timeout)
    made = init_distributed(timeout=timeout)
    check_ranks_agree(config, model)  # before any group or broadcast depends on them
    topology = build_topology(config.tensor_parallel.size, config.pipeline_parallel.size,
                              config.topology.ranks_per_node, timeout, world_timeout=made,
                              sp_size=config.sequence_parallel_size)
    if topology.world_size > 1 and topology.rank == 0:
        logger.info("%s", topology.rank_map())
    if topology.sp_size > 1 and isinstance(model, nn.Module):  # before any work (a factory's
        check_heads(model, topology.sp_size)  # model: once it is built, in _sequence)
    batch = config.batch_sizes(topology.dp_size)  # the batch rule needs the dp size
    if config.seed is not None:  # before materialising: initialisation draws from it
        torch.manual_seed(config.seed)
    comms = _communicators(topology, config)
    # 2. materialise or broadcast, before the cuts: every rank cuts the same full model
    model, materializer = prepare_model(model, config, comm=comms.dp, device=topology.device,
                                        src=_dp_src(topology))
    pipe = None
    if materializer is not None and topology.tp_size * topology.pp_size > 1:
        raise ValueError("zero_init / a model factory with tensor_parallel or "
                         "pipeline_parallel is not supported yet; build the model eagerly")
    if materializer is None:
        model.to(topology.device)
        _broadcast(model, topology, comms.dp)
        # 3-4. pipeline cut, then tp on what this rank kept (tp plans name stage modules)
        model, pipe = _cut(model, config, topology, batch, comms.stats, loss_fn=loss_fn,
                           example_inputs=example_inputs, pipeline_layout=pipeline_layout)
    sequence = _sequence(model, config, topology, comms.stats)
    # 5. ZeRO after the cuts: it shards only the parameters left on this rank
    zero = _zero_state(model, config, topology, comms, materializer, forward_only)
    _cast_buffers(model, config.compute_dtype)
    if materializer is not None:  # meta parameters the caller passed -> the real ones
        optimizer, model_parameters = materializer.remap(optimizer, model_parameters)
    # 6. the optimizer steps on ZeRO's master fragments, so it comes after ZeRO
    opt, scheduler = None, None
    if not zero.options.forward_only:
        opt, scheduler = _optimizer(model, config, zero, optimizer, model_parameters,
                                    lr_scheduler, comms)
    # 7. compile the units' forwards: their gather / release hooks (ZeRO's) stay eager around
    compiler = _compiler(model, config, topology, zero)
    return Built(topology=topology, comms=comms, batch=batch, module=model, pipeline=pipe,
                 zero=zero, optimizer=opt, lr_scheduler=scheduler,
                 loss_scaler=LossScaler.from_config(config.fp16, config.torch_autocast),
                 model_parallel_comms=model_parallel_comms(topology, comms.stats),
                 norm_weights=norm_weights(model, topology, pipe), sequence=sequence,
                 compiler=compiler)


def _compiler(model: nn.Module, config: Config, topology: Topology,
              zero: ZeroModelState) -> UnitCompiler:
    """The units' compiler (meshzero/compile/); with ``compile.enabled`` it compiles now."""
    compiler = UnitCompiler(model, [u.path for u in zero.layout.units], sharder=zero.sharder,
                            tp_size=topology.tp_size, sp_size=topology.sp_size)
    if config.compile.enabled:
        compiler.compile(config.compile.backend, config.compile.kwargs)
    return compiler


def _communicators(topology: Topology, config: Config) -> Comms:
    """dp, and the MiCS / hpZ blocks of it: shard over blocks of ``mics_shard_size`` dp
    ranks and all-reduce the gradient shards across the blocks."""
    zc = config.zero_optimization
    stats = CommStats()

    def make(group, name: str) -> Communicator:
        return Communicator(group, name, stats, async_ops=zc.overlap_comm,
                            inter_node=topology.spans_nodes(group))

    dp = make(topology.zero_group, "dp")  # dp x sp: sp ranks are data-parallel to ZeRO
    shard, replica = dp, None
    mics = zc.mics_shard_size
    if mics not in (-1, 0, 1) and mics != dp.size:
        block, across = topology.dp_subgroups(mics)
        shard, replica = make(block, "dp_shard"), make(across, "dp_replica")
    hpz = None
    if zc.zero_hpz_partition_size > 1:
        hpz = make(topology.dp_subgroups(zc.zero_hpz_partition_size)[0], "dp_hpz")
    qgz = None
    if zc.zero_quantized_gradients:  # the node's ranks, and this place in every node
        node, cross = topology.dp_subgroups(min(topology.ranks_per_node, dp.size))
        qgz = HierarchicalReduceScatter(make(node, "dp_node"), make(cross, "dp_cross"))
    return Comms(stats=stats, dp=dp, shard=shard, replica=replica, hpz=hpz, qgz=qgz)


def _sequence(model: nn.Module, config: Config, topology: Topology,
              stats: CommStats) -> SequenceParallel | None:
    """Ulysses over the sp group; a transformers model switched to its attention function."""
    if topology.sp_size == 1:
        return None
    check_heads(model, topology.sp_size)  # again for a factory's model
    group = topology.sp_group
    sequence = SequenceParallel(
        group, topology.sp_size, topology.sp_rank, config.sequence_comm_dtype,
        on_comm=stats.counter("sp", inter_node=topology.spans_nodes(group)))
    if use_ulysses(model):
        sequence.routes_sdpa = False
    else:  # an attention shape sp cannot split: an error naming the module
        sequence.name_modules(model)
    return sequence


def _dp_src(topology: Topology) -> int:
    """The global rank of the first rank of this rank's ZeRO group (dp x sp)."""
    group = topology.zero_group
    return 0 if group is None else dist.get_global_rank(group, 0)


def _broadcast(model: nn.Module, topology: Topology, dp: Communicator) -> None:
    """Every rank starts from one rank's model: its dp group's first rank, or with tp/pp
    (which slice the model) world rank 0, so every piece is cut from the same one."""
    if topology.tp_size == 1 and topology.pp_size == 1:
        broadcast_module(model, dp, src=_dp_src(topology))
    elif topology.world_size > 1:
        world = Communicator(dist.group.WORLD, "init", dp.stats)
        broadcast_module(model, world, src=0)


def _cut(model: nn.Module, config: Config, topology: Topology,
         batch: tuple[int | None, int | None, int],
         stats: CommStats, **pipeline_args: Any) -> tuple[nn.Module, Pipeline | None]:
    """``(module this rank trains, Pipeline or None)`` after the pipeline and tp cuts."""
    pp, tp = config.pipeline_parallel, config.tensor_parallel
    # the config requires a plan when tp.size > 1
    plan = shipped_plan(tp.plan) if tp.size > 1 and tp.plan is not None else None
    pipe = None
    if pp.size > 1:
        _check_pipeline_batches(config, topology, batch)
        if plan is not None:  # on the whole model: a cut stage would miss other modules
            check_plan(model, plan)
        pipe = cut_pipeline(model, pp, topology=topology, device=topology.device,
                            micro_batches=batch[2], sequence_parallel=tp.sequence_parallel,
                            stats=stats, **pipeline_args)
        model = pipe.module
    if plan is not None:
        model = apply_tp(model, plan, topology=topology, sequence_parallel=tp.sequence_parallel,
                         stats=stats, pipe=pipe)
    return model, pipe


def _check_pipeline_batches(config: Config, topology: Topology,
                            batch: tuple[int | None, int | None, int]) -> None:
    pp = config.pipeline_parallel
    global_batch, micro, accum = batch
    if pp.micro_batches is not None and pp.micro_batches != accum:
        raise ValueError(
            f"pipeline_parallel.micro_batches ({pp.micro_batches}) != the gradient "
            f"accumulation steps ({accum}, from train_batch_size {global_batch} / micro "
            f"batch {micro} / dp {topology.dp_size}): the micro-batches of one pipeline step "
            "are its accumulation steps")


def _optimizer(model: nn.Module, config: Config, zero: ZeroModelState, optimizer: Any,
               model_parameters: Iterable[Any] | None, lr_scheduler: Any, comms: Comms,
               ) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer over ZeRO's master fragments, attached to ``zero``, and the scheduler.
    A caller's optimizer instance is bound to it (optim.bind_caller_optimizer): the
    hyperparameters its param groups hold are the ones training uses."""
    model_parameters = listed_parameters(model_parameters)
    opt = build_optimizer(
        model=model, fragments=zero.optim_state.fragments,
        device=zero.optimizer_device,
        optimizer=optimizer, model_parameters=model_parameters, config=config.optimizer,
        bf16=config.bf16)
    bind_to_shards(opt, zero.optim_state.fragment_norms)
    bind_data_parallel(opt, comms.dp, zero.keep_gradients_local,
                       flat_groups=config.fp16.enabled or config.bf16.enabled)
    zero.attach_optimizer(opt, param_group_of(model, optimizer, model_parameters))
    if isinstance(optimizer, torch.optim.Optimizer):
        bind_caller_optimizer(optimizer, opt)
    return opt, _scheduler(opt, config, lr_scheduler, optimizer)


def _zero_state(model: nn.Module, config: Config, topology: Topology, comms: Comms,
                materializer: Any, forward_only: bool = False) -> ZeroModelState:
    zc = config.zero_optimization
    offload = OffloadOptions.from_config(zc)
    if forward_only:  # no optimizer side to offload; parameters offload as configured
        offload = replace(offload, optimizer="none")
    options = ZeroOptions(
        stage=zc.stage,
        compute_dtype=config.compute_dtype,
        comm_dtype=config.reduce_dtype,
        grad_dtype=config.grad_dtype,
        master_dtype=config.master_dtype,
        unit_classes=zc.unit_classes,
        persistence_threshold=zc.stage3_param_persistence_threshold,
        reduce_bucket_numel=zc.reduce_bucket_size,
        allgather_bucket_numel=zc.allgather_bucket_size,
        prefetch_numel=zc.stage3_prefetch_bucket_size,
        max_live_numel=zc.stage3_max_live_parameters,
        max_reuse_distance=zc.stage3_max_reuse_distance,
        offload=offload,
        grad_predivide=config.grad_predivide(comms.dp.size),
        group_timeout=topology.timeout,
        forward_only=forward_only,
        quantize_weights=("all" if zc.zero_quantized_weights else
                          "frozen" if zc.zero_quantized_nontrainable_weights else "none"),
    )
    return ZeroModelState(model, comms.shard, topology.device, options,
                          materialize=materializer, secondary_comm=comms.hpz,
                          replica_comm=comms.replica, grad_reduce=comms.qgz)


def _cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating buffers in the compute dtype (ZeRO casts the parameters)."""
    if dtype == torch.float32:
        return
    for sub in module.modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(sub, name, buf.to(dtype))


def _scheduler(optimizer: torch.optim.Optimizer, config: Config, lr_scheduler: Any,
               client_optimizer: Any = None) -> Any:
    """The caller's scheduler object (built on the optimizer it passed, which is bound to
    ``optimizer``), ``lr_scheduler(optimizer)``, the config's ``scheduler``, or None."""
    if lr_scheduler is not None and config.scheduler is not None:
        raise ValueError("both lr_scheduler and the config key 'scheduler' are given; "
                         "pass one of them")
    if is_scheduler_object(lr_scheduler):
        check_scheduler_object(lr_scheduler, client_optimizer)
        return lr_scheduler
    if lr_scheduler is not None:
        return lr_scheduler(optimizer)
    if config.scheduler is not None:
        return build_scheduler(optimizer, config.scheduler)
    return None
