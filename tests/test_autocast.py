"""``torch_autocast`` (issue 25): fp32 parameters, master and gradients, the forward under
``torch.autocast(bf16)``; equal to plain-torch autocast training, and refused together with
fp16 training (with bf16: tests/test_autocast_bf16.py)."""

from __future__ import annotations

import pytest
import torch

from meshzero.config import load_config
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, train, zero_config
from tests.models import build_model, make_batches, mlp_loss, reference_train, split_for_rank

STEPS = 4
AUTOCAST = {"enabled": True, "dtype": "bfloat16"}


def _autocast_reference(world_size: int = 1) -> dict[str, torch.Tensor]:
    """One process, plain torch: the model's forward under torch.autocast, the loss in fp32
    outside it, AdamW on the fp32 parameters. The batch is run in the ``world_size`` pieces
    the ranks get (gradients summed in fp32, as the ranks reduce them): a bf16 matmul rounds
    its result once per piece, so a different split moves a gradient near zero by a bf16
    rounding, which Adam, normalizing it, can turn into an lr-sized step. On one thread, as
    every rank runs: a bf16 matmul's blocking, so its rounding, depends on the thread count
    (run on this process's two threads the reference was 1.2e-3 off a one-rank engine run,
    1e-7 on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_steps(world_size)
    finally:
        torch.set_num_threads(threads)


def _reference_steps(world_size: int) -> dict[str, torch.Tensor]:
    model = build_model("mlp", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS,
                            foreach=False, fused=False)
    for batch in make_batches("mlp", STEPS, 8):
        for rank in range(world_size):
            x, y = split_for_rank(batch, rank, world_size, 1, 0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            assert out.dtype == torch.bfloat16  # autocast is on in the reference
            (mlp_loss(out.float(), y) / world_size).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _train_stages(rank: int, world_size: int) -> dict:
    out = {}
    for stage in range(4):
        cfg = zero_config(stage, global_batch=8, torch_autocast=AUTOCAST)
        result = train(rank, world_size, "mlp", cfg, STEPS)
        out[stage] = (result.params, result.memory)
    return out


def _max_diff(got: dict, want: dict) -> float:
    return max(float((got[n] - w).abs().max()) for n, w in want.items())


# W = 2 by default; every world size with -m slow
@pytest.mark.parametrize("world_size", [
    pytest.param(1, marks=pytest.mark.slow),
    2,
    pytest.param(4, marks=pytest.mark.slow)])
def test_autocast_equals_plain_torch_autocast(tmp_path, world_size):
    ref = _autocast_reference(world_size)
    fp32 = reference_train(lambda: build_model("mlp", 0), make_batches("mlp", STEPS, 8),
                           eps=ADAM_EPS).params
    off_by = _max_diff(ref, fp32)
    assert off_by > 1e-4, "autocast changes nothing here: the test would mean nothing"
    results = run_distributed(_train_stages, world_size, tmp_path)
    for per_rank in results:
        for stage, (params, memory) in per_rank.items():
            assert all(t.dtype == torch.float32 for t in params.values())
            # the same splits on one thread: only fp32 sums in another order (6e-8 at W = 4;
            # 2e-3 was needed while the reference ran on two threads)
            for name, want in ref.items():
                torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, s=stage: f"stage {s} {n}: {m}")
            # far closer to autocast training than to fp32 training
            assert _max_diff(params, ref) < off_by / 4, (stage, _max_diff(params, ref), off_by)
            if stage >= 2:  # fp32 gradient shards: 4 bytes per owned element
                assert sum(memory["grads"].values()) > 0


def test_autocast_refused_with_fp16_naming_both_keys():
    """(With bf16 it runs: tests/test_autocast_bf16.py; a float16 autocast on fp32
    parameters: tests/test_autocast_fp16.py.)"""
    with pytest.raises(ValueError, match=r"torch_autocast\.enabled and fp16\.enabled"):
        load_config({"torch_autocast": AUTOCAST, "fp16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"torch_autocast\.dtype.*changes nothing"):
        load_config({"torch_autocast": {"enabled": True, "dtype": "float32"}})
    with pytest.raises(ValueError, match=r"lower_precision_safe_modules.*torch\.nn\.Lienar"):
        load_config({"torch_autocast": {"enabled": True,
                                        "lower_precision_safe_modules": ["torch.nn.Lienar"]}})
    cfg = load_config({"torch_autocast": {"enabled": True, "dtype": "bf16",
                                          "lower_precision_safe_modules": ["torch.nn.Linear"]}})
    assert cfg.torch_autocast.dtype == "bfloat16" and cfg.compute_dtype == torch.float32
