"""The estimator (``meshzero plan``'s time model) predicts the bytes a 1-bit optimizer's
compressing steps send, to the byte of ``comm_report``: 1-bit Adam in fp32 (each
parameter's momentum its own vector) and bf16 (one vector per param group), 1-bit LAMB (one
vector for every momentum) and 0/1 Adam's synchronising steps, at W = 2 and 4, with the
ranks on one node and on two.

What DeepSpeed compresses per step: ``OnebitAdam.step`` / ``ZeroOneAdam.step`` call
``compressed_allreduce`` on each tensor of their param groups (one flat fp32 master per
group under ``FP16_Optimizer``), ``OnebitLamb.step`` on one vector of all momenta
(runtime/fp16/onebit/adam.py, zoadam.py, lamb.py); the cost of one call is
``NcclBackend.compressed_allreduce``'s all-to-all and all-gather (runtime/comm/nccl.py).
"""

from __future__ import annotations

import pytest

import meshzero
from meshzero.estimate import Estimator
from meshzero.estimate.model import load_model
from meshzero.estimate.plan import Assumptions, plan
from meshzero.estimate.settings import Cluster, settings_from_config
from meshzero.estimate.timing import communication_split, one_bit_bytes
from tests.distributed import run_distributed
from tests.models import build_model, make_batches, mlp_loss, split_for_rank
from tests.test_onebit import PARAMS as ONE_BIT_ADAM
from tests.test_onebit_lamb import PARAMS as LAMB
from tests.test_zeroone import PARAMS as ZERO_ONE

STEPS, BATCH = 10, 8
CONTROL = ("order_check", "phase_check", "step_check")  # not parameter traffic
COMPRESSED = ("compressed_all_to_all", "compressed_all_gather")
ADAM = dict(ONE_BIT_ADAM, lr=1e-4)  # v frozen after 2 uncorrected updates: a larger lr diverges
CASES = [("OneBitAdam", ADAM, False), ("OneBitAdam", ADAM, True), ("OneBitLamb", LAMB, False),
         ("ZeroOneAdam", ZERO_ONE, False)]


def _config(kind: str, params: dict, bf16: bool, per_node: int) -> dict:
    cfg: dict = {"train_batch_size": BATCH, "zero_optimization": {"stage": 0},
                 "optimizer": {"type": kind, "params": params},
                 "topology": {"ranks_per_node": per_node}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _model():
    return build_model("mlp", 0)


def _reports(rank: int, world: int, configs: list[dict]) -> list[list[dict]]:
    """Each config's comm_report after every step."""
    out = []
    for cfg in configs:
        engine, *_ = meshzero.initialize(model=_model(), config=cfg)
        reports = []
        for batch in make_batches("mlp", STEPS, BATCH):
            x, y = split_for_rank(batch, rank, world, 1, 0)
            engine.backward(mlp_loss(engine(x).float(), y))
            engine.step()
            reports.append(engine.comm_report())
        engine.close()
        out.append(reports)
    return out


def _split(report: dict) -> tuple[int, int]:
    return (sum(op["intra_node_bytes"] for k, op in report.items() if k not in CONTROL),
            sum(op["inter_node_bytes"] for k, op in report.items() if k not in CONTROL))


@pytest.mark.parametrize("world", [2, 4])
def test_estimator_predicts_the_compressing_steps_bytes(tmp_path, world):
    per_node = world // 2  # two nodes: the compressed ops cross them
    configs = [_config(kind, params, bf16, per_node) for kind, params, bf16 in CASES]
    runs = run_distributed(_reports, world, tmp_path, configs, timeout=300)[0]
    estimator = Estimator(load_model(_model))
    for (kind, _, bf16), cfg, reports in zip(CASES, configs, runs, strict=True):
        settings = settings_from_config(cfg, world)
        layout = estimator.states(settings, world).layout
        predicted = communication_split(layout, settings, per_node)
        # steps that only compress (0/1 Adam's variance steps also all-reduce gradients;
        # its local steps send nothing)
        compressing = [r for r in reports if any(k in r for k in COMPRESSED)
                       and "all_reduce" not in r]
        assert len(compressing) >= 2, (kind, bf16, reports)
        for report in compressing:
            assert _split(report) == predicted, (kind, bf16, report)
        assert predicted == (0, one_bit_bytes(layout, settings, world))
        # in fp32 each parameter is a vector of its own: more scales than one flat vector
        if kind == "OneBitAdam" and not bf16:
            one_vector = one_bit_bytes(layout, settings.replace(precision="bf16"), world)
            assert one_vector is not None and predicted[1] > one_vector


def test_estimator_keeps_the_all_reduce_for_other_optimizers():
    cfg = _config("OneBitAdam", ADAM, False, 2)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    settings = settings_from_config(cfg, 4)
    layout = Estimator(load_model(_model)).states(settings, 4).layout
    assert one_bit_bytes(layout, settings, 4) is None
    assert communication_split(layout, settings, 2)[1] == sum(
        2 * 3 * g.padded_numel * 4 // 4 for g in layout.groups() if settings.trains(g))


def test_plan_searches_stage_0_and_says_which_steps_it_models():
    cfg = _config("OneBitAdam", ADAM, False, 2)
    del cfg["topology"], cfg["train_batch_size"]
    cfg["train_micro_batch_size_per_gpu"] = 2
    result = plan(_model, config=cfg, cluster=Cluster(nodes=2, gpus_per_node=2,
                                                      gpu_memory=2**30, host_memory=2**34))
    assert {c.estimate.settings.stage for c in result.candidates} == {0}
    settings = result.candidates[0].estimate.settings
    layout = Estimator(load_model(_model)).states(settings, 4).layout
    assert result.candidates[0].comm_s == pytest.approx(
        one_bit_bytes(layout, settings, 4) / Assumptions().inter_node_bw)
    assert any(n.startswith("OneBitAdam: communication is that of a step after the warm-up")
               for n in result.notes), result.notes
