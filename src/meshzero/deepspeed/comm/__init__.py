"""DeepSpeed's ``deepspeed.comm`` (``import meshzero.deepspeed.comm as dist``): each name one
line over ``torch.distributed``; the collectives that move data are counted in every live
engine's ``engine.comm_report()`` (``meshzero.comm.user``)."""

from meshzero.deepspeed.comm.collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    allgather_fn,
    broadcast,
    broadcast_object_list,
    gather,
    inference_all_reduce,
    irecv,
    isend,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_fn,
    reduce_scatter_tensor,
    scatter,
    send,
)
from meshzero.deepspeed.comm.comm import (
    ProcessGroup,
    ReduceOp,
    barrier,
    configure,
    destroy_process_group,
    get_all_ranks_from_group,
    get_backend,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    init_distributed,
    is_available,
    is_initialized,
    log_summary,
    monitored_barrier,
    new_group,
)

__all__ = [
    "ProcessGroup", "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "allgather_fn",
    "barrier", "broadcast", "broadcast_object_list", "configure", "destroy_process_group",
    "gather", "get_all_ranks_from_group", "get_backend", "get_global_rank", "get_local_rank",
    "get_rank", "get_world_group", "get_world_size", "inference_all_reduce", "init_distributed",
    "irecv", "is_available", "is_initialized", "isend", "log_summary", "monitored_barrier",
    "new_group", "recv", "reduce", "reduce_scatter", "reduce_scatter_fn",
    "reduce_scatter_tensor", "scatter", "send",
]
