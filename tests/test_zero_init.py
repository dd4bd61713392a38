"""Sharded construction (issue 8 item 1): ``meshzero.zero_init`` and model factories give the
parameters of eager construction, unit by unit, with a fraction of its memory."""

from __future__ import annotations

import ctypes
import functools
import gc
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import meshzero
from meshzero.zero.construction import find_record
from meshzero.zero.materialize import Materializer
from meshzero.zero.units import build_layout
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, zero_config
from tests.models import (
    MLPStack,
    build_model,
    make_batches,
    mlp_loss,
    reference_train,
    split_for_rank,
)

SEED = 1234


class Rotary(nn.Module):
    """No parameters; a non-persistent buffer that reset_parameters computes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            exponent = torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim
            self.inv_freq.copy_(1.0 / 10000**exponent)


class Mixer(nn.Module):
    """Its own parameter and a child: eager construction initialises the child first, then
    (at the end of ``__init__``) its own parameter; a pre-order walk would get that wrong."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(dim))
        self.proj = nn.Linear(dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.gate, -1.0, 1.0)  # own tensors only (recurse=False)


class ConvBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)
        self.bn = nn.BatchNorm1d(dim)  # persistent buffers, set by reset_parameters
        self.rms = nn.RMSNorm(dim)
        self.mix = Mixer(dim)


class Zoo(nn.Module):
    """Every standard module, a frozen one, ties in both directions, buffers, and a root unit
    whose modules come both before and after the blocks in construction order."""

    def __init__(self, vocab: int = 37, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.conv2d = nn.Conv2d(1, 2, 3)
        self.blocks = nn.ModuleList(ConvBlock(dim) for _ in range(3))
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(dim)
        self.rotary = Rotary(dim)
        self.head = nn.Linear(dim, vocab)
        self.embed.weight = self.head.weight  # tied: the head's init is the one that stays
        self.pos = nn.Embedding(16, dim)
        self.pos_head = nn.Linear(dim, 16, bias=False)
        self.pos_head.weight = self.pos.weight  # tied the other way: the embedding's stays


def _eager(factory, seed: int = SEED) -> tuple[dict, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = factory()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, model.rotary.inv_freq.clone(), torch.rand(4)


def _build_every_stage(rank: int, world_size: int) -> list:
    """Per stage: (path, full_state_dict, inv_freq, next random numbers) for a factory with
    the config's seed and for a ``zero_init`` block after torch.manual_seed."""
    out = []
    for stage in range(4):
        cfg = zero_config(stage, global_batch=2 * world_size, seed=SEED)
        engine, *_ = meshzero.initialize(model=Zoo, config=cfg)
        out.append(("factory", stage, engine.full_state_dict(),
                    engine.module.rotary.inv_freq.cpu(), torch.rand(4)))
        del cfg["seed"]
        torch.manual_seed(SEED)
        with meshzero.zero_init():
            model = Zoo()
        engine, *_ = meshzero.initialize(model=model, config=cfg)
        out.append(("zero_init", stage, engine.full_state_dict(),
                    model.rotary.inv_freq.cpu(), torch.rand(4)))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_parameters_equal_eager_construction(tmp_path, world_size):
    want, want_freq, rand_after_build = _eager(Zoo)
    torch.manual_seed(SEED)
    rand_after_seed = torch.rand(4)
    results = run_distributed(_build_every_stage, world_size, tmp_path)
    for rank_results in results:
        for path, stage, state, inv_freq, rand in rank_results:
            assert state.keys() == want.keys()
            for name, value in want.items():
                assert torch.equal(state[name], value), (path, stage, name)
            assert torch.equal(inv_freq, want_freq)
            # the generator ends where eager code would have it: reseeded by the config's
            # seed, or just past the initial values
            assert torch.equal(rand, rand_after_seed if path == "factory" else rand_after_build)
    assert torch.equal(want["embed.weight"], want["head.weight"])
    assert (want["embed.weight"][0] != 0).all(), "the head's init, not the padding row's zeros"


def _train_factory_mlp(rank: int, world_size: int, stage: int, steps: int) -> dict:
    torch.manual_seed(0)
    with meshzero.zero_init():
        model = MLPStack()
    # a list of meta parameters from before initialize(): the engine maps them to the real ones
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay}, {"params": rest}]
    cfg = zero_config(stage, global_batch=8, seed=0)
    del cfg["seed"]
    torch.manual_seed(99)  # no effect on the values: the zero_init block captured its state
    engine, *_ = meshzero.initialize(model=model, model_parameters=groups, config=cfg)
    for batch in make_batches("mlp", steps, 8):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
    return engine.full_state_dict()


@pytest.mark.parametrize("stage", [0, 3])
def test_zero_init_model_trains_like_single_process(tmp_path, stage):
    results = run_distributed(_train_factory_mlp, 2, tmp_path, stage, 3)
    ref = reference_train(lambda: build_model("mlp", 0), make_batches("mlp", 3, 8), eps=ADAM_EPS)
    for params in results:
        for name, want in ref.params.items():
            torch.testing.assert_close(params[name], want, rtol=1e-5, atol=1e-6)


# -- the unit stream, driven directly (one process) -----------------------------------------
def _stream(model: nn.Module, **layout_kwargs) -> tuple[Materializer, list[int]]:
    layout = build_layout(model, num_shards=1, **layout_kwargs)
    comm = SimpleNamespace(size=1, group=None)
    mat = Materializer(model, find_record(model), comm=comm, device=torch.device("cpu"),
                       src=0, )
    return mat, layout


def test_units_are_materialised_one_by_one_in_construction_order():
    torch.manual_seed(0)
    with meshzero.zero_init():
        model = MLPStack(num_blocks=4)
    mat, layout = _stream(model)
    seen = []
    for unit, flats in mat(layout):
        seen.append(unit)
        # the blocks after this one are still on the meta device, and only the root's flat
        # buffer (its head comes last) is still held: the unit's own came with it
        for later in model.blocks[unit:] if unit else []:
            assert all(p.is_meta for p in later.parameters())
        assert {u for u, _ in mat.flats} <= ({0} - {unit})
        # materialised in place: every parameter of the unit is a view of its flat buffer
        group = layout.units[unit].groups[0]
        for slot in group.slots:
            got = model.get_parameter(slot.name)
            assert got.data_ptr() == flats[0][slot.offset:].data_ptr(), slot.name
        assert not flats[0][group.numel:].any(), "padding is zero"
    assert seen == [1, 2, 3, 4, 0]
    torch.manual_seed(0)
    eager = MLPStack(num_blocks=4)
    for (name, got), want in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(got, want), name


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))


class HalfReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))
        self.extra = nn.Parameter(torch.empty(2))
        self.register_buffer("mask", torch.empty(4))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def _wrapped(module_cls) -> nn.Module:
    return nn.Sequential(nn.Linear(2, 3), module_cls())


@pytest.mark.parametrize("module_cls, message", [
    (NoReset, r"module '1' \(NoReset\) was built on the meta device and holds \['weight'\], "
              r"but has no reset_parameters\(\)"),
    # its buffer is real (kept as the constructor left it); the parameter it skips is named
    (HalfReset, r"reset_parameters\(\) of module '1' \(HalfReset\) left \['extra'\] unset"),
])
def test_modules_that_cannot_be_materialised_are_named(module_cls, message):
    with meshzero.zero_init():
        model = _wrapped(module_cls)
    mat, layout = _stream(model)
    with pytest.raises(ValueError, match=message):
        list(mat(layout))


def test_init_fn_replaces_reset_parameters():
    def init_fn(module: nn.Module) -> None:
        for name, t in [*module.named_parameters(recurse=False),
                        *module.named_buffers(recurse=False)]:
            with torch.no_grad():
                t.fill_(len(name))

    with meshzero.zero_init(init_fn=init_fn):
        model = _wrapped(HalfReset)
    mat, layout = _stream(model)
    list(mat(layout))
    state = model.state_dict()
    assert torch.equal(state["0.weight"], torch.full((3, 2), 6.0))
    assert torch.equal(state["1.extra"], torch.full((2,), 5.0))
    assert torch.equal(state["1.mask"], torch.full((4,), 4.0))


def test_zero_init_builds_on_meta_and_can_be_disabled():
    with meshzero.zero_init(zero_config(3, global_batch=2, seed=3)):
        model = MLPStack()
    assert all(p.is_meta for p in model.parameters())
    with meshzero.zero_init(enabled=False):
        model = MLPStack()
    assert not any(p.is_meta for p in model.parameters())
    bad = {"train_batch_size": 1, "zero_optimization": {"stagee": 3}}
    with pytest.raises(meshzero.ConfigError, match="zero_optimization.stagee"), \
            meshzero.zero_init(bad):
        pass


def _not_a_model(rank: int, world_size: int) -> None:
    meshzero.initialize(model=lambda: 3, config=zero_config(3, global_batch=1))


def test_factory_must_return_a_module(tmp_path):
    with pytest.raises(AssertionError, match="a model factory must return an nn.Module"):
        run_distributed(_not_a_model, 1, tmp_path)


# -- memory ------------------------------------------------------------------------------------
class WideBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)


class WideStack(nn.Module):
    def __init__(self, num_blocks: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.input = nn.Linear(8, dim)
        self.blocks = nn.ModuleList(WideBlock(dim, hidden) for _ in range(num_blocks))
        self.head = nn.Linear(dim, 8)


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _fix_mmap_threshold(nbytes: int) -> None:
    """glibc serves allocations below a threshold from the heap and raises the threshold
    each time it frees a larger mapping (up to 32 MiB). Which of a few-MiB shard or unit
    then lands in the heap depends on what the process freed before (imports included), so
    a small model's peak varies from run to run by tens of MiB. A fixed threshold (as
    MALLOC_MMAP_THRESHOLD_ would set) makes it repeatable."""
    m_mmap_threshold = -3  # mallopt parameter number, from malloc.h
    if not ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, nbytes):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def _construction_peak(rank: int, world_size: int, how: str, shape: tuple[int, int, int],
                       mmap_threshold: int | None) -> tuple[int, int]:
    """(peak RSS increase while building the engine, parameter count): the peak is reset
    first (clear_refs 5 resets VmHWM, i.e. getrusage's ru_maxrss, to the current RSS)."""
    if mmap_threshold is not None:
        _fix_mmap_threshold(mmap_threshold)
    factory = functools.partial(WideStack, *shape)
    cfg = zero_config(3, global_batch=world_size, seed=0)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _proc_status_bytes("VmRSS")
    if how == "eager":
        torch.manual_seed(0)
        model = factory()
        engine, *_ = meshzero.initialize(model=model, config=cfg)
        del model
    else:
        engine, *_ = meshzero.initialize(model=factory, config=cfg)
    peak = _proc_status_bytes("VmHWM")
    return peak - base, sum(g.layout.numel for g in engine.zero.groups)


def _peak_ratio(tmp_path, world_size: int, shape: tuple[int, int, int],
                mmap_threshold: int | None = None) -> tuple[float, list]:
    eager = run_distributed(_construction_peak, world_size, tmp_path, "eager", shape,
                            mmap_threshold, timeout=600)
    sharded = run_distributed(_construction_peak, world_size, tmp_path, "zero_init", shape,
                              mmap_threshold, timeout=600)
    assert eager[0][1] == sharded[0][1]
    return max(s for s, _ in sharded) / min(e for e, _ in eager), [eager, sharded]


def test_construction_peak_memory_small(tmp_path):
    """~134 MB of fp32 parameters in 4 MB units at world size 4 (the fixed costs of the
    process weigh more here), with glibc's mmap threshold fixed at 256 KiB."""
    ratio, detail = _peak_ratio(tmp_path, 4, (32, 512, 1024), mmap_threshold=1 << 18)
    assert ratio < 0.4, detail


@pytest.mark.slow
def test_construction_peak_memory_1gb(tmp_path):
    """~1 GB of fp32 parameters (30 blocks of 33.6 MB) at world size 4, stage 3: each rank
    holds its parameter and gradient shards (2 x 252 MB) plus one unit in flight, where eager
    construction holds the model and the broadcast's copy of it (2 x 1 GB). Units above
    32 MiB are always mmapped, so glibc's defaults give repeatable numbers here."""
    ratio, detail = _peak_ratio(tmp_path, 4, (30, 1024, 4096))
    numel = detail[0][0][1]
    assert math.isclose(numel * 4, 1.0e9, rel_tol=0.05)
    assert ratio < 1 / 3, detail
