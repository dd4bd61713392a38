"""meshzero.estimate under tensor and pipeline parallelism, against real engines on gloo:
the model states of every rank equal engine.memory_report() to the byte (tp=2 at stages 1
and 3, pp=2 at stage 1, tp2 x dp2 at stage 3), and activations/FLOPs are per rank."""

from __future__ import annotations

import pytest
import torch

import meshzero
from meshzero.cli import main
from meshzero.demo.gpt import loss_fn
from meshzero.demo.layout import GPT_LAYOUT
from meshzero.estimate import Cluster, Estimator, estimate, load_model, settings_from_config
from tests.distributed import run_distributed
from tests.test_estimate import TINY_GPT, tiny_gpt

ADAM = {"type": "AdamW", "params": {"lr": 1e-3}}

pytestmark = pytest.mark.usefixtures("no_default_group")


def _config(stage: int, *, tp: int = 1, pp: int = 1, bf16: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2 if pp > 1 else 1,
           "optimizer": ADAM, "zero_optimization": {"stage": stage},
           "bf16": {"enabled": bf16}}
    if tp > 1:
        cfg["tensor_parallel"] = {"size": tp, "plan": "gpt"}
    if pp > 1:
        cfg["pipeline_parallel"] = {"size": pp, "schedule": "1f1b"}
    return cfg


def _mesh_reports(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """memory_report() after one optimizer step of each config, one engine after another."""
    out = []
    for config in configs:
        torch.manual_seed(0)
        pp = config.get("pipeline_parallel", {}).get("size", 1)
        gen = torch.Generator().manual_seed(0)  # the same data on every rank (tp and pp)
        x = torch.randint(0, TINY_GPT.vocab_size, (2, TINY_GPT.block_size), generator=gen)
        engine, *_ = meshzero.initialize(
            model=tiny_gpt(), config=config, loss_fn=loss_fn if pp > 1 else None,
            example_inputs=x if pp > 1 else None,
            pipeline_layout=GPT_LAYOUT if pp > 1 else None)
        if pp > 1:
            engine.train_batch(iter([(x, x)] * 2))
        else:
            engine.backward(loss_fn(engine(x), x))
            engine.step()
        out.append(engine.memory_report())
    return out


def _check(world: int, configs: list[dict], measured: list[list[dict]]) -> None:
    estimator = Estimator(load_model(tiny_gpt), pipeline_layout=GPT_LAYOUT)  # as the engine
    for i, config in enumerate(configs):
        s = settings_from_config(config, world)
        dp = s.dp_size(world)
        per_pp = estimator.rank_states(s, world)
        for rank in range(world):  # tp innermost, then dp, then pp
            pp_rank, dp_rank = rank // (dp * s.tp), rank // s.tp % dp
            want = per_pp[pp_rank].report(dp_rank)
            got = measured[rank][i]
            assert want == {k: got[k] for k in want}, (config, rank)
        est = estimator.estimate(s, Cluster(nodes=1, gpus_per_node=world),
                                 search_micro_batch=False)
        totals = [sum(sum(measured[r][i][k].values()) for k in est.model_states)
                  for r in range(world)]
        assert sum(sum(v.values()) for v in est.model_states.values()) == max(totals)
        assert totals[est.rank] == max(totals), config


def test_tp2_and_pp2_model_states_equal_memory_report(tmp_path):
    configs = [_config(1, tp=2), _config(3, tp=2, bf16=True), _config(1, pp=2)]
    _check(2, configs, run_distributed(_mesh_reports, 2, tmp_path, configs, timeout=120))


def test_tp2_dp2_stage3_model_states_equal_memory_report(tmp_path):
    configs = [_config(3, tp=2)]
    _check(4, configs, run_distributed(_mesh_reports, 4, tmp_path, configs, timeout=120))


def test_activations_and_flops_are_per_rank():
    """tp halves the matmul FLOPs of a block; a pipeline rank runs about half the model, and
    1f1b keeps fewer micro-batches in flight than gpipe."""
    spec = load_model(tiny_gpt)
    cluster = Cluster(nodes=1, gpus_per_node=2)
    kw = {"micro_batch": 2, "seq_len": 16}
    base = estimate(tiny_gpt, cluster=cluster, **kw)
    tp = estimate(tiny_gpt, cluster=cluster, tp=2, tp_plan="gpt", **kw)
    assert 0.4 * base.flops_per_micro_batch < tp.flops_per_micro_batch
    assert tp.flops_per_micro_batch < 0.6 * base.flops_per_micro_batch
    assert tp.activations < base.activations
    est = Estimator(spec, pipeline_layout=GPT_LAYOUT)  # the demo passes its layout
    for schedule in ("gpipe", "1f1b"):
        s = settings_from_config(None, 2, pp=2, pp_schedule=schedule, grad_accum=4, **kw)
        profiles = est.rank_profiles(s, 2)
        assert len(profiles) == 2
        flops = sum(p.flops for p in profiles)
        assert flops == pytest.approx(base.flops_per_micro_batch, rel=0.01)
        if schedule == "gpipe":
            gpipe = [p.peak_bytes for p in profiles]
    one_f1b = [p.peak_bytes for p in profiles]
    assert one_f1b[0] < gpipe[0] and one_f1b[1] < gpipe[1]  # 2 and 1 in flight, not 4
    assert "pp 2 (1f1b" in str(estimate(tiny_gpt, cluster=cluster, pp=2,
                                                     pipeline_layout=GPT_LAYOUT, **kw))


def test_mesh_bad_input():
    cluster = Cluster(nodes=1, gpus_per_node=4)
    with pytest.raises(ValueError,
                       match=r"tensor_parallel.size \(3\) .* does not divide the world size 4"):
        estimate(tiny_gpt, cluster=cluster, tp=3, tp_plan="gpt")
    with pytest.raises(ValueError, match="needs tensor_parallel.plan"):
        estimate(tiny_gpt, cluster=cluster, tp=2)
    with pytest.raises(ValueError, match="with zero_optimization.stage 3"):
        estimate(tiny_gpt, cluster=cluster, pp=2, stage=3)
    with pytest.raises(ValueError, match="n_head"):  # 2 heads over 4 tp ranks
        estimate(tiny_gpt, cluster=cluster, tp=4, tp_plan="gpt")


def test_cli_tp_pp(capsys):
    assert main(["estimate", "tests.test_estimate:tiny_gpt", "--gpus-per-node", "4", "--tp", "2",
                 "--tp-plan", "gpt", "--pp", "2", "--stage", "1", "--micro-batch", "2",
                 "--pipeline-layout", "meshzero.demo.layout:GPT_LAYOUT"]) == 0
    out = capsys.readouterr().out
    assert "tp 2 (plan gpt), pp 2 (1f1b" in out and "mesh: tp 2 x pp 2 x dp 1" in out
