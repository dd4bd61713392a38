"""ZeRO++ qwZ (zero_quantized_weights, zero_quantized_nontrainable_weights) and qgZ
(zero_quantized_gradients): the block quantizer, training against a plain-torch replay that
applies the same quantization, and the bytes comm_report counts.

DeepSpeed's semantics followed (deepspeed 0.19.6): the stage-3 all-gather moves int8 codes
with one scale per block and dequantizes on arrival, the partitioned (master) values staying
exact (runtime/zero/partition_parameters.py: ``_all_gather_coalesced`` with ``quantize``,
``CUDAQuantizer.quantize`` / ``dequantize``, ``AllGatherCoalescedHandle.wait``); only
frozen parameters with zero_quantized_nontrainable_weights (``Init.__init__``'s
``quantized_nontrainable_weights``); gradients reduce-scattered as int4 by a two-hop
all-to-all, the second hop between nodes (runtime/comm/coalesced_collectives.py:
``all_to_all_quant_reduce``), here with the node's hop at full precision.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import meshzero
from meshzero.comm.quantize import QMAX, num_blocks, packed_bytes, quantize, round_trip
from meshzero.config import ConfigError, load_config
from meshzero.estimate import Estimator
from meshzero.estimate.model import load_model
from meshzero.estimate.settings import settings_from_config
from meshzero.estimate.timing import communication_split
from meshzero.zero.quantized_grads import QGZ_BITS, QGZ_BLOCK
from meshzero.zero.sharded_params import QWZ_BLOCK
from meshzero.zero.units import padded_shard_numel
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS
from tests.models import make_batches, split_for_rank

STEPS, LR, WD = 3, 1e-2, 0.01
CONTROL = ("order_check", "phase_check", "step_check")  # not parameter traffic


# -- the quantizer -----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_is_within_half_a_step_per_block(bits):
    gen = torch.Generator().manual_seed(bits)
    for numel, block in [(1, 256), (7, 4), (255, 256), (300, 256), (5000, 2048)]:
        x = torch.randn(numel, generator=gen) * torch.logspace(-3, 2, numel)
        y = round_trip(x, block, bits)
        padded = torch.zeros(num_blocks(numel, block) * block)
        padded[:numel] = x
        absmax = padded.view(-1, block).abs().amax(1).repeat_interleave(block)[:numel]
        bound = absmax / (2 * QMAX[bits]) + 1e-6 * x.abs()  # + fp32 rounding of x / scale
        assert ((y - x).abs() <= bound).all(), (numel, block)
        assert numel == 1 or not torch.equal(y, x)  # it did quantize (one element: exact)
        assert quantize(x, block, bits).numel() == packed_bytes(numel, block, bits)
        assert packed_bytes(numel, block, bits) == 4 * math.ceil(numel / block) + (
            numel if bits == 8 else math.ceil(numel / 2))


@pytest.mark.parametrize("bits", [8, 4])
def test_representable_values_come_back_exactly(bits):
    qmax = QMAX[bits]
    codes = torch.arange(-qmax, qmax + 1, dtype=torch.float32)
    for scale in (2.0 ** -7, 1.0, 2.0 ** 5):
        x = torch.cat([codes, codes.flip(0)]) * scale  # absmax = qmax * scale in every block
        assert torch.equal(round_trip(x, x.numel(), bits), x)
    zeros = torch.zeros(9)
    assert torch.equal(round_trip(zeros, 4, bits), zeros)
    bf16 = (codes * 0.25).to(torch.bfloat16)
    assert torch.equal(round_trip(bf16, bf16.numel(), bits), bf16)


def test_non_finite_blocks_stay_non_finite():
    x = torch.tensor([1.0, float("inf"), 3.0, 2.0, float("nan"), 0.5, 1.0, 1.0])
    y = round_trip(x, 2, 4)
    assert y[:2].isnan().all() and y[4:6].isnan().all()
    assert torch.isfinite(y[2:4]).all() and torch.isfinite(y[6:]).all()


# -- training against a plain-torch replay -----------------------------------------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 5))


def _config(world: int, stage: int, *, per_node: int | None = None, bf16: bool = False,
            **zero) -> dict:
    cfg = {"train_batch_size": 4 * world,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD,
                                                     "eps": ADAM_EPS}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "unit_classes": ["Linear"], **zero}}
    if per_node is not None:
        cfg["topology"] = {"ranks_per_node": per_node}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(rank: int, world: int, configs: list[dict], steps: int = STEPS) -> list[tuple]:
    """(full_state_dict, losses, comm_report) of every config, one engine after another."""
    out = []
    for config in configs:
        engine, *_ = meshzero.initialize(model=_model(), config=copy.deepcopy(config))
        losses = []
        gas = engine.gradient_accumulation_steps()
        for x, y in make_batches("mlp", steps, engine.train_batch_size()):
            for micro in range(gas):
                xr, yr = split_for_rank((x, y), rank, world, gas, micro)
                loss = nn.functional.mse_loss(engine(xr).float(), yr)
                engine.backward(loss)
                engine.step()
            losses.append(loss.item())
        out.append((engine.full_state_dict(), losses, engine.comm_report()))
        engine.close()
    return out


def _as_served(params: list[torch.Tensor], shards: int, block: int, bits: int
               ) -> list[torch.Tensor]:
    """What a unit's flat group looks like after a quantized gather: its parameters
    concatenated, padded to ``shards`` equal shards, each shard block-quantized."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    size = padded_shard_numel(flat.numel(), shards)
    padded = torch.zeros(shards * size, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    served = torch.cat([round_trip(padded[r * size:(r + 1) * size], block, bits)
                        for r in range(shards)])
    out, offset = [], 0
    for p in params:
        out.append(served[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return out


def _node_grad(grads: list[list[torch.Tensor]], world: int, per_node: int
               ) -> list[torch.Tensor]:
    """qgZ's gradient of one unit from each rank's (weight, bias) gradients: summed inside
    each node, every node's partial sum of every shard int4-quantized, the nodes' summed,
    averaged over the ranks."""
    flats = [torch.cat([g.reshape(-1) for g in gs]) for gs in grads]
    numel = flats[0].numel()
    size = padded_shard_numel(numel, world)
    nodes = []
    for m in range(world // per_node):
        part = torch.zeros(world * size)
        for r in range(m * per_node, (m + 1) * per_node):
            part[:numel] += flats[r]
        nodes.append(part)
    total = torch.cat([sum((round_trip(p[t * size:(t + 1) * size], QGZ_BLOCK, QGZ_BITS)
                            for p in nodes), torch.zeros(size)) for t in range(world)])
    mean = total[:numel] / world
    return [mean[:grads[0][0].numel()].view_as(grads[0][0]),
            mean[grads[0][0].numel():].view_as(grads[0][1])]


def _replay(world: int, *, weights: str = "none", grads: bool = False, per_node: int = 1,
            steps: int = STEPS, gas: int = 1, reduce_each_micro: bool = True
            ) -> dict[str, torch.Tensor]:
    """Plain torch on one process: the master steps with AdamW on the gradient of the
    global batch, computed on the weights as the engine's gathers serve them (``weights``:
    "all" or "none" int8-quantized per shard) and reduced as qgZ reduces them (``grads``):
    with ``gas`` micro-steps, each micro-step's gradients (``reduce_each_micro``: stages
    2 and 3) or their sum at the boundary (stage 1)."""
    master = _model()
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD, eps=ADAM_EPS)
    linears = [m for m in master if isinstance(m, nn.Linear)]
    for x, y in make_batches("mlp", steps, 4 * world * gas):
        compute = copy.deepcopy(master)
        if weights == "all":
            with torch.no_grad():
                for lin in (m for m in compute if isinstance(m, nn.Linear)):
                    w, b = _as_served([lin.weight, lin.bias], world, QWZ_BLOCK, 8)
                    lin.weight.copy_(w)
                    lin.bias.copy_(b)
        micros = [_rank_grads(compute, (x, y), world, gas, m) for m in range(gas)]
        if not reduce_each_micro:  # accumulated on each rank, reduced once
            micros = [[[[sum(g) for g in zip(*parts, strict=True)]
                        for parts in zip(*rank_parts, strict=True)]
                       for rank_parts in zip(*micros, strict=True)]]
        for i, lin in enumerate(linears):
            total = [torch.zeros_like(lin.weight), torch.zeros_like(lin.bias)]
            for per_rank in micros:
                ranks = [pr[i] for pr in per_rank]
                g = (_node_grad(ranks, world, per_node) if grads
                     else [sum(rk[j] for rk in ranks) / world for j in range(2)])
                total = [t + gj for t, gj in zip(total, g, strict=True)]
            lin.weight.grad, lin.bias.grad = total
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in master.state_dict().items()}


def _rank_grads(compute: nn.Module, batch: tuple, world: int, gas: int, micro: int
                ) -> list[list[list[torch.Tensor]]]:
    """Each rank's (weight, bias) gradients of each Linear at micro-step ``micro``, of its
    loss over ``gas`` (the engine's backward scales it so)."""
    per_rank = []
    for r in range(world):
        compute.zero_grad()
        xr, yr = split_for_rank(batch, r, world, gas, micro)
        (nn.functional.mse_loss(compute(xr), yr) / gas).backward()
        per_rank.append([[p.grad.clone() for p in lin.parameters()]
                         for lin in compute if isinstance(lin, nn.Linear)])
    return per_rank


def _close(got: dict, want: dict, plain: dict) -> None:
    """``got`` equals the replay ``want`` to fp32 summation order, and is measurably apart
    from unquantized training ``plain`` (the quantization took effect)."""
    apart = 0.0
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
        apart = max(apart, (got[name] - plain[name]).abs().max().item())
    assert apart > 1e-4, apart


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_quantized_weights_master_equals_replay(tmp_path, world_size):
    """qwZ, stage 3, fp32: forward and backward see the int8-served weights, the fp32 master
    steps exactly on their gradient (a replay that quantizes nothing is 1e-4 or more away)."""
    configs = [_config(world_size, 3, zero_quantized_weights=True)]
    (params, _, comm), = run_distributed(_train, world_size, tmp_path, configs,
                                         timeout=240)[0]
    _close(params, _replay(world_size, weights="all"), _replay(world_size))
    assert comm["quantized_all_gather"]["count"] > 0 and "all_gather" not in comm


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_quantized_gradients_equal_replay(tmp_path, world_size):
    """qgZ at stages 1, 2 and 3, fp32, 2 simulated nodes from W = 2 (1 rank each at W = 2, 2 at
    W = 4): the gradient is each node's sum, int4-quantized per shard, summed over nodes."""
    per_node = max(1, world_size // 2)
    configs = [_config(world_size, stage, per_node=per_node, zero_quantized_gradients=True)
               for stage in (1, 2, 3)]
    runs = run_distributed(_train, world_size, tmp_path, configs, timeout=240)[0]
    want = _replay(world_size, grads=True, per_node=per_node)
    plain = _replay(world_size)
    for params, _, comm in runs:
        _close(params, want, plain)
        assert comm["quantized_all_to_all"]["count"] > 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_quantized_gradients_with_accumulation_equal_replay(tmp_path, world_size):
    """qgZ with gradient_accumulation_steps 2: stages 2 and 3 reduce every micro-step's
    gradient (each one quantized across nodes, then accumulated into the shard), stage 1
    the sum of the micro-steps once at the boundary. DeepSpeed's stage 3 quantizes each
    micro-step's reduction too (``DeepSpeedZeroOptimizer_Stage3.__reduce_and_partition_ipg_grads``
    calls ``all_to_all_quant_reduce`` per bucket, every backward)."""
    per_node = world_size // 2
    configs = [dict(_config(world_size, stage, per_node=per_node,
                            zero_quantized_gradients=True), gradient_accumulation_steps=2,
                    train_batch_size=8 * world_size) for stage in (1, 2, 3)]
    runs = run_distributed(_train, world_size, tmp_path, configs, timeout=240)[0]
    plain = _replay(world_size, gas=2)
    for stage, (params, _, comm) in zip((1, 2, 3), runs, strict=True):
        want = _replay(world_size, grads=True, per_node=per_node, gas=2,
                       reduce_each_micro=stage > 1)
        _close(params, want, plain)
        assert comm["quantized_all_to_all"]["count"] == (1 if stage == 1 else 2) * 2, stage


def _train_frozen(rank: int, world: int) -> tuple:
    model = _model()
    model[0].requires_grad_(False)
    engine, *_ = meshzero.initialize(model=model, config=_config(
        world, 3, zero_quantized_nontrainable_weights=True))
    x, y = make_batches("mlp", 1, engine.train_batch_size())[0]
    xr, yr = split_for_rank((x, y), rank, world, 1, 0)
    engine.backward(nn.functional.mse_loss(engine(xr), yr))
    engine.step()
    return engine.full_state_dict(), engine.comm_report()


def test_quantized_frozen_weights_only(tmp_path):
    """zero_quantized_nontrainable_weights: a frozen unit is served int8, the trainable one
    exactly; the gathers of each are counted apart."""
    world = 2

    (params, comm), _ = run_distributed(_train_frozen, world, tmp_path, timeout=120)
    # the first step (no reuse plan yet): the frozen unit for forward only (no gradient
    # flows into it), the trainable one for forward and again for backward
    assert comm["quantized_all_gather"]["count"] == 1
    assert comm["all_gather"]["count"] == 2
    ref = _model()
    w, b = _as_served([ref[0].weight, ref[0].bias], world, QWZ_BLOCK, 8)
    x, y = make_batches("mlp", 1, 4 * world)[0]
    hidden = torch.tanh(x @ w.T + b)
    opt = torch.optim.AdamW(ref[2].parameters(), lr=LR, weight_decay=WD, eps=ADAM_EPS)
    nn.functional.mse_loss(ref[2](hidden), y).backward()
    opt.step()
    torch.testing.assert_close(params["2.weight"], ref[2].weight.detach(), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(params["0.weight"], ref[0].weight.detach())  # master exact


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bf16_quantized_training_follows_plain_torch(tmp_path, world_size):
    """bf16 with qwZ + qgZ at stage 3 (and hpZ at W = 4): the loss of every step is within
    5 % of fp32 plain torch on the same data (bf16 alone: ~1 %; int8 weights ~0.4 % of a
    block's largest, int4 gradients whose direction Adam normalises)."""
    zero = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    if world_size == 4:
        zero["zero_hpz_partition_size"] = 2
    configs = [_config(world_size, 3, per_node=2, bf16=True, **zero)]
    runs = run_distributed(_train, world_size, tmp_path, configs, 6, timeout=240)
    losses = [sum(r[0][1][s] for r in runs) / world_size for s in range(6)]
    master = _model()
    opt = torch.optim.AdamW(master.parameters(), lr=LR, weight_decay=WD, eps=ADAM_EPS)
    for step, (x, y) in enumerate(make_batches("mlp", 6, 4 * world_size)):
        loss = nn.functional.mse_loss(master(x), y)
        assert abs(losses[step] - loss.item()) <= 0.05 * loss.item(), (step, losses)
        loss.backward()
        opt.step()
        opt.zero_grad()


# -- bytes ----------------------------------------------------------------------------------
def _bytes_configs(world: int) -> list[dict]:
    both = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    return [
        _config(world, 3, per_node=2, **both),
        _config(world, 3, per_node=2, bf16=True, zero_hpz_partition_size=2,
                stage3_max_reuse_distance=0, **both),
        _config(world, 2, per_node=2, zero_quantized_gradients=True),
        _config(world, 3, per_node=2, bf16=True, zero_quantized_nontrainable_weights=True),
        _config(world, 3, per_node=2),
    ]


def test_comm_report_counts_quantized_bytes_and_estimator_predicts_them(tmp_path):
    """W = 4 as 2 nodes of 2 ranks: comm_report's bytes are the packed bytes on the wire
    (by hand for the first config), and the estimator's inside/across-node split equals
    comm_report's to the byte for every config."""
    world, per_node = 4, 2
    configs = _bytes_configs(world)
    runs = run_distributed(_train, world, tmp_path, configs, 2, timeout=240)[0]
    sizes = [padded_shard_numel(n, world) for n in (7 * 16 + 16, 16 * 5 + 5)]  # 32, 24
    comm = runs[0][2]
    # each unit gathered once a step (kept into backward), its 3 peers' packed shards
    assert comm["quantized_all_gather"]["bytes"] == sum(
        3 * (4 * math.ceil(s / QWZ_BLOCK) + s) for s in sizes)
    assert comm["quantized_all_gather"]["inter_node_bytes"] == \
        comm["quantized_all_gather"]["bytes"]
    # qgZ: the node's fp32 reduce-scatter of the whole group inside, int4 to the other node
    assert comm["reduce_scatter"]["intra_node_bytes"] == sum(world * s * 4 // 2 for s in sizes)
    assert comm["quantized_all_to_all"]["inter_node_bytes"] == sum(
        4 * math.ceil(s / QGZ_BLOCK) + math.ceil(s / 2) for s in sizes)
    estimator = Estimator(load_model(_model))
    for config, (_, _, comm) in zip(configs, runs, strict=True):
        settings = settings_from_config(config, world)
        layout = estimator.states(settings, world).layout
        inside = sum(op["intra_node_bytes"] for name, op in comm.items()
                     if name not in CONTROL)
        across = sum(op["inter_node_bytes"] for name, op in comm.items()
                     if name not in CONTROL)
        assert communication_split(layout, settings, per_node) == (inside, across), config


# -- what is refused ---------------------------------------------------------------------------
@pytest.mark.parametrize("zero, extra, words", [
    ({"stage": 2, "zero_quantized_weights": True}, {}, "needs zero_optimization.stage 3"),
    ({"stage": 1, "zero_quantized_nontrainable_weights": True}, {}, "stage 3"),
    ({"stage": 0, "zero_quantized_gradients": True}, {}, "stage 0 all-reduces"),
    ({"stage": 3, "zero_quantized_weights": True, "offload_param": {"device": "cpu"}}, {},
     "offload_param is not supported yet"),
    ({"stage": 2, "zero_quantized_gradients": True, "mics_shard_size": 2}, {},
     "mics_shard_size = 2"),
    ({"stage": 2, "zero_quantized_gradients": True}, {"pipeline_parallel": {"size": 2}},
     "pipeline_parallel.size = 2"),
])
def test_unsupported_combinations_are_refused_naming_the_key(zero, extra, words):
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, "zero_optimization": zero, **extra})
    assert words in str(err.value)
    assert "zero_quantized" in str(err.value)


def _wide_model() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 256))


def test_planner_sends_fewer_bytes_across_nodes_with_zeropp():
    """``meshzero plan``'s time model (communication_split over the two bandwidths): on 2
    nodes of 8, bf16 ZeRO-3, qwZ + qgZ cut the across-node bytes to under 0.35x and move
    the node's reduce-scatter inside; qwZ alone leaves the gradients as they were."""
    estimator = Estimator(load_model(_wide_model))

    def split(**zero) -> tuple[int, int]:
        settings = settings_from_config(_config(16, 3, bf16=True, **zero), 16)
        return communication_split(estimator.states(settings, 16).layout, settings, 8)

    plain, both, weights = split(), split(**{"zero_quantized_weights": True,
                                             "zero_quantized_gradients": True}), \
        split(zero_quantized_weights=True)
    assert plain[0] == 0 and both[0] > 0
    assert both[1] <= 0.35 * plain[1]
    assert both[1] < weights[1] < plain[1]
