"""DeepSpeed's ``deepspeed.comm`` collectives: each torch.distributed's, counted in every live
engine's ``comm_report()`` (``meshzero.comm.user``). ``prof``, ``log_name`` and ``debug`` are
DeepSpeed's comms-logger keywords: meshzero counts every op whatever they say."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from meshzero.comm.bare import all_gather_single, reduce_scatter_single
from meshzero.deepspeed.comm.comm import _SUM, _counted, _nbytes

Group = Any  # a torch.distributed.ProcessGroup, or None for the world


def all_reduce(tensor: torch.Tensor, op: Any = _SUM, group: Group = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_reduce",
               debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.all_reduce`: torch.distributed.all_reduce, counted."""
    return _counted("all_reduce", _nbytes(tensor), group, async_op,
                    lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def inference_all_reduce(tensor: torch.Tensor, op: Any = _SUM, group: Group = None,
                         async_op: bool = False, prof: bool = False,
                         log_name: str = "all_reduce", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.inference_all_reduce`: all_reduce, blocking."""
    return all_reduce(tensor, op=op, group=group)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = _SUM, group: Group = None,
                         async_op: bool = False, prof: bool = False,
                         log_name: str = "all_reduce", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.all_reduce_coalesced`: an all_reduce of each tensor."""
    works = [all_reduce(t, op=op, group=group, async_op=async_op) for t in tensors]
    return works[-1] if async_op and works else None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group = None,
               async_op: bool = False, prof: bool = False, log_name: str = "all_gather",
               debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.all_gather`: torch.distributed.all_gather, counted."""
    return _counted("all_gather", sum(_nbytes(t) for t in tensor_list), group, async_op,
                    lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op))


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor,
                           group: Group = None, async_op: bool = False, prof: bool = False,
                           log_name: str = "all_gather_into_tensor",
                           debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.all_gather_into_tensor`: torch's, counted as all_gather."""
    return _counted("all_gather", _nbytes(output_tensor), group, async_op,
                    lambda: all_gather_single(output_tensor, tensor, group=group,
                                              async_op=async_op))


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group = None,
                 async_op: bool = False, debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.allgather_fn`: all_gather_into_tensor."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def all_gather_object(object_list: list[Any], obj: Any, group: Group = None,
                      prof: bool = False, log_name: str = "all_gather_object",
                      debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.all_gather_object`: torch's (objects: not counted in bytes)."""
    return dist.all_gather_object(object_list, obj, group=group)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = _SUM,
                          group: Group = None, async_op: bool = False, prof: bool = False,
                          log_name: str = "reduce_scatter_tensor", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.reduce_scatter_tensor`: torch's, counted as reduce_scatter."""
    return _counted("reduce_scatter", _nbytes(tensor), group, async_op,
                    lambda: reduce_scatter_single(output_tensor, tensor, op=op, group=group,
                                                  async_op=async_op))


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = _SUM,
                      group: Group = None, async_op: bool = False, prof: bool = False,
                      debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.reduce_scatter_fn`: reduce_scatter_tensor."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = _SUM,
                   group: Group = None, async_op: bool = False, prof: bool = False,
                   log_name: str = "reduce_scatter", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.reduce_scatter`: torch.distributed.reduce_scatter."""
    return _counted("reduce_scatter", sum(_nbytes(t) for t in input_list), group, async_op,
                    lambda: dist.reduce_scatter(output, input_list, op=op, group=group,
                                                async_op=async_op))


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False,
              prof: bool = False, log_name: str = "broadcast", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.broadcast`: torch.distributed.broadcast (src a global rank)."""
    return _counted("broadcast", _nbytes(tensor), group, async_op,
                    lambda: dist.broadcast(tensor, src, group=group, async_op=async_op))


def broadcast_object_list(object_list: list[Any], src: int, group: Group = None,
                          device: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.broadcast_object_list`: torch's (objects: not counted)."""
    return dist.broadcast_object_list(object_list, src, group=group, device=device)


def reduce(tensor: torch.Tensor, dst: int, op: Any = _SUM, group: Group = None,
           async_op: bool = False, prof: bool = False, log_name: str = "reduce",
           debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.reduce`: torch.distributed.reduce, counted as reduce."""
    return _counted("reduce", _nbytes(tensor), group, async_op,
                    lambda: dist.reduce(tensor, dst, op=op, group=group, async_op=async_op))


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0,
           group: Group = None, async_op: bool = False, prof: bool = False,
           log_name: str = "gather", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.gather`: torch.distributed.gather, counted as gather."""
    sent = 0 if dist.get_rank() == dst else _nbytes(tensor)
    return _counted("gather", sent, group, async_op,
                    lambda: dist.gather(tensor, gather_list, dst=dst, group=group,
                                        async_op=async_op))


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0,
            group: Group = None, async_op: bool = False, prof: bool = False,
            log_name: str = "scatter", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.scatter`: torch.distributed.scatter, counted as scatter."""
    sent = sum(_nbytes(t) for t in scatter_list or []) - _nbytes(tensor) \
        if dist.get_rank() == src else 0
    return _counted("scatter", sent, group, async_op,
                    lambda: dist.scatter(tensor, scatter_list, src=src, group=group,
                                         async_op=async_op))


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor,
                      output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Group = None,
                      async_op: bool = False, prof: bool = False,
                      log_name: str = "all_to_all_single", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.all_to_all_single`: torch's, counted as all_to_all."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    row = _nbytes(tensor) // max(tensor.shape[0], 1) if tensor.dim() else _nbytes(tensor)
    own = input_split_sizes[me] * row if input_split_sizes else _nbytes(tensor) // n
    return _counted("all_to_all", _nbytes(tensor) - own, group, async_op,
                    lambda: dist.all_to_all_single(output, tensor, output_split_sizes,
                                                   input_split_sizes, group=group,
                                                   async_op=async_op))


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: Group = None, async_op: bool = False) -> Any:
    """DeepSpeed's `deepspeed.comm.all_to_all`: torch.distributed.all_to_all."""
    me = dist.get_rank(group)
    sent = sum(_nbytes(t) for i, t in enumerate(input_tensor_list) if i != me)
    return _counted("all_to_all", sent, group, async_op,
                    lambda: dist.all_to_all(output_tensor_list, input_tensor_list, group=group,
                                            async_op=async_op))


def send(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0, prof: bool = False,
         log_name: str = "send", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.send`: torch.distributed.send, counted as send_recv."""
    return _counted("send_recv", _nbytes(tensor), group, False,
                    lambda: dist.send(tensor, dst, group=group, tag=tag))


def recv(tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0,
         prof: bool = False, log_name: str = "recv", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.recv`: torch.distributed.recv, counted (0 bytes sent)."""
    return _counted("send_recv", 0, group, False,
                    lambda: dist.recv(tensor, src, group=group, tag=tag))


def isend(tensor: torch.Tensor, dst: int, group: Group = None, tag: int = 0,
          prof: bool = False, log_name: str = "isend", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.isend`: torch.distributed.isend (a Work to wait on)."""
    return _counted("send_recv", _nbytes(tensor), group, True,
                    lambda: dist.isend(tensor, dst, group=group, tag=tag))


def irecv(tensor: torch.Tensor, src: int | None = None, group: Group = None, tag: int = 0,
          prof: bool = False, log_name: str = "irecv", debug: Any = None) -> Any:
    """DeepSpeed's `deepspeed.comm.irecv`: torch.distributed.irecv (a Work to wait on)."""
    return _counted("send_recv", 0, group, True,
                    lambda: dist.irecv(tensor, src, group=group, tag=tag))
