"""The squared norm and the non-finite count of gradient tensors, in one fast read each.

The step needs two figures of the local gradients: whether any element is inf/nan (the
non-finite guard and fp16 overflow) and, with clipping, the squared L2 norm. Computed the
plain way, ``(~torch.isfinite(g)).sum()`` and ``g.double().pow(2).sum()`` each write
full-size temporaries: on one CPU core about 65 ms each per 8.4 M fp32 elements, against
1.2 ms for one fp32 ``torch.linalg.vector_norm`` (a single vectorised read, no temporary)
and 38 ms for one in fp64.

So each tensor gets one ``vector_norm``: in fp64 when the norm is wanted (fp64 holds the
squares of any finite fp32/bf16/fp16 values at any element count, so the result keeps the
old precision and offload tiers, which sum other pieces, still agree bit for bit), else in
fp32. Its result is finite exactly when every element is finite (in fp32: and the squares
stay within range); only a tensor whose norm is not finite is read again, for its exact
count of inf/nan elements. Both figures therefore equal the exact ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def scan_grads(tensors: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
               device: torch.device | None = None, need_norm: bool = True) -> torch.Tensor:
    """``[sum of weight * squared L2 norm, number of inf/nan elements]`` over ``tensors``,
    a float64 tensor of two on ``device`` (the tensors' own device by default); the first
    is 0 unless ``need_norm``.

    ``weights``: one factor per tensor for its squared norm (a slice replicated over
    tensor-parallel ranks counts 1/tp); 1 by default. One host read of the norms decides
    which tensors need the exact second read (none, when all are finite).
    """
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")
    out = torch.zeros(2, dtype=torch.float64, device=device)
    if not tensors:
        return out
    acc = torch.float64 if need_norm else torch.float32
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=acc).to(device, torch.float64)
                         for t in tensors])
    finite = torch.isfinite(norms)
    if need_norm:
        w = torch.tensor(list(weights) if weights is not None else [1.0] * len(tensors),
                         dtype=torch.float64, device=device)
        out[0] = (norms.square() * w).sum()  # inf/nan when some element is
    if bool(finite.all()):
        return out
    for i in (~finite).nonzero().flatten().tolist():
        out[1] += (~torch.isfinite(tensors[i])).sum().to(device, torch.float64)
    return out
