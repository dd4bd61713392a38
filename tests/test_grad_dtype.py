"""data_types.grad_accum_dtype (issue 15): gradients held, accumulated and reduced in 16 bits.

- memory: memory_report() equals the formula with 2-byte (or 4-byte) gradients, to the byte,
  padding included: the ZeRO paper's (2 + 2 + 12) psi / N at stage 3, 2 psi + 14 psi / N at
  stage 2 and 4 psi + 12 psi / N at stage 1 with bf16 compute;
- numerics: bf16 gradients train within bf16 tolerance of plain torch, and differ from fp32
  gradients (the setting is used); the step converts them in chunks without changing the
  update (bit for bit against one chunk);
- offload: bf16 gradients in host buffers and in a 2-byte NVMe gradient file train like the
  device tier.
"""

from __future__ import annotations

import copy
import gc
import glob
import os

import pytest
import torch

import meshzero
from meshzero.config import load_config
from meshzero.zero.state import CATEGORIES
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, train, zero_config
from tests.models import build_model, make_batches, reference_train
from tests.test_accounting import _owned, _shard, _units, expected_memory

BF16 = {"enabled": True}


def _grads(dtype: str | None) -> dict:
    return {} if dtype is None else {"data_types": {"grad_accum_dtype": dtype}}


def _train_all(rank: int, world: int, runs: list[dict], steps: int) -> list:
    """One engine after another (one spawn for every config)."""
    return [train(rank, world, "mlp", cfg, steps) for cfg in runs]


# (stage, grad_accum_dtype, gradient bytes): None is the default, the compute dtype (bf16)
MEMORY_CASES = [(stage, dtype, 4 if dtype == "fp32" else 2)
                for stage in (1, 2, 3) for dtype in (None, "bf16", "fp32")]


def _check_memory(world_size: int, results: list) -> None:
    psi = sum(sum(u) for u in _units("mlp"))
    padded = sum(_shard(sum(u), world_size) * world_size for u in _units("mlp"))
    for i, (stage, dtype, gbytes) in enumerate(MEMORY_CASES):
        total = 0
        for rank, per_rank in enumerate(results):
            got = {k: v["device"] for k, v in per_rank[i].memory.items() if k in CATEGORIES}
            want = expected_memory("mlp", stage, world_size, rank, param_bytes=2,
                                   grad_bytes=gbytes)
            assert got == want, (stage, dtype, rank)
            total += sum(got.values())
        frags = sum(_owned(u, world_size, r, sharded=True)[1]
                    for r in range(world_size) for u in _units("mlp"))
        # summed over ranks, the paper's bytes (K = 12) plus padding and Adam's step counters:
        # a padding element carries params and grads (whole or sharded as they are) and an
        # fp32 master, but no Adam m, v
        n = world_size
        paper = {1: (2 + gbytes) * psi * n + 12 * psi, 2: 2 * psi * n + (gbytes + 12) * psi,
                 3: (2 + gbytes + 12) * psi}[stage]
        pad = padded - psi
        extra = {1: (2 + gbytes) * pad * n + 4 * pad, 2: 2 * pad * n + (gbytes + 4) * pad,
                 3: (2 + gbytes + 4) * pad}[stage]
        assert total == paper + extra + 4 * frags, (stage, dtype)


@pytest.mark.parametrize("world_size", [1, 2])
def test_memory_equals_the_paper_formula(tmp_path, world_size):
    runs = [zero_config(stage, global_batch=4 * world_size, bf16=BF16, **_grads(dtype))
            for stage, dtype, _ in MEMORY_CASES]
    _check_memory(world_size, run_distributed(_train_all, world_size, tmp_path, runs, 1))


@pytest.mark.slow
def test_memory_equals_the_paper_formula_at_world_size_4(tmp_path):
    runs = [zero_config(stage, global_batch=16, bf16=BF16, **_grads(dtype))
            for stage, dtype, _ in MEMORY_CASES]
    _check_memory(4, run_distributed(_train_all, 4, tmp_path, runs, 1))


def test_default_is_the_compute_dtype_and_deepspeed_spellings_load():
    assert load_config({}).grad_dtype == torch.float32
    assert load_config({"bf16": BF16}).grad_dtype == torch.bfloat16
    assert load_config({"fp16": BF16}).grad_dtype == torch.float16
    cfg = load_config({"bf16": BF16, "data_types": {"grad_accum_dtype": "float32"}})
    assert cfg.grad_dtype == torch.float32 and cfg.reduce_dtype == torch.float32
    cfg = load_config({"bf16": BF16, "data_types": {"grad_accum_dtype": "bfloat16"},
                       "communication_data_type": "fp32"})
    assert cfg.grad_dtype == torch.bfloat16 and cfg.reduce_dtype == torch.float32
    with pytest.raises(ValueError, match="fp16.enabled"):
        load_config({"bf16": BF16, "data_types": {"grad_accum_dtype": "fp16"}})


STEPS = 4
CLIP = 0.05


def _equivalence(world_size: int, tmp_path, stage: int) -> None:
    gb = 8
    # clipping active: the norm is read from the bf16 gradients, the clip coefficient is
    # applied as they are converted to fp32
    runs = [zero_config(stage, global_batch=gb, grad_accum=2, bf16=BF16, gradient_clipping=CLIP,
                        **_grads(dtype)) for dtype in ("bf16", "fp32")]
    results = run_distributed(_train_all, world_size, tmp_path, runs, STEPS)
    ref = reference_train(lambda: build_model("mlp", 0), make_batches("mlp", STEPS, gb),
                          grad_accum=2, clip=CLIP, dtype=torch.bfloat16, eps=ADAM_EPS)
    assert min(ref.grad_norms) > CLIP, "the clip must be active for the test to mean anything"
    for per_rank in results:
        bf16, fp32 = per_rank
        differs = False
        for name, want in ref.params.items():
            torch.testing.assert_close(bf16.params[name], want, rtol=2e-2, atol=2e-3)
            differs |= not torch.equal(bf16.params[name], fp32.params[name])
        assert differs, "bf16 gradients must change the arithmetic"
        # every rank ends with the same parameters
        for name, t in bf16.params.items():
            assert torch.equal(t, results[0][0].params[name]), name


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_gradients_within_bf16_tolerance_of_plain_torch(tmp_path, stage):
    _equivalence(2, tmp_path, stage)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_gradients_within_bf16_tolerance_all_sizes(tmp_path, stage, world_size):
    _equivalence(world_size, tmp_path, stage)


def _offload(rank: int, world: int, path: str) -> dict:
    """The device tier, then the host and NVMe tiers, all with bf16 gradients; small chunks
    (sub_group_size 128) against one chunk; the NVMe gradient file's size."""
    def cfg(stage: int, **zero) -> dict:
        out = zero_config(stage, global_batch=8, bf16=BF16)
        out["zero_optimization"].update(zero)
        return out

    nvme = {"device": "nvme", "nvme_path": path}
    runs = {
        "device": cfg(2), "chunked": cfg(2, sub_group_size=128),
        "cpu": cfg(2, offload_optimizer={"device": "cpu"}),
        "device3": cfg(3), "nvme": cfg(3, offload_optimizer=nvme, sub_group_size=300),
    }
    out: dict = {name: train(rank, world, "mlp", copy.deepcopy(c), 3)
                 for name, c in runs.items()}
    gc.collect()  # the engines above were never closed: their files go when they are collected
    engine, *_ = meshzero.initialize(model=build_model("mlp"), config=runs["nvme"])
    files = glob.glob(os.path.join(path, f"meshzero-rank{rank:05d}-*", "grad"))
    out["grad_file_bytes"] = [os.path.getsize(f) for f in files]
    engine.close()
    return out


def test_bf16_gradients_under_cpu_and_nvme_offload(tmp_path):
    results = run_distributed(_offload, 2, tmp_path, str(tmp_path))
    owned = sum(_shard(sum(u), 2) for u in _units("mlp"))  # elements each rank steps
    for r in results:
        assert r["grad_file_bytes"] == [2 * owned]  # the NVMe gradient file holds bf16
        base, base3 = r["device"], r["device3"]
        for name, t in base.params.items():
            # cut into leaves of 128 and converted 128 at a time: the same update, bit for bit
            assert torch.equal(r["chunked"].params[name], t), name
            assert torch.equal(r["cpu"].params[name], t), name
            torch.testing.assert_close(r["nvme"].params[name], base3.params[name],
                                       rtol=1.6e-2, atol=1e-5)
        assert r["cpu"].memory["grads"]["host"] == base.memory["grads"]["device"]
        assert r["nvme"].memory["grads"]["nvme"] == base3.memory["grads"]["device"]
        assert base3.memory["grads"]["device"] == 2 * owned  # the bf16 gradient shard
