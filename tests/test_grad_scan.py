"""scan_grads: one norm read per tensor gives the squared norm (fp64) and the exact inf/nan
count, also where the fast fp32 read overflows or meets inf/nan (the exact second read)."""

from __future__ import annotations

import math

import pytest
import torch

from meshzero.zero.grad_scan import scan_grads


def exact(tensors, weights=None):
    weights = weights or [1.0] * len(tensors)
    sq = sum(float(t.double().pow(2).sum()) * w for t, w in zip(tensors, weights, strict=True))
    bad = sum(int((~torch.isfinite(t)).sum()) for t in tensors)
    return sq, bad


def check(tensors, weights=None):
    want_sq, want_bad = exact(tensors, weights)
    sq, bad = scan_grads(tensors, weights).tolist()
    assert bad == want_bad
    if math.isfinite(want_sq):
        assert sq == pytest.approx(want_sq, rel=1e-12)
    else:
        assert not math.isfinite(sq)
    sq, bad = scan_grads(tensors, weights, need_norm=False).tolist()
    assert (sq, bad) == (0.0, want_bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_tensors(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g).to(dtype) for n in (1, 1000, 70_001)]
    check(tensors)
    check(tensors, [0.5, 1.0, 0.25])
    check([torch.zeros(0, dtype=dtype), torch.ones(3, dtype=dtype)])


@pytest.mark.parametrize("bad_value", [math.inf, -math.inf, math.nan])
def test_non_finite_elements_are_counted(bad_value):
    a, b, c = torch.randn(100), torch.randn(5000), torch.randn(7)
    b[17] = bad_value
    b[4000] = bad_value
    c[0] = math.inf
    c[1] = -math.inf  # inf + -inf: the fast norm is still not finite
    check([a, b, c])
    sq, bad = scan_grads([a, b, c]).tolist()
    assert bad == 4


def test_fp32_overflow_of_the_fast_norm_is_not_a_non_finite_gradient():
    # squares past fp32's range: the fp32 norm is inf, the elements are finite
    big = torch.full((1000,), 2.0**100)
    bf = torch.full((4,), 3e38).bfloat16()
    for tensors in ([big, torch.randn(10)], [bf]):
        check(tensors)
        assert scan_grads(tensors, need_norm=False)[1].item() == 0
    sq, _ = scan_grads([big]).tolist()
    assert sq == pytest.approx(1000 * 2.0**200, rel=1e-12)


def test_empty_list_and_device():
    out = scan_grads([])
    assert out.tolist() == [0.0, 0.0] and out.dtype == torch.float64
