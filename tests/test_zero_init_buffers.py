"""zero_init keeps what constructors set (issue 15, item 4): buffers computed in ``__init__``
stay real, random draws happen in eager order, and a model that initialises its weights
twice (a Hugging Face model: torch's defaults, then ``post_init``) gets eager's values bit
for bit. The construction peak is measured by benchmarks/construction_peak.py (slow)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import zero_config

SEED = 4321
ROOT = Path(__file__).resolve().parent.parent


class ScaledRotary(nn.Module):
    """Buffers set in ``__init__`` only (no reset_parameters): a rotary ``inv_freq``, a
    constant scale and a random projection, drawn between the parameters' inits."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        exponent = torch.arange(0, dim, 2, dtype=torch.float32) / dim
        self.register_buffer("inv_freq", 1.0 / 10000**exponent, persistent=False)
        self.register_buffer("scale", torch.tensor(dim**-0.5))
        self.register_buffer("features", torch.randn(dim, 3))
        self.out = nn.Linear(dim, dim, bias=False)


class Buffered(nn.Module):
    def __init__(self, dim: int = 12, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, dim)
        self.blocks = nn.ModuleList(ScaledRotary(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 17)


class ReInit(Buffered):
    """Initialised twice, as Hugging Face models are: torch's default init in each
    constructor, then the model's own scheme over every module (its post_init)."""

    def __init__(self) -> None:
        super().__init__()
        self.apply(self.init_weights)

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    @staticmethod
    def init_fn(module: nn.Module) -> None:
        """For zero_init: what its construction does to one module."""
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        ReInit.init_weights(module)


def _tiny_llama():
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


MODELS = {"buffers": Buffered, "reinit": ReInit, "llama": _tiny_llama}


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().cpu().clone() for n, b in model.named_buffers()}


def _eager(kind: str) -> tuple[dict, dict, torch.Tensor]:
    torch.manual_seed(SEED)
    model = MODELS[kind]()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, _buffers(model), torch.rand(4)


def _init_fn(kind: str, model: nn.Module):
    if kind == "llama":
        return model._init_weights  # its modules have no reset_parameters()
    return ReInit.init_fn if kind == "reinit" else None


def _build(rank: int, world_size: int, stage: int) -> list:
    """Per model and way: (kind, way, full state, every buffer, the next random numbers),
    for a zero_init block and, for the model without an init_fn, a factory with the
    config's seed."""
    out = []
    for kind in MODELS:
        cfg = zero_config(stage, global_batch=2 * world_size, seed=SEED)
        if kind == "buffers":
            engine, *_ = meshzero.initialize(model=MODELS[kind], config=cfg)
            out.append((kind, "factory", engine.full_state_dict(), _buffers(engine.module),
                        torch.rand(4)))
        del cfg["seed"]
        torch.manual_seed(SEED)
        with meshzero.zero_init() as record:
            model = MODELS[kind]()
        assert record is not None and all(p.is_meta for p in model.parameters())
        record.init_fn = _init_fn(kind, model)
        engine, *_ = meshzero.initialize(model=model, config=cfg)
        out.append((kind, "zero_init", engine.full_state_dict(), _buffers(engine.module),
                    torch.rand(4)))
    return out


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_buffers_and_reinit_equal_eager_construction(tmp_path, world_size):
    """Bit for bit, every parameter and buffer (inv_freq too) and the generator after."""
    stage = 3 if world_size > 1 else 0
    results = run_distributed(_build, world_size, tmp_path, stage, timeout=240)
    torch.manual_seed(SEED)
    rand_after_seed = torch.rand(4)
    eager = {kind: _eager(kind) for kind in MODELS}
    for rank_results in results:
        assert len(rank_results) == 4
        for kind, way, state, buffers, rand in rank_results:
            want, want_buffers, rand_after_build = eager[kind]
            assert buffers.keys() == want_buffers.keys()
            for name, value in {**want, **want_buffers}.items():  # non-persistent too
                got = buffers[name] if name in want_buffers else state[name]
                assert torch.equal(got, value), (kind, way, name)
            # the generator ends where eager code leaves it
            assert torch.equal(rand, rand_after_seed if way == "factory" else rand_after_build)
    # the model's second scheme is what stays: not the defaults
    assert eager["reinit"][0]["head.weight"].std() < 0.03 < eager["buffers"][0]["head.weight"].std()


def test_buffers_stay_real_and_modules_with_only_buffers_build():
    """The issue's failure: 'built on the meta device and holds ['scale'], but has no
    reset_parameters()' for a module that only sets a constant buffer in __init__."""
    torch.manual_seed(0)
    with meshzero.zero_init():
        model = ScaledRotary(8)
    assert model.proj.weight.is_meta and model.out.weight.is_meta
    assert not any(b.is_meta for b in model.buffers())
    assert model.scale.item() == pytest.approx(8**-0.5)
    assert torch.equal(model.inv_freq, 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))


def _peak_units(out: str, start: str) -> float:
    row = next(ln for ln in out.splitlines() if ln.startswith(f"| zero_init | {start} "))
    return float(re.search(r"\*\*([\d.]+)\*\*", row).group(1))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tied_lm", "tied_gelu", "hidden"])
def test_construction_peak_within_two_units(model):
    """benchmarks/construction_peak.py: 100-145 M fp32 parameters in blocks of 24-32 MB
    with odd widths (1001) and a tied embedding, at world size 2, stage 3; zero_init's peak
    RSS beyond the final model states <= 2 units on the worst rank, in a fresh process (the
    first engine's imports, 94 MB whatever the model, made at ``import meshzero`` after
    torch) and after a first engine. tied_lm keeps the head's initial values
    (nanoGPT's tie), tied_gelu and hidden the embedding's (Hugging Face's); hidden's root
    unit (its 16,384-token embedding) is 2.04 blocks: built last, it peaked at 2.07 units,
    built first 1.02 (fresh: 4.04 with the imports inside the build, 1.23 now)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "construction_peak.py"),
                          "--how", "zero_init", "--process", "fresh", "warm", "--model", model],
                         capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    for start in ("fresh", "warm"):
        units = _peak_units(out.stdout, start)
        assert math.isfinite(units) and units <= 2.0, out.stdout


def test_estimate_prints_the_construction_peak():
    """Eager: the whole fp32 model on every rank (+ one unit's flat buffer); zero_init: one
    unit. 7.5 B parameters, 200 M in the largest unit, 8 GPUs per node."""
    from meshzero.estimate import Cluster, estimate

    est = estimate(params="7.5B", largest_unit="200M", stage=3,
                   cluster=Cluster(gpus_per_node=8))
    lines = str(est).splitlines()
    eager = next(ln for ln in lines if ln.strip().startswith("eager ("))
    sharded = next(ln for ln in lines if ln.strip().startswith("zero_init ("))
    assert eager.split()[-4:] == ["800.00", "MB", "30.00", "GB"], eager
    assert sharded.split()[-4:] == ["800.00", "MB", "800.00", "MB"], sharded
    assert "while building: eager 240.00 GB, zero_init 6.40 GB" in str(est)
