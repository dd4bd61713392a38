"""Block quantization for ZeRO++'s compressed collectives (qwZ weights, qgZ gradients).

A 1-D tensor of ``numel`` elements is cut into blocks of ``block`` elements (the last one
may be short). Each block gets one fp32 scale, ``absmax / qmax`` (qmax 127 for int8, 7 for
int4), and its elements become ``round(x / scale)``, symmetric, in ``[-qmax, qmax]``::

    error per element <= scale / 2 = absmax(block) / (2 * qmax)

and a value ``k * scale`` with integer ``|k| <= qmax`` comes back exactly (``scale`` a power
of two). A block holding inf or nan gets a nan scale: it comes back all nan, so a
non-finite gradient is never turned into a finite one (the overflow check still sees it).

The packed form of one tensor is one uint8 row (what goes on the wire)::

    [ scales: 4 * ceil(numel / block) bytes | codes: numel bytes (int8)
                                                     or ceil(numel / 2) bytes (int4) ]

int4 codes are stored as ``q + 8`` (1..15), two per byte, the even element in the low
nibble. DeepSpeed's CUDA kernels (deepspeed/ops/csrc/quantization, called by
``CUDAQuantizer`` in runtime/zero/partition_parameters.py and by ``all_to_all_quant_reduce``
in runtime/comm/coalesced_collectives.py) do the same arithmetic with their own group sizes;
this is plain torch, on any device.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}


def num_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def code_bytes(numel: int, bits: int) -> int:
    return numel if bits == 8 else -(-numel // 2)


def packed_bytes(numel: int, block: int, bits: int) -> int:
    """Bytes of the packed form of ``numel`` elements (scales and codes)."""
    return 4 * num_blocks(numel, block) + code_bytes(numel, bits)


def quantize(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """The packed uint8 row of the 1-D tensor ``x`` (see the module docstring)."""
    if bits not in QMAX:
        raise ValueError(f"bits = {bits}; valid: 8 or 4")
    qmax = QMAX[bits]
    numel, nb = x.numel(), num_blocks(x.numel(), block)
    xf = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    xf[:numel] = x.reshape(-1)
    blocks = xf.view(nb, block)
    absmax = blocks.abs().amax(1)
    finite = torch.isfinite(absmax)
    scale = torch.where(finite, absmax / qmax, torch.full_like(absmax, float("nan")))
    safe = torch.where(finite & (absmax > 0), scale, torch.ones_like(scale))
    q = torch.nan_to_num(blocks / safe[:, None], nan=0.0, posinf=0.0, neginf=0.0)
    q = q.round_().clamp_(-qmax, qmax).view(-1)[:numel]
    if bits == 8:
        codes = q.to(torch.int8).view(torch.uint8)
    else:
        nibbles = (q + 8).to(torch.uint8)
        if numel % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
        pairs = nibbles.view(-1, 2)
        codes = pairs[:, 0] | (pairs[:, 1] << 4)
    return torch.cat([scale.view(torch.uint8), codes])


def dequantize_rows(packed: torch.Tensor, numel: int, block: int, bits: int,
                    out: torch.Tensor) -> None:
    """``out`` (R, numel), any float dtype <- the R packed rows ``packed`` (R, L) uint8."""
    rows, nb = packed.shape[0], num_blocks(numel, block)
    scales = packed[:, :4 * nb].reshape(-1).clone().view(torch.float32).view(rows, nb)
    codes = packed[:, 4 * nb:]
    if bits == 8:
        q = codes.contiguous().view(torch.int8).float()
    else:
        both = torch.stack([codes & 0xF, codes >> 4], dim=-1).view(rows, -1)[:, :numel]
        q = both.float() - 8
    full = torch.zeros(rows, nb * block, dtype=torch.float32, device=packed.device)
    full[:, :numel] = q
    values = full.view(rows, nb, block) * scales[:, :, None]
    out.copy_(values.view(rows, nb * block)[:, :numel])


def dequantize(packed: torch.Tensor, numel: int, block: int, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 1-D tensor of ``numel`` elements that the packed row ``packed`` holds."""
    out = torch.empty(1, numel, dtype=dtype, device=packed.device)
    dequantize_rows(packed.view(1, -1), numel, block, bits, out)
    return out.view(-1)


def round_trip(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """``x`` quantized and back, in ``x``'s dtype and shape (what the receiver sees)."""
    flat = x.reshape(-1)
    return dequantize(quantize(flat, block, bits), flat.numel(), block, bits,
                      x.dtype).view_as(x)
