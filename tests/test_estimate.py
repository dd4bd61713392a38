"""meshzero.estimate against what the engine really holds and allocates.

- model states: equal to engine.memory_report() for every rank, to the byte, at world
  sizes 1, 2 and 4, stages 0-3, fp32 and bf16, Adam and SGD (real engines on gloo);
- the stage-3 gathered working set: equal to the engine's gathered_params_peak;
- activations counted on fake tensors: equal to the bytes a real forward/backward allocates;
- the total: within 15 % of the peak RSS increase of a real CPU run of the demo GPT;
- a meta-device model counted exactly, a 70 B-parameter model in seconds;
- bad input: clear ValueErrors.
"""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import meshzero
from meshzero.cli import main
from meshzero.demo.gpt import GPT, GPTConfig, loss_fn
from meshzero.estimate import (
    Cluster,
    Estimator,
    depth,
    estimate,
    load_model,
    profile_activations,
    settings_from_config,
)
from meshzero.estimate.activations import _LiveBytes
from meshzero.estimate.plan import communication_bytes
from tests.distributed import run_distributed
from tests.engine_runs import train, zero_config
from tests.models import build_model

TINY_GPT = GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16)


def tiny_gpt() -> GPT:
    return GPT(TINY_GPT)


def _gpt_run(rank: int, world: int, config: dict, steps: int) -> dict:
    torch.manual_seed(0)
    engine, *_ = meshzero.initialize(model=tiny_gpt(), config=config)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, TINY_GPT.vocab_size, (engine.train_micro_batch_size_per_gpu(),
                                                   TINY_GPT.block_size), generator=gen)
        engine.backward(loss_fn(engine(x), x))
        engine.step()
    return engine.memory_report(), engine.comm_report()


def _reports(rank: int, world: int, runs: list[tuple[str, dict]]) -> list[tuple[dict, dict]]:
    """(memory_report(), comm_report()) after 2 steps of every (model kind, config), one
    engine after another."""
    out = []
    for kind, config in runs:
        if kind == "gpt":
            out.append(_gpt_run(rank, world, config, 2))
        else:
            result = train(rank, world, kind, config, 2)
            out.append((result.memory, result.comm))
    return out


FACTORIES = {"gpt": tiny_gpt, "tricky": functools.partial(build_model, "tricky"),
             "mlp": functools.partial(build_model, "mlp")}


def _runs(world: int, nvme_path: str) -> list[tuple[str, dict]]:
    sgd = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    gpt = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}}
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    return [
        ("tricky", zero_config(3, global_batch=4 * world, zero_optimization={
            "offload_optimizer": nvme, "offload_param": nvme, "sub_group_size": 500})),
        ("gpt", {**gpt, "bf16": {"enabled": True}, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu"}}}),
        ("mlp", zero_config(1, global_batch=4 * world, zero_optimization={
            "offload_optimizer": {"device": "cpu"}})),
        *[("tricky", zero_config(stage, global_batch=4 * world)) for stage in range(4)],
        ("gpt", {**gpt, "bf16": {"enabled": True}, "zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": 64,
            "stage3_prefetch_bucket_size": 20_000}}),
        ("gpt", {**gpt, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}),
        ("mlp", zero_config(2, global_batch=4 * world, optimizer=sgd)),
        ("mlp", zero_config(0, global_batch=4 * world, bf16={"enabled": True})),
    ]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_model_states_equal_memory_report(tmp_path, world_size):
    runs = _runs(world_size, str(tmp_path))
    measured = run_distributed(_reports, world_size, tmp_path, runs, timeout=240)
    estimators = {kind: Estimator(load_model(f)) for kind, f in FACTORIES.items()}
    cluster = Cluster(nodes=1, gpus_per_node=world_size)
    for i, (kind, config) in enumerate(runs):
        settings = settings_from_config(config, world_size,
                                        seq_len=6 if kind == "tricky" else None)
        states = estimators[kind].states(settings, world_size)
        for rank in range(world_size):
            got = measured[rank][i][0]
            want = states.report(rank)
            assert want == {k: got[k] for k in want}, (kind, config, rank)
        est = estimators[kind].estimate(settings, cluster, search_micro_batch=False)
        totals = [sum(sum(got[k].values()) for k in est.model_states) for got in
                  (measured[r][i][0] for r in range(world_size))]
        assert sum(sum(v.values()) for v in est.model_states.values()) == max(totals)
        # the engine's peak of full buffers = resident (unsharded) ones + the gathered set
        resident = sum(g.padded_numel for g in states.layout.groups()
                       if settings.stage < 3 or g.persistent) * settings.compute_bytes
        memory, comm = measured[0][i]
        assert est.gathered + resident == memory["gathered_params_peak"], (kind, config)
        # the planner's communication volume is what the engine sends
        # (stage 3's 8-byte unit-order checks, the step's non-finite check and the NVMe tier's
        # I/O flags, all step_check, are not parameter traffic: not planned)
        control = ("order_check", "phase_check", "step_check")  # the phase check too
        data = [op for name, op in comm.items() if name not in control]
        sent = sum(op["bytes"] for op in data)
        ops = sum(op["count"] for op in data)
        assert communication_bytes(states.layout, settings) == pytest.approx(sent, abs=ops)


def test_activations_on_fake_tensors_equal_a_real_run():
    """The fake-tensor count equals the bytes a real forward/backward allocates (same
    counter, real tensors), for fp32 and bf16, with and without checkpointing."""
    spec = load_model(tiny_gpt)
    estimator = Estimator(spec)
    for precision, ckpt in (("fp32", False), ("bf16", True)):
        settings = settings_from_config(None, 1, precision=precision, micro_batch=3,
                                        seq_len=16, activation_checkpointing=ckpt)
        fake = estimator.profile(settings, 3)
        torch.manual_seed(0)
        model = tiny_gpt().to(torch.bfloat16 if precision == "bf16" else torch.float32)
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        if ckpt:
            for block in model.blocks:
                block.forward = functools.partial(torch.utils.checkpoint.checkpoint,
                                                  block.forward, use_reentrant=False)
        x = torch.randint(0, 256, (3, 16))
        counter = _LiveBytes({t.untyped_storage()._cdata
                              for t in [*model.parameters(), *model.buffers(), x]})
        with counter:
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256).float(),
                                                     x.reshape(-1))
            loss.backward()
        assert fake.peak_bytes == counter.peak, precision
        assert fake.forward_order == (0, 1, 2, 3)
        assert fake.flops > 6 * spec.num_params * 3 * 16 * 0.5


def test_deep_stack_counted_at_a_few_blocks_equals_the_whole_run(monkeypatch, tmp_path):
    """A stack of identical blocks is run at 2, 3 and 4 blocks and extended: the same peak,
    FLOPs and unit order as running every block (GPT; a Llama-style HF model, whose first
    block differs, when transformers is installed)."""
    specs = [load_model(functools.partial(GPT, GPTConfig(n_layer=6, n_embd=32, n_head=2,
                                                         block_size=16)))]
    try:
        import transformers  # noqa: F401
        path = tmp_path / "config.json"
        path.write_text(json.dumps({
            "model_type": "llama", "vocab_size": 128, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64}))
        specs.append(load_model(str(path)))
    except ImportError:
        pass
    for spec in specs:
        paths = [u.path for u in spec.layout(1, stage=0, persistence_threshold=0,
                                              unit_classes=None).units]
        for ckpt in (False, True) if spec.kind == "module" else (False,):
            kw = {"micro_batch": 2, "seq_len": 16, "precision": "fp32",
                  "checkpointing": ckpt, "unit_paths": paths}
            cut = profile_activations(spec, **kw)
            with monkeypatch.context() as m:
                m.setattr(depth, "find_stack", lambda model: None)
                whole = profile_activations(spec, **kw)
            assert cut.depth is not None and whole.depth is None
            assert (cut.peak_bytes, cut.flops, cut.forward_order) == (
                whole.peak_bytes, whole.flops, whole.forward_order), (spec.name, ckpt)


_RSS_PROBE = textwrap.dedent("""
    import gc, json, re, sys
    import torch, torch._dynamo  # noqa: F401 (loaded before the baseline, as the step does)
    import meshzero
    from meshzero.demo.gpt import GPT, GPTConfig, loss_fn
    torch.set_num_threads(1)

    def status(key):
        text = open("/proc/self/status").read()
        return int(re.search(key + r":\\s+(\\d+)", text).group(1)) * 1024

    def train(cfg, config, steps):
        engine, *_ = meshzero.initialize(model=GPT(cfg), config=config)
        b, g = engine.train_micro_batch_size_per_gpu(), torch.Generator().manual_seed(0)
        for _ in range(steps):
            x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)
            engine.backward(loss_fn(engine(x), x))
            engine.step()

    config = json.loads(sys.argv[1])
    train(GPTConfig(n_layer=1, n_embd=32, block_size=16), config, 2)  # lazy imports, kernels
    gc.collect()
    base = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to now
    train(GPTConfig(), config, 3)
    print(status("VmHWM") - base)
""")


def _peak_rss_increase(config: dict) -> int:
    """Peak RSS increase of training the demo GPT 3 steps in a fresh process. glibc's dynamic
    mmap threshold is pinned to its default (128 KiB) so freed activations go back to the
    system, as they do to a GPU allocator; left dynamic, glibc keeps 10-25 % more in its heap."""
    env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072",
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, json.dumps(config)], env=env,
                         capture_output=True, text=True, timeout=240, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("stage", [0, 3])
def test_total_within_15_percent_of_peak_rss(stage):
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW"},
              "zero_optimization": {"stage": stage}}
    est = estimate("meshzero.demo.gpt:GPT", cluster=Cluster(gpus_per_node=1), config=config)
    measured = _peak_rss_increase(config)
    error = est.gpu_bytes / measured - 1
    print(f"stage {stage}: estimate {est.gpu_bytes} B, measured {measured} B, {error:+.1%}")
    assert abs(error) <= 0.15


def test_meta_model_counted_exactly():
    """DeepSpeed's estimator collapses to one parameter on a meta model; here every
    parameter counts (the tied embedding once), also for a model far larger than memory."""
    est = estimate(tiny_gpt, cluster=Cluster(gpus_per_node=2), stage=3)
    assert est.num_params == tiny_gpt().num_params()
    with torch.device("meta"):
        model = tiny_gpt()
    assert estimate(model, cluster=Cluster(gpus_per_node=2)).num_params == est.num_params

    big = GPTConfig(vocab_size=128_256, block_size=4096, n_layer=80, n_head=64, n_embd=8192)
    start = time.perf_counter()
    est = estimate(functools.partial(GPT, big), cluster=Cluster(nodes=8, gpus_per_node=8),
                   stage=3, precision="bf16", micro_batch=1)
    elapsed = time.perf_counter() - start
    c = big.n_embd
    per_block = 12 * c * c + 13 * c
    assert est.num_params == big.n_layer * per_block + (big.vocab_size + big.block_size + 2) * c
    psi = est.num_params
    # 2 + 4 + 2 + 8 bytes per parameter over 64 ranks (bf16 gradients, the default), plus
    # padding, Adam's steps and the persistent small parameters held whole (~0.1 %)
    assert 16 * psi / 64 <= sum(sum(v.values()) for v in est.model_states.values()) \
        <= 16 * psi / 64 * 1.002
    assert est.activations > 0 and est.max_micro_batch is not None
    assert elapsed < 60, f"a 70 B model took {elapsed:.1f} s to estimate"


def test_bad_input_is_a_clear_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        estimate("no_such_pkg.mod:factory")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        estimate("meshzero.demo.gpt:nope")
    with pytest.raises(ValueError, match="form 'pkg.mod:name'"):
        estimate("meshzero.demo.gpt")
    with pytest.raises(ValueError, match="returned a int, not an nn.Module"):
        estimate(lambda: 3)
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 64,')
    with pytest.raises(ValueError, match="is not valid JSON"):
        estimate(str(bad))
    bad.write_text('{"hidden_size": 64}')
    with pytest.raises(ValueError, match="'model_type'"):
        estimate(str(bad))
    for nodes, gpus in ((0, 8), (1, 0)):
        with pytest.raises(ValueError, match="at least one node with one GPU"):
            estimate(tiny_gpt, cluster=Cluster(nodes=nodes, gpus_per_node=gpus))
    with pytest.raises(ValueError, match="gpu_memory"):
        Cluster(gpu_memory="lots")
    with pytest.raises(ValueError,
                       match="offload_param.device = 'cpu' needs zero_optimization.stage 3"):
        estimate(tiny_gpt, stage=2, offload_param="cpu")
    with pytest.raises(ValueError, match="sequence length"):
        estimate(functools.partial(build_model, "tricky"))
    with pytest.raises(ValueError,
                       match=r"pipeline_parallel.size \(3\) = 3 does not divide the world size 8"):
        estimate(tiny_gpt, config={"train_micro_batch_size_per_gpu": 1,
                                   "pipeline_parallel": {"size": 3}})


def test_hugging_face_config(tmp_path):
    config = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    try:
        import transformers
    except ImportError:
        with pytest.raises(ValueError, match="needs the 'transformers' package"):
            estimate(str(path))
        return
    est = estimate(str(path), cluster=Cluster(gpus_per_node=2), stage=3, seq_len=32)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**config))
    assert est.num_params == sum(p.numel() for p in model.parameters())
    assert est.activations > 0 and est.num_units == 3  # root + 2 decoder layers


def test_offload_tiers():
    """offload_optimizer cpu: master, gradient shard and optimizer states on the host (the
    device keeps the compute params; at stage 1 also the full gradient buffer); nvme: in
    files, with staging tiles in host memory; offload_param: parameter shards at rest."""
    cluster = Cluster(gpus_per_node=2)
    kw = {"cluster": cluster, "stage": 3, "precision": "bf16", "persistence_threshold": 64}
    base = estimate(tiny_gpt, **kw)
    cpu = estimate(tiny_gpt, **kw, offload_optimizer="cpu", offload_param="cpu")
    nvme = estimate(tiny_gpt, **kw, offload_optimizer="nvme", offload_param="nvme")
    for category in ("master_params", "grads", "optimizer_states"):
        moved = base.model_states[category]["device"]
        assert cpu.model_states[category] == {"device": 0, "host": moved, "nvme": 0}
        assert nvme.model_states[category] == {"device": 0, "host": 0, "nvme": moved}
    sharded = base.model_states["params"]["device"]
    assert cpu.model_states["params"]["host"] + cpu.model_states["params"]["device"] == sharded
    assert 0 < cpu.model_states["params"]["device"] < cpu.model_states["params"]["host"]
    tiles = nvme.model_states["offload_buffers"]["host"]
    assert tiles > 0 and nvme.param_read_buffers > 0
    assert nvme.host_bytes_per_node == 2 * (tiles + nvme.param_read_buffers)
    stage1 = estimate(tiny_gpt, cluster=cluster, stage=1, offload_optimizer="cpu")
    full_grads = estimate(tiny_gpt, cluster=cluster, stage=1).model_states["grads"]["device"]
    assert stage1.model_states["grads"]["device"] == full_grads
    assert stage1.model_states["grads"]["host"] * 2 == full_grads
    # fp32 compute with an offloaded optimizer: the host master is a copy
    assert stage1.model_states["master_params"]["host"] * 2 == full_grads


def test_largest_micro_batch_fits_and_one_more_does_not():
    cluster = Cluster(gpus_per_node=1, gpu_memory="150MB")
    est = estimate("meshzero.demo.gpt:GPT", cluster=cluster, stage=0)
    b = est.max_micro_batch
    assert b and b > 1
    fixed = est.gpu_bytes - est.activations
    assert est.fits
    at_b = estimate("meshzero.demo.gpt:GPT", cluster=cluster, stage=0, micro_batch=b)
    over = estimate("meshzero.demo.gpt:GPT", cluster=cluster, stage=0, micro_batch=b + 1)
    assert at_b.fits and not over.fits
    assert at_b.gpu_bytes - at_b.activations == fixed
    tight = estimate("meshzero.demo.gpt:GPT", cluster=Cluster(gpus_per_node=1,
                                                              gpu_memory="50MB"), stage=0)
    assert not tight.fits and tight.max_micro_batch == 0


def test_params_only():
    est = estimate(params="7B", largest_unit="200M", cluster=Cluster(gpus_per_node=8),
                   stage=3, precision="bf16")
    assert est.num_params == 7 * 10**9 and est.num_units == 36  # root + 35 units
    assert est.activations is None and "not counted" in str(est)
    per_sample = estimate(params="7B", largest_unit="200M", activations_per_sample="1GB",
                          cluster=Cluster(gpus_per_node=8), stage=3, precision="bf16")
    assert per_sample.activations == 10**9
    assert per_sample.max_micro_batch == math.floor(
        (80e9 - (per_sample.gpu_bytes - 1e9)) / 1e9)


def test_cli(capsys):
    assert main(["estimate", "meshzero.demo.gpt:GPT", "--gpus-per-node", "4", "--stage", "3",
                 "--micro-batch", "4", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "verdict:   FITS" in out and "largest micro batch that fits" in out
    assert main(["estimate", "meshzero.demo.gpt:GPT", "--gpus-per-node", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["world_size"] == 4 and data["settings"]["stage"] == 0
    assert main(["estimate", "no_such_pkg:f"]) == 1
    assert "meshzero estimate: error: model factory 'no_such_pkg:f'" in capsys.readouterr().err
    assert main(["estimate", "meshzero.demo.gpt:GPT", "--gpus-per-node", "0"]) == 1
    assert "at least one node with one GPU" in capsys.readouterr().err
