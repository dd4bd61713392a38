"""``gpu_check.py``'s ``quantized`` check: ZeRO++ qwZ + qgZ on the device (world size 1).

1. The block quantizer (meshzero/comm/quantize.py) gives the same bytes on the device as on
   the CPU, int8 and int4, and the same values back.
2. A ZeRO-3 engine with ``zero_quantized_weights`` and ``zero_quantized_gradients`` trains a
   small MLP (fp32, TF32 off) to the parameters of a plain-torch replay on the same device
   that computes with the int8-served weights and steps on the int4-served gradients
   (rtol 1e-4), and comm_report shows the quantized ops (at one rank they send 0 bytes:
   the byte counts across ranks are tested on gloo, tests/test_quantized_comm.py).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import meshzero
from meshzero.comm.quantize import quantize, round_trip
from meshzero.zero.quantized_grads import QGZ_BITS, QGZ_BLOCK
from meshzero.zero.sharded_params import QWZ_BLOCK
from meshzero.zero.units import padded_shard_numel

LR, EPS = 1e-2, 1e-4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 32))


def _served(tensors: list[torch.Tensor], block: int, bits: int) -> list[torch.Tensor]:
    """A unit's tensors as one padded flat group, quantized and back (one shard: W = 1)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    padded = torch.zeros(padded_shard_numel(flat.numel(), 1), device=flat.device)
    padded[:flat.numel()] = flat
    back = round_trip(padded, block, bits)
    out, offset = [], 0
    for t in tensors:
        out.append(back[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def _batches(device: torch.device, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 64, generator=gen).to(device),
             torch.randn(16, 32, generator=gen).to(device)) for _ in range(steps)]


def _replay(device: torch.device, steps: int) -> dict[str, torch.Tensor]:
    master = _model().to(device)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=0.01, eps=EPS)
    for x, y in _batches(device, steps):
        compute = copy.deepcopy(master)
        linears = [m for m in compute if isinstance(m, nn.Linear)]
        with torch.no_grad():
            for lin in linears:
                w, b = _served([lin.weight, lin.bias], QWZ_BLOCK, 8)
                lin.weight.copy_(w)
                lin.bias.copy_(b)
        nn.functional.mse_loss(compute(x), y).backward()
        for lin, own in zip(linears, (m for m in master if isinstance(m, nn.Linear)),
                            strict=True):
            own.weight.grad, own.bias.grad = _served([lin.weight.grad, lin.bias.grad],
                                                     QGZ_BLOCK, QGZ_BITS)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().cpu() for k, v in master.state_dict().items()}


def check_quantized(spec, device: torch.device, steps: int) -> tuple[bool, str]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10_001, generator=gen) * 3
    same = all(torch.equal(quantize(x.to(device), block, bits).cpu(), quantize(x, block, bits))
               for block, bits in ((QWZ_BLOCK, 8), (QGZ_BLOCK, QGZ_BITS)))
    config = {"train_micro_batch_size_per_gpu": 16,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01,
                                                        "eps": EPS}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "unit_classes": ["Linear"], "zero_quantized_weights": True,
                                    "zero_quantized_gradients": True}}
    engine, *_ = meshzero.initialize(model=_model(), config=config)
    for x_, y_ in _batches(device, steps):
        engine.backward(nn.functional.mse_loss(engine(x_), y_))
        engine.step()
    got, comm = engine.full_state_dict(), engine.comm_report()
    engine.close()
    want = _replay(device, steps)
    err = max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)
    ops = {k: comm.get(k, {}).get("count", 0)
           for k in ("quantized_all_gather", "quantized_all_to_all")}
    ok = same and err < 1e-4 and all(ops.values())
    return ok, (f"quantizer {device.type} == cpu: {same}; max rel diff to the replay "
                f"{err:.2e}; quantized ops {ops}")
