"""DeepSpeed's ``deepspeed.comm``: its collectives, one line each over ``torch.distributed``.

Every collective that moves data is counted in each live engine's ``engine.comm_report()``
(``meshzero.comm.user``: phase ``user``, meshzero's op names, the bytes this rank sends).
``init_distributed`` is meshzero's own (``meshzero.topology.init_distributed``): env:// under
torchrun, a world of one process without it. DeepSpeed's ``prof``, ``log_name`` and
``debug`` keywords (its comms logger's) are accepted; meshzero counts every op anyway.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshzero.comm.user import count_user_collective
from meshzero.topology import init_distributed as _meshzero_init

logger = logging.getLogger(__name__)

ReduceOp = dist.ReduceOp
ProcessGroup = dist.ProcessGroup
_SUM = dist.ReduceOp.SUM


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _counted(op: str, nbytes: int, group: Any, async_op: bool, call: Callable[[], Any]) -> Any:
    """Run ``call`` (a torch.distributed collective) and count it in the live engines."""
    start = time.perf_counter()
    out = call()
    count_user_collective(op, nbytes, group, 0.0 if async_op else time.perf_counter() - start)
    return out


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """DeepSpeed's `deepspeed.init_distributed`: meshzero's (torchrun's env://, or a world of one).

    Already initialised (by the caller or an earlier call): nothing to do, as DeepSpeed.
    ``init_method``, ``rank`` or ``world_size`` given: torch's ``init_process_group`` with
    them (env:// by default), as DeepSpeed's TorchBackend. MPI discovery is not done: launch
    with torchrun (``auto_mpi_discovery`` only logs that); ``distributed_port`` becomes
    MASTER_PORT when torchrun did not set one; ``config`` (its comms logger) is the config's
    ``comms_logger``, which the engine honours (one INFO line says so).
    """
    if dist.is_initialized():
        logger.debug("init_distributed: the process group is already initialised")
        return
    if dist_init_required is False:
        raise ValueError("init_distributed(dist_init_required=False): no process group is "
                         "initialised; call torch.distributed.init_process_group first, or "
                         "pass dist_init_required=None")
    if auto_mpi_discovery and "RANK" not in os.environ and verbose:
        logger.info("init_distributed: no torchrun environment (RANK unset): meshzero does "
                    "not discover MPI; a world of one process (launch with torchrun for more)")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if config is not None:
        logger.info("init_distributed(config=...): the comms logger is the config's "
                    "comms_logger section, which the engine built from it honours")
    if init_method is not None or rank != -1 or world_size != -1:
        backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                world_size=world_size, timeout=timeout)
        return
    _meshzero_init(dist_backend, timeout)


def is_initialized() -> bool:
    """DeepSpeed's `deepspeed.comm.is_initialized`: torch.distributed.is_initialized."""
    return dist.is_initialized()


def is_available() -> bool:
    """DeepSpeed's `deepspeed.comm.is_available`: torch.distributed.is_available."""
    return dist.is_available()


def get_rank(group: Any = None) -> int:
    """DeepSpeed's `deepspeed.comm.get_rank`: torch.distributed.get_rank."""
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """DeepSpeed's `deepspeed.comm.get_world_size`: torch.distributed.get_world_size."""
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """DeepSpeed's `deepspeed.comm.get_local_rank`: $LOCAL_RANK (torchrun's), 0 without it."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """DeepSpeed's `deepspeed.comm.get_global_rank`: torch.distributed.get_global_rank."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """DeepSpeed's `deepspeed.comm.get_all_ranks_from_group`: the group's global ranks."""
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def get_world_group() -> Any:
    """DeepSpeed's `deepspeed.comm.get_world_group`: torch.distributed.group.WORLD."""
    return dist.group.WORLD


def get_backend(group: Any = None) -> str:
    """DeepSpeed's `deepspeed.comm.get_backend`: torch.distributed.get_backend."""
    return dist.get_backend(group)


def new_group(ranks: list[int]) -> Any:
    """DeepSpeed's `deepspeed.comm.new_group`: torch.distributed.new_group(ranks)."""
    return dist.new_group(ranks)


def destroy_process_group(group: Any = None) -> None:
    """DeepSpeed's `deepspeed.comm.destroy_process_group`: torch's (close engines first)."""
    dist.destroy_process_group(group)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None,
            prof: bool = False, log_name: str = "barrier", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.barrier`: torch.distributed.barrier (moves no data)."""
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group: Any = None, timeout: timedelta | None = None,
                      wait_all_ranks: bool = False, prof: bool = False,
                      log_name: str = "monitored_barrier", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.monitored_barrier`: torch's (gloo only, as torch's)."""
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def configure(deepspeed_config: Any = None, enabled: bool | None = None,
              prof_all: bool | None = None, prof_ops: list[str] | None = None,
              verbose: bool | None = None, debug: bool | None = None) -> None:
    """DeepSpeed's `deepspeed.comm.configure`: accepted; meshzero counts every collective always.

    DeepSpeed switches its process-wide comms logger here. meshzero has none to switch: every
    collective is counted in ``engine.comm_report()``, and the per-step log lines are the
    config's ``comms_logger`` section. Each argument given is named in one INFO line.
    """
    given = {k: v for k, v in dict(deepspeed_config=deepspeed_config, enabled=enabled,
                                   prof_all=prof_all, prof_ops=prof_ops, verbose=verbose,
                                   debug=debug).items() if v is not None}
    for key, value in given.items():
        logger.info("deepspeed.comm.configure(%s=%r): meshzero counts every collective in "
                    "engine.comm_report(); per-step lines come from the config's "
                    "comms_logger section", key, value)


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """DeepSpeed's `deepspeed.comm.log_summary`: live engines' collectives this step, logged.

    ``{"summary": {op: {count, bytes, seconds, exposed_seconds, ...}}, "metadata": {...}}``
    summed over the live engines (``CommStats.by_op`` of the window under way; an engine's
    finished step is ``engine.comm_report()``), logged at INFO, returned with
    ``return_dict``. ``show_straggler`` raises: meshzero does not compare ranks' times.
    """
    if show_straggler:
        raise ValueError("log_summary(show_straggler=True): meshzero does not measure "
                         "stragglers; engine.comm_report() has seconds and exposed_seconds "
                         "per op")
    from meshzero.comm.stats import live_stats  # noqa: PLC0415 (the summary only)

    summary: dict[str, dict] = {}
    for stats in live_stats():
        for op, row in stats.by_op().items():
            acc = summary.setdefault(op, {"count": 0, "bytes": 0, "seconds": 0.0,
                                          "exposed_seconds": 0.0})
            for key in acc:
                acc[key] += row[key]
    for op, row in summary.items():
        logger.info("comm %s count %d bytes %d time %.6f s", op, row["count"], row["bytes"],
                    row["seconds"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = {"summary": summary, "straggler_analysis": None,
           "metadata": {"world_size": world, "rank": rank,
                        "timestamp": time.strftime("%Y-%m-%d %H:%M:%S")}}
    return out if return_dict else None
