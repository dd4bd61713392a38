"""The node-aware mesh (issue 7): the rank map, comm bytes inside and across nodes, ZeRO++
hpZ, and the mesh's bad input."""

from __future__ import annotations

import pytest
import torch

import meshzero
from meshzero.topology import build_topology
from tests.distributed import run_distributed
from tests.engine_runs import train, zero_config
from tests.models import build_model


def _map(rank: int, world_size: int) -> str:
    return build_topology(tp_size=2, pp_size=2, ranks_per_node=2).rank_map()


def test_rank_map_tp2_pp2_on_two_nodes(tmp_path):
    maps = run_distributed(_map, 4, tmp_path)
    assert maps[0] == maps[3] == (
        "mesh pp=2 x dp=1 x tp=2 over 4 ranks, 2 per node (tp innermost, pp outermost)\n"
        "  node 0: rank 0 (pp 0, dp 0, tp 0), rank 1 (pp 0, dp 0, tp 1)\n"
        "  node 1: rank 2 (pp 1, dp 0, tp 0), rank 3 (pp 1, dp 0, tp 1)")


def _hpz_runs(rank: int, world_size: int) -> dict:
    out = {}
    for k in (1, 2):
        # no reuse: every block is gathered again in backward, from the secondary shards
        cfg = zero_config(3, global_batch=8, topology={"ranks_per_node": 2},
                          zero_optimization={"zero_hpz_partition_size": k,
                                             "stage3_max_reuse_distance": 0})
        r = train(rank, world_size, "mlp", cfg, 3)
        out[k] = (r.params, r.comm, r.memory["gathered_params_peak"])
    return out


def test_hpz_keeps_backward_all_gather_inside_the_node(tmp_path):
    """4 ranks as 2 simulated nodes of 2: with hpZ (k=2) the backward all-gathers come from
    the secondary shards inside the node; training is unchanged."""
    for per_rank in run_distributed(_hpz_runs, 4, tmp_path):
        (plain, plain_comm, _), (hpz, hpz_comm, _) = per_rank[1], per_rank[2]
        for name, value in plain.items():
            assert torch.equal(hpz[name], value), name
        plain_bwd = plain_comm["all_gather"]["phases"]["backward"]
        hpz_bwd = hpz_comm["all_gather"]["phases"]["backward"]
        assert plain_bwd["inter_node_bytes"] > 0 and plain_bwd["intra_node_bytes"] == 0
        assert hpz_bwd["inter_node_bytes"] == 0 and hpz_bwd["intra_node_bytes"] > 0
        # forward still gathers over all 4 ranks; reduce-scatter is unchanged
        fwd = hpz_comm["all_gather"]["phases"]["forward"]
        assert fwd == plain_comm["all_gather"]["phases"]["forward"]
        assert fwd["inter_node_bytes"] > 0
        assert hpz_comm["reduce_scatter"]["bytes"] == plain_comm["reduce_scatter"]["bytes"]
        # a unit of B bytes: (k-1)/k B over the 2-rank block instead of 3/4 B over 4 ranks
        assert 3 * hpz_bwd["bytes"] == 2 * plain_bwd["bytes"]


def _bad_mesh(rank: int, world_size: int, config: dict) -> str:
    try:
        meshzero.initialize(model=build_model("mlp"), config=config)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(("extra", "want"), [
    ({"tensor_parallel": {"size": 3, "plan": {"blocks.*.fc1": "colwise"}}},
     "tensor_parallel.size (3) x pipeline_parallel.size (1) = 3 does not divide the world "
     "size 4"),
    ({"zero_optimization": {"zero_hpz_partition_size": 3}},
     "a partition of 3 ranks does not divide the data-parallel size 4"),
    ({"topology": {"ranks_per_node": 3}}, "topology.ranks_per_node = 3 does not divide"),
])
def test_bad_mesh_fails_at_initialize(tmp_path, extra, want):
    cfg = zero_config(3, global_batch=8, **extra)
    for message in run_distributed(_bad_mesh, 4, tmp_path, cfg):
        assert want in message


def _mics_runs(rank: int, world_size: int, stage: int) -> dict:
    cfg = zero_config(stage, global_batch=8, topology={"ranks_per_node": 2},
                      zero_optimization={"mics_shard_size": 2})
    r = train(rank, world_size, "mlp", cfg, 5)
    return {"params": r.params, "losses": r.losses, "comm": r.comm, "memory": r.memory}


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_sharding_equals_single_process(tmp_path, stage):
    """MiCS: ZeRO inside each node of 2 ranks, replicas across the 2 nodes."""
    from tests.test_equivalence import _assert_params_equal, _reference

    results = run_distributed(_mics_runs, 4, tmp_path, stage)
    ref = _reference("mlp", 8)
    psi = sum(t.numel() for t in ref.params.values())
    for r in results:
        _assert_params_equal(r["params"], ref.params, rtol=1e-5, atol=1e-6)
        comm = r["comm"]
        # sharding collectives stay inside the node; only the replica all-reduce crosses
        assert comm["reduce_scatter"]["inter_node_bytes"] == 0
        assert comm["all_gather"]["inter_node_bytes"] == 0
        assert comm["all_reduce"]["inter_node_bytes"] > 0
        held = r["memory"]["grads"]["device"]
        assert psi * 4 // 2 <= held < psi * 4 // 2 + 64  # the grad shard is 1/2, not 1/4


@pytest.mark.parametrize(("extra", "want"), [
    ({"pipeline_parallel": {"size": 2}, "zero_optimization": {"stage": 3}},
     "pipeline_parallel.size = 2 with zero_optimization.stage 3"),
    ({"pipeline_parallel": {"size": 2, "schedule": "zigzag"}},
     "pipeline_parallel.schedule = 'zigzag': Input should be 'gpipe', '1f1b'"),
    ({"tensor_parallel": {"size": 2}}, "tensor_parallel.size = 2 needs tensor_parallel.plan"),
    # AutoTP that disagrees with the size given
    ({"tensor_parallel": {"autotp_size": 2, "size": 4, "plan": "gpt"}}, "disagree; give one"),
    ({"pipeline_parallel": {"size": 2, "micro_batches": 4}, "gradient_accumulation_steps": 2,
      "train_batch_size": 8},
     "pipeline_parallel.micro_batches (4) != gradient_accumulation_steps (2)"),
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}},
     "zero_hpz_partition_size = 2 needs zero_optimization.stage 3"),
])
def test_bad_mesh_config(extra, want):
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 1}}
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ValueError, match=want.replace("(", r"\(").replace(")", r"\)")):
        meshzero.load_config(cfg)
