"""The error-compensated 1-bit all-reduce of the 1-bit optimizers (optimizers/onebit.py).

Every rank sends the signs of its vector, one bit each, and one fp32 scale, in two phases
(the 1-bit Adam paper, arXiv:2102.02888, section 4; DeepSpeed's ``NcclBackend.
compressed_allreduce`` in runtime/comm/nccl.py computes the same):

1. worker: ``m = x + worker_error``; ``scale = ||m|| / sqrt(P)``; ``worker_error = m -
   scale * sign(m)``. The P signs are cut into N chunks of C = P / N, packed 8 to a byte,
   and chunk r goes to rank r with the scale (an all-to-all of ``N (C/8 + 4)`` bytes).
2. server: rank r averages the N decompressed chunks r it received, adds its
   ``server_error``, and compresses the result the same way; every rank gathers every
   rank's packed chunk and scale (an all-gather), and decompresses the whole vector.

Bytes one rank sends: ``(N-1)/N * N (C/8 + 4)`` twice, i.e. ``2 (N-1) (P/(8N) + 4)``,
against ``2 (N-1)/N * 4P`` for the fp32 all-reduce: about 1/32. ``sign(0)`` counts as +1,
as in DeepSpeed. P must be a multiple of :func:`padded_numel`'s unit (N chunks of whole bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshzero.comm.communicator import Communicator

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``N * lcm(N, 8)``, as DeepSpeed's OnebitAdam
    pads (``corrected_tensor_size``): N chunks, each a whole number of bytes of signs. The
    padding takes part in the norms (DeepSpeed's scale divides by the padded size)."""
    unit = world_size * (world_size * 8 // math.gcd(world_size, 8))
    return -(-numel // unit) * unit


@dataclass
class ErrorFeedback:
    """A rank's compression errors for one vector of P elements: ``worker`` (P,) and
    ``server`` (P / N,), for the chunk this rank averages. fp32, zero at the start."""

    worker: torch.Tensor
    server: torch.Tensor

    @classmethod
    def zeros(cls, padded: int, world_size: int, device: torch.device) -> ErrorFeedback:
        return cls(torch.zeros(padded, device=device),
                   torch.zeros(padded // world_size, device=device))


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """``x`` (K*8,) -> (K,) uint8: bit 1 where x >= 0 (and NaN), first element the MSB."""
    bits = (~(x < 0)).view(-1, 8).to(torch.uint8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` (..., K) uint8 -> (..., K*8) fp32 of +-1."""
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], -1).float().mul_(2.0).sub_(1.0)


def _compress(m: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """(scale,) of ``m`` (fp32); ``error`` <- m - scale * sign(m)."""
    scale = torch.linalg.vector_norm(m) / math.sqrt(m.numel())
    error.copy_(m - scale * torch.where(m < 0, -1.0, 1.0))
    return scale.reshape(1)


def _with_scale(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(K,) uint8 packed signs followed by the 4 bytes of the fp32 scale."""
    return torch.cat([packed, scale.float().view(torch.uint8)])


def compressed_all_reduce(comm: Communicator, x: torch.Tensor, errors: ErrorFeedback) -> None:
    """``x`` (P,) fp32 <- the 1-bit estimate of the mean of every rank's ``x``, the same on
    every rank; ``errors`` updated. Blocking: two counted ops, ``compressed_all_to_all``
    and ``compressed_all_gather``."""
    n, total = comm.size, x.numel()
    chunk = total // n
    assert chunk * n == total and chunk % 8 == 0, "x must be padded: padded_numel"
    nbytes = chunk // 8
    m = x.add_(errors.worker)  # (P,)
    worker_scale = _compress(m, errors.worker)
    packed = pack_signs(m).view(n, nbytes)  # row r: the chunk rank r averages
    send = torch.cat([packed, worker_scale.view(torch.uint8).expand(n, 4)], dim=1)
    recv = torch.empty_like(send)  # (N, C/8 + 4): every rank's signs of my chunk, its scale
    comm.all_to_all(recv.view(-1), send.view(-1), op="compressed_all_to_all").wait()
    scales = recv[:, nbytes:].contiguous().view(torch.float32)  # (N, 1)
    server_m = unpack_signs(recv[:, :nbytes]).mul_(scales.mul(1.0 / n)).sum(0)  # (C,)
    server_m.add_(errors.server)
    server_scale = _compress(server_m, errors.server)
    mine = _with_scale(pack_signs(server_m), server_scale)  # (C/8 + 4,)
    gathered = torch.empty(n * mine.numel(), dtype=torch.uint8, device=x.device)
    comm.all_gather(gathered, mine, op="compressed_all_gather").wait()
    rows = gathered.view(n, -1)
    server_scales = rows[:, nbytes:].contiguous().view(torch.float32)  # (N, 1)
    x.copy_(unpack_signs(rows[:, :nbytes]).mul_(server_scales).view(-1))


def compressed_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in :func:`compressed_all_reduce` of a vector of ``numel``
    elements (before padding): what ``comm_report`` counts for it. A step of 1-bit Adam
    sends the sum over its compressed vectors: each parameter's momentum in fp32, each
    param group's under fp16/bf16 (optimizers/onebit.py)."""
    if world_size == 1:
        return 0
    row = padded_numel(numel, world_size) // world_size // 8 + 4
    return 2 * (world_size - 1) * row
