"""meshzero.estimate.plan: every configuration it lists fits and is ranked by the stated
time model."""

from __future__ import annotations

import json
import re

import pytest
import torch

from meshzero.cli import main
from meshzero.config import load_config
from meshzero.demo.layout import GPT_LAYOUT
from meshzero.estimate import Cluster, estimate
from meshzero.estimate.plan import Assumptions, communication_bytes, plan
from tests.test_estimate import tiny_gpt

SMALL = Cluster(nodes=1, gpus_per_node=4, gpu_memory="3MB", host_memory="1GB")


@pytest.fixture(scope="module")
def small_plan():
    return plan(tiny_gpt, cluster=SMALL, persistence_threshold=0)


def test_every_candidate_fits_and_is_ranked(small_plan):
    cands = small_plan.candidates
    assert cands and small_plan.considered > len(cands)  # some did not fit
    assert all(c.estimate.fits for c in cands)
    assert all(c.estimate.gpu_bytes <= SMALL.gpu_memory for c in cands)
    speeds = [c.tokens_per_s for c in cands]
    assert speeds == sorted(speeds, reverse=True)
    seen = {(c.estimate.settings.stage, c.estimate.settings.offload_optimizer,
             c.estimate.settings.offload_param) for c in cands}
    assert {(0, "none", "none"), (3, "nvme", "nvme"), (2, "cpu", "none")} <= seen
    text = small_plan.format(5)
    assert "--gpu-flops 312.00 TFLOP/s x --mfu 0.5" in text and "--pcie-bw 25.00 GB/s" in text
    row = re.compile(r"\s*\d+\s+1\s+1\s+[0-3]\s+(none|cpu|nvme)")  # #, tp, pp, stage
    rows = [line for line in text.splitlines() if row.match(line)]
    assert len(rows) == 5


def test_candidate_config_estimates_the_same(small_plan, tmp_path):
    """The ds_config a candidate writes gives the same estimate and passes load_config."""
    for cand in (small_plan.best, small_plan.candidates[-1]):
        cfg = cand.ds_config(nvme_path=str(tmp_path))
        load_config(cfg)
        again = estimate(tiny_gpt, cluster=SMALL, config=cfg, persistence_threshold=0)
        assert again.model_states == cand.estimate.model_states
        assert again.gpu_bytes == cand.estimate.gpu_bytes


def test_time_model():
    """Communication per step: stage 0 and stages 1-2 2 psi (N-1)/N; stage 3 2 psi (N-1)/N
    under DeepSpeed's reuse defaults (every unit of the tiny GPT kept gathered from forward
    into backward) and 3 psi (N-1)/N with reuse off (fp32, no accumulation); compute from
    FLOPs counted on fake tensors."""
    est = estimate(tiny_gpt, cluster=SMALL, stage=3, persistence_threshold=0)
    from meshzero.estimate import Estimator, load_model, settings_from_config

    estimator = Estimator(load_model(tiny_gpt))
    no_reuse = {"zero_optimization": {"stage3_max_reuse_distance": 0,
                                      "stage3_max_live_parameters": 0}}
    for stage, config, factor in ((0, None, 2), (1, None, 2), (2, None, 2), (3, None, 2),
                                  (3, no_reuse, 3)):
        s = settings_from_config(config, 4, stage=stage, persistence_threshold=0)
        layout = estimator.states(s, 4).layout
        psi = sum(g.padded_numel for g in layout.groups())
        assert communication_bytes(layout, s) == pytest.approx(factor * psi * 4 * 3 / 4)
    a = Assumptions(gpu_flops=1e12, mfu=0.5)
    result = plan(tiny_gpt, cluster=SMALL, assumptions=a, stage=3, persistence_threshold=0)
    for c in result.candidates:
        assert c.compute_s == pytest.approx(c.estimate.flops_per_micro_batch / 0.5e12)
        assert c.step_s == pytest.approx(max(c.compute_s, c.comm_s) + c.offload_s)
        assert (c.offload_s > 0) == (c.estimate.settings.offload_optimizer != "none"
                                     or c.estimate.settings.offload_param != "none")
    assert est.flops_per_micro_batch > 0


def test_global_batch():
    result = plan(tiny_gpt, cluster=SMALL, global_batch=32, precision="bf16")
    assert result.candidates
    for c in result.candidates:
        s = c.estimate.settings
        assert s.micro_batch * s.grad_accum * 4 == 32 and s.precision == "bf16"
    with pytest.raises(ValueError, match="not divisible by the 4 data-parallel ranks"):
        plan(tiny_gpt, cluster=SMALL, global_batch=30)


def test_too_big_for_any_config_is_a_value_error():
    with pytest.raises(ValueError, match="no configuration fits .* per GPU"):
        plan(tiny_gpt, cluster=Cluster(gpus_per_node=2, gpu_memory="100kB",
                                       host_memory="10kB"))
    with pytest.raises(ValueError, match="no configuration fits"):
        plan(params="70B", largest_unit="1B", seq_len=4096,
             cluster=Cluster(gpus_per_node=8, gpu_memory="80GB", host_memory="64GB"))


def test_params_only_plan():
    result = plan(params="7B", largest_unit="200M", seq_len=2048, activations_per_sample="2GB",
                  cluster=Cluster(gpus_per_node=8), precision="bf16")
    best = result.best.estimate
    assert best.fits and best.settings.stage >= 1
    # 6 * params * tokens without a model
    assert result.best.compute_s == pytest.approx(
        6 * 7e9 * best.settings.micro_batch * 2048 / (312e12 * 0.5))


def test_cli(capsys, tmp_path):
    out = tmp_path / "best.json"
    assert main(["plan", "tests.test_estimate:tiny_gpt", "--gpus-per-node", "4",
                 "--gpu-memory", "3MB", "--host-memory", "1GB", "--top", "3",
                 "--mfu", "0.4", "--write-config", str(out)]) == 0
    text = capsys.readouterr().out
    assert "x --mfu 0.4" in text and f"wrote the fastest configuration to {out}" in text
    cfg = json.loads(out.read_text())
    load_config(cfg)
    assert cfg["train_batch_size"] == 4 * cfg["train_micro_batch_size_per_gpu"]
    assert main(["plan", "tests.test_estimate:tiny_gpt", "--nodes", "0"]) == 1
    assert "at least one node with one GPU" in capsys.readouterr().err
    assert main(["plan", "--params", "7B", "--largest-unit", "200M"]) == 1
    assert "give --seq-len" in capsys.readouterr().err


@pytest.mark.usefixtures("no_default_group")
def test_tp_pp_plan():
    """With tp/pp given, ZeRO is searched over dp = world / (tp * pp), no stage 3 under a
    pipeline, the bubble and tp/pp traffic are in the step time, and the written config
    carries the mesh and estimates the same."""
    cluster = Cluster(nodes=2, gpus_per_node=2, gpu_memory="2MB")
    result = plan(tiny_gpt, cluster=cluster, global_batch=8, tp=2, tp_plan="gpt", pp=2,
                  precision="bf16", pipeline_layout=GPT_LAYOUT)
    stages = {c.estimate.settings.stage for c in result.candidates}
    assert stages == {0, 1, 2}
    best = result.best
    s = best.estimate.settings
    assert s.micro_batch * s.grad_accum == 8  # dp = 1
    cfg = best.ds_config()
    assert cfg["tensor_parallel"] == {"size": 2, "plan": "gpt"}
    assert cfg["pipeline_parallel"]["micro_batches"] == s.grad_accum
    again = estimate(tiny_gpt, cluster=cluster, config=cfg, pipeline_layout=GPT_LAYOUT)
    assert again.model_states == best.estimate.model_states
    no_tp = plan(tiny_gpt, cluster=cluster, global_batch=8, pp=2, tp=1, precision="bf16",
                 pipeline_layout=GPT_LAYOUT)
    assert best.compute_s > min(c.compute_s for c in no_tp.candidates) / 2  # tp all-reduces


@pytest.mark.usefixtures("no_default_group")
def test_search_mesh():
    """--search-mesh tries tp inside a node and pp over the layers (powers of two), with the
    demo GPT's shipped plan and layout; every row it lists is a plan of its own mesh."""
    cluster = Cluster(nodes=2, gpus_per_node=2, gpu_memory="2MB")
    result = plan(tiny_gpt, cluster=cluster, global_batch=8, precision="bf16", search_mesh=True,
                  pipeline_layout=GPT_LAYOUT)
    assert result.notes[0] == "meshes tried (tp x pp): 1x1, 1x2, 2x1, 2x2"
    meshes = {(c.estimate.settings.tp, c.estimate.settings.pp) for c in result.candidates}
    assert meshes == {(1, 1), (1, 2), (2, 1), (2, 2)}
    speeds = [c.tokens_per_s for c in result.candidates]
    assert speeds == sorted(speeds, reverse=True)
    for c in result.candidates:
        s = c.estimate.settings
        assert s.pp == 1 or s.stage < 3
        assert s.tp_plan == ("gpt" if s.tp > 1 else None)
    # the same mesh planned on its own gives the same rows
    fixed = plan(tiny_gpt, cluster=cluster, global_batch=8, precision="bf16", tp=2,
                 tp_plan="gpt", pp=2, pipeline_layout=GPT_LAYOUT)
    mine = [c for c in result.candidates if (c.estimate.settings.tp, c.estimate.settings.pp)
            == (2, 2)]
    assert [c.row(0) for c in mine] == [c.row(0) for c in fixed.candidates]
    text = result.format(3)
    assert "every tp x pp mesh the notes name" in text and "note: meshes tried" in text
    assert any(line.split()[:4] == ["#", "tp", "pp", "stage"] for line in text.splitlines())


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))


@pytest.mark.usefixtures("no_default_group")
def test_search_mesh_says_what_it_cannot_search():
    result = plan(_mlp, cluster=Cluster(nodes=1, gpus_per_node=2, gpu_memory="1GB"),
                  search_mesh=True, inputs="tests.test_plan:_mlp_inputs")
    assert any(n.startswith("tp not searched: no shipped tensor-parallel plan matches "
                            "Sequential") for n in result.notes)
    # an nn.Sequential is its own layer list: pp is searched over its 4 layers
    assert {c.estimate.settings.pp for c in result.candidates} == {1, 2}
    bare = plan(params="1M", largest_unit="100K", seq_len=8, search_mesh=True,
                cluster=Cluster(nodes=1, gpus_per_node=2, gpu_memory="1GB"))
    assert "tp/pp not searched: a bare parameter count has no modules to split" in bare.notes


def _mlp_inputs(micro_batch: int, seq_len: int | None):
    return (torch.randn(micro_batch, 16),)


def test_inferred_tp_plan():
    from meshzero.estimate.mesh_search import inferred_tp_plan

    assert inferred_tp_plan(tiny_gpt()) == "gpt"
    assert inferred_tp_plan(_mlp()) is None
    transformers = pytest.importorskip("transformers")
    from meshzero.estimate import Settings, load_model
    from meshzero.estimate.mesh_search import mesh_settings
    from tests.test_hf_models import _hf_config

    with torch.device("meta"):
        for kind, want in (("gpt2", "hf_gpt2"), ("llama", "llama")):
            model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind))
            assert inferred_tp_plan(model) == want
            # tp is searched with the inferred plan; pp needs a layout the model does not have
            meshes, notes = mesh_settings(load_model(model), Settings(),
                                          Cluster(nodes=1, gpus_per_node=2))
            assert [(m.tp, m.pp, m.tp_plan) for m in meshes] == [(1, 1, None), (2, 1, want)]
            assert any(n.startswith("pp not searched: no pipeline layout") for n in notes)


@pytest.mark.usefixtures("no_default_group")
def test_search_mesh_cli(capsys):
    assert main(["plan", "tests.test_estimate:tiny_gpt", "--nodes", "2", "--gpus-per-node",
                 "2", "--gpu-memory", "2MB", "--global-batch", "8", "--precision", "bf16",
                 "--search-mesh", "--top", "0",
                 "--pipeline-layout", "meshzero.demo.layout:GPT_LAYOUT"]) == 0
    text = capsys.readouterr().out
    assert "note: meshes tried (tp x pp): 1x1, 1x2, 2x1, 2x2" in text
    rows = [line.split() for line in text.splitlines() if re.match(r"\s*\d+\s+[12]\s+[12]\s", line)]
    assert {(r[1], r[2]) for r in rows} == {("1", "1"), ("1", "2"), ("2", "1"), ("2", "2")}
