"""The collectives of tensor parallelism as autograd functions (Megatron's "regions").

Inside a tensor-parallel (tp) region each rank holds a slice of the hidden dimension; inside
a sequence-parallel region each rank holds a slice of the sequence (dimension -2 of a
``(..., T, C)`` activation, ``SEQUENCE_DIM``). Every function here is the identity when the
group is ``None`` or has one rank, and every pair is the other's adjoint:

=====================================  ======================  ======================
function                               forward                 backward
=====================================  ======================  ======================
copy_to_tensor_parallel_region         identity                all-reduce
reduce_from_tensor_parallel_region     all-reduce              identity
scatter_to_tensor_parallel_region      split last dim          all-gather last dim
gather_from_tensor_parallel_region     all-gather last dim     split last dim
scatter_to_sequence_parallel_region    split sequence          all-gather sequence
gather_from_sequence_parallel_region   all-gather sequence     reduce-scatter (or split)
reduce_scatter_to_sequence_parallel_   reduce-scatter seq.     all-gather sequence
region
=====================================  ======================  ======================

The collectives themselves are :mod:`meshzero.comm`'s: ``on_comm(op, nbytes)``, when given
(an engine passes ``CommStats.counter("tp")``), is called once per collective with the op
name and the bytes this rank sends under the ring algorithms (``comm.ring_bytes``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshzero.comm import OnComm, all_gather_into, all_reduce, reduce_scatter_into

SEQUENCE_DIM = -2  # activations are (..., T, C): (B, T, C), or (T, C) for position tables


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in a tp group; ``None`` is a group of one."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in a tp group; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def _check_divisible(x: torch.Tensor, dim: int, n: int, what: str) -> None:
    if x.shape[dim] % n:
        raise ValueError(
            f"{what}: size {x.shape[dim]} of dimension {dim} of a {tuple(x.shape)} tensor is "
            f"not divisible by the tensor-parallel size {n}"
        )


# --- plain collectives (no autograd), each returning a new tensor --------------------------


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None,
                   on_comm: OnComm | None = None) -> torch.Tensor:
    """Sum of ``x`` over the group, in a fresh tensor (``x`` is left alone)."""
    n = group_size(group)
    if n == 1:
        return x
    out = x.contiguous().clone()
    all_reduce(out, group, on_comm)
    return out


def gather_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None,
                     on_comm: OnComm | None = None) -> torch.Tensor:
    """Concatenation of every rank's ``x`` along ``dim`` (rank order)."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    flat = x.new_empty(n * x.numel())  # (N * numel,): the one layout every backend accepts
    all_gather_into(flat, x.reshape(-1), group, on_comm)
    return torch.cat(flat.view(n, *x.shape).unbind(0), dim=dim)


def split_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim`` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n, "split for tensor parallelism")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None,
                             on_comm: OnComm | None = None) -> torch.Tensor:
    """This rank's slice along ``dim`` of the sum of ``x`` over the group."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n, "reduce-scatter for sequence parallelism")
    chunks = x.chunk(n, dim=dim)
    stacked = torch.stack(chunks).reshape(-1)  # (N * chunk numel,): rank r's chunk r-th
    out = x.new_empty(chunks[0].numel())
    reduce_scatter_into(out, stacked, group, on_comm)
    return out.view(chunks[0].shape)


# --- autograd functions ---------------------------------------------------------------------


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, on_comm):
        ctx.group, ctx.on_comm = group, on_comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group, ctx.on_comm), None, None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, on_comm):
        return all_reduce_sum(x, group, on_comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterAlongDim(torch.autograd.Function):
    """Forward: this rank's slice along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x, dim, group, on_comm):
        ctx.dim, ctx.group, ctx.on_comm = dim, group, on_comm
        return split_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, ctx.dim, ctx.group, ctx.on_comm), None, None, None


class _GatherAlongDim(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: reduce-scatter when every rank holds a
    partial gradient of the gathered tensor, else this rank's slice of it."""

    @staticmethod
    def forward(ctx, x, dim, group, on_comm, grad_is_partial):
        ctx.dim, ctx.group, ctx.on_comm, ctx.partial = dim, group, on_comm, grad_is_partial
        return gather_along_dim(x, dim, group, on_comm)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:
            out = reduce_scatter_along_dim(grad, ctx.dim, ctx.group, ctx.on_comm)
        else:
            out = split_along_dim(grad, ctx.dim, ctx.group)
        return out, None, None, None, None


class _ReduceScatterAlongDim(torch.autograd.Function):
    """Forward: reduce-scatter along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(ctx, x, dim, group, on_comm):
        ctx.dim, ctx.group, ctx.on_comm = dim, group, on_comm
        return reduce_scatter_along_dim(x, dim, group, on_comm)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_dim(grad, ctx.dim, ctx.group, ctx.on_comm), None, None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                                   on_comm: OnComm | None = None) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (each rank's part of it is partial)."""
    return x if group_size(group) == 1 else _CopyToTensorParallelRegion.apply(x, group, on_comm)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                                       on_comm: OnComm | None = None) -> torch.Tensor:
    """All-reduce forward (sum of partial outputs); identity backward."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTensorParallelRegion.apply(x, group, on_comm)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                                      on_comm: OnComm | None = None) -> torch.Tensor:
    """(..., C) -> (..., C / N), this rank's slice; backward all-gathers the gradient."""
    return x if group_size(group) == 1 else _ScatterAlongDim.apply(x, -1, group, on_comm)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                                       on_comm: OnComm | None = None) -> torch.Tensor:
    """(..., C / N) -> (..., C); backward keeps this rank's slice of the gradient."""
    if group_size(group) == 1:
        return x
    return _GatherAlongDim.apply(x, -1, group, on_comm, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: dist.ProcessGroup | None,
                                        on_comm: OnComm | None = None) -> torch.Tensor:
    """(..., T, C) -> (..., T / N, C), this rank's slice of the sequence; backward all-gathers
    (the replicated producer then sees the whole gradient on every rank)."""
    if group_size(group) == 1:
        return x
    return _ScatterAlongDim.apply(x, SEQUENCE_DIM, group, on_comm)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: dist.ProcessGroup | None, on_comm: OnComm | None = None,
    *, tensor_parallel_output_grad: bool = True,
) -> torch.Tensor:
    """(..., T / N, C) -> (..., T, C). Backward: reduce-scatter when the consumer is a
    tensor-parallel layer (each rank's gradient is partial), else split
    (``tensor_parallel_output_grad=False``: the gradient is already whole on every rank)."""
    if group_size(group) == 1:
        return x
    return _GatherAlongDim.apply(x, SEQUENCE_DIM, group, on_comm, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor,
                                               group: dist.ProcessGroup | None,
                                               on_comm: OnComm | None = None) -> torch.Tensor:
    """(..., T, C) partial sums -> (..., T / N, C) of the total; backward all-gathers."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterAlongDim.apply(x, SEQUENCE_DIM, group, on_comm)
