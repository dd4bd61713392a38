"""``requires_grad`` changed after initialize (zero/trainability.py), beyond the pattern suite
(tests/test_patterns.py trains the toggle and unfreeze patterns at stages 0-3, 2 and 4
ranks): with CPU offload, across a checkpoint resume in the middle of a schedule (resharded
to another stage, and consolidated), and a GAN trained as two engines. Every run equals
one plain-torch process (tests/test_patterns.reference, or two optimizers for the GAN)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import meshzero
from meshzero.checkpoint import consolidate
from tests.distributed import run_distributed
from tests.models import split_for_rank
from tests.pattern_models import BY_NAME, DIM, GLOBAL_BATCH, Ctx, Lin, Pattern
from tests.test_patterns import STEPS, _config, _train, build, check, make_data, reference

TOGGLES = ["gan_alternating_requires_grad", "progressive_unfreezing",
           "freeze_then_unfreeze_keeps_state", "requires_grad_per_micro_step",
           "unfrozen_after_initialize"]
OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


def _offloaded(rank: int, world: int, stages: list[int]) -> dict:
    logging.getLogger("meshzero").setLevel(logging.ERROR)
    out = {}
    for stage in stages:
        out[stage] = {name: _train(dataclasses.replace(BY_NAME[name], config=OFFLOAD), rank,
                                   world, stage) for name in TOGGLES}
    return out


def _one_launch(rank: int, world: int, root: str) -> dict:
    """Every default-suite case of this file in one launch (a launch costs seconds)."""
    return {"offload": _offloaded(rank, world, [1, 3]),
            "frozen_steps": _frozen_steps(rank, world, FROZEN_CASES),
            "nvme": _nvme(rank, world, f"{root}/nvme", [3]),
            "outside": _outside_optimizer(rank, world, [1, 3]),
            "resumed": _resumed(rank, world, f"{root}/ckpt"),
            "gan": {stage: _gan_engines(rank, world, stage) for stage in (1, 3)}}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list[dict], Path]:
    root = tmp_path_factory.mktemp("requires_grad")
    (root / "nvme").mkdir()
    (root / "ckpt").mkdir()
    return run_distributed(_one_launch, 2, root, str(root), timeout=900), root


def _check_offloaded(results: list[dict], stages: list[int]) -> None:
    failures = [f for s in stages for f in check([r[s] for r in results], 2, s)]
    assert not failures, "\n".join(failures)


def test_toggle_patterns_with_cpu_offload(launched):
    """The host tier steps each unit during the boundary backward: skipped fragments are
    left out of that unit step too (stages 1 and 3; 2 with the slow set)."""
    _check_offloaded([r["offload"] for r in launched[0]], [1, 3])


@pytest.mark.slow
def test_toggle_patterns_with_cpu_offload_stage_2(tmp_path):
    _check_offloaded(run_distributed(_offloaded, 2, tmp_path, [2], timeout=600), [2])


def _frozen_steps(rank: int, world: int, cases: list[tuple[int, str]]) -> dict:
    """freeze_then_unfreeze_keeps_state in bf16 with 16-bit gradients (the chunked step of
    zero/offload/stepping.py): per step, the frozen parameters' masters and their leaves'
    Adam step counts."""
    logging.getLogger("meshzero").setLevel(logging.ERROR)
    pattern = BY_NAME["freeze_then_unfreeze_keeps_state"]
    out = {}
    for stage, offload in cases:
        model = build(pattern)
        cfg = _config(pattern, stage)
        cfg.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "bf16"})
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload}
        frozen = {"blocks.1.fc.weight": model.blocks[1].fc.weight,
                  "blocks.1.fc.bias": model.blocks[1].fc.bias, "head.bias": model.head.bias}
        rows = []
        with meshzero.initialize(model=model, config=cfg)[0] as engine:
            state, fragments = engine.optimizer.state, engine.zero.optim_state.fragments
            for step in range(STEPS):
                _steps(engine, model, pattern, rank, world, range(step, step + 1))
                full = engine.full_state_dict()
                counts = {int(state[leaf]["step"]) for p in frozen.values()
                          for leaf in fragments[p] if leaf in state}
                rows.append(({n: full[n] for n in frozen}, counts))
        out[(stage, offload)] = rows
    return out


FROZEN_CASES = [(1, "none"), (3, "cpu")]


def test_frozen_fragments_skipped_with_16_bit_gradients(launched):
    for rank, results in enumerate(launched[0]):
        per_rank = results["frozen_steps"]
        for case in FROZEN_CASES:
            (v0, c0), (v1, c1), (v2, c2) = per_rank[case]
            for name in v0:  # frozen at step 1: not moved (no weight decay, no momentum)
                assert torch.equal(v0[name], v1[name]), (rank, case, name)
                assert not torch.equal(v1[name], v2[name]), (rank, case, name)
            # a rank that holds a fragment of them: Adam's step count skips step 1
            assert (c0, c1, c2) in [({1}, {1}, {2}), (set(), set(), set())], (rank, case)


NVME_TOGGLES = ["frozen_after_initialize", "gan_alternating_requires_grad",
               "freeze_then_unfreeze_keeps_state", "requires_grad_per_micro_step",
               "unfrozen_after_initialize", "progressive_unfreezing"]


def _nvme(rank: int, world: int, path: str, stages: list[int]) -> dict:
    """The toggle and unfreeze patterns with offload_optimizer nvme (stepped tile by tile:
    frozen leaves keep .grad None; a group unfrozen after initialize is appended to the
    files), and at stage 3 with offload_param nvme too (a group frozen at initialize has
    its shard in the file of frozen parameters: unfrozen, it is read from there and written
    to the parameter file at its new place)."""
    logging.getLogger("meshzero").setLevel(logging.ERROR)
    nvme = {"device": "nvme", "nvme_path": path}
    optimizer = {"zero_optimization": {"offload_optimizer": nvme}}
    trained = {stage: {name: _train(dataclasses.replace(BY_NAME[name], config=optimizer),
                                    rank, world, stage) for name in NVME_TOGGLES}
               for stage in stages}
    both = {"zero_optimization": {"offload_optimizer": nvme, "offload_param": nvme}}
    params = {3: {name: _train(dataclasses.replace(BY_NAME[name], config=both), rank, world, 3)
                  for name in NVME_TOGGLES}}
    resumed = _resume_one(rank, world, f"{path}/ckpt-progressive",
                          dataclasses.replace(BY_NAME["progressive_unfreezing"], config=both),
                          3, 3)
    return {"trained": trained, "params": params, "resumed": resumed}


def test_toggles_with_nvme_offload(launched):
    """Every toggle and unfreeze pattern equals plain torch at stage 3 with the NVMe tier
    (stage 1 with the slow set)."""
    _check_offloaded([r["nvme"]["trained"] for r in launched[0]], [3])


@pytest.mark.slow
def test_toggles_with_nvme_offload_stage_1(tmp_path):
    results = run_distributed(_nvme, 2, tmp_path, str(tmp_path), [1], timeout=600)
    _check_offloaded([r["trained"] for r in results], [1])


def test_nvme_params_unfreeze_a_group_frozen_at_initialize(launched):
    """offload_param nvme keeps a frozen stage-3 group's shard in a file of its own; every
    toggle and unfreeze pattern, a group unfrozen after initialize included (at the first
    step, or progressively), trains as plain torch does (before: refused at the first
    backward after the unfreeze), and across a checkpoint resume in the middle of the
    progressive schedule."""
    _check_offloaded([r["nvme"]["params"] for r in launched[0]], [3])
    got = launched[0][0]["nvme"]["resumed"]  # saved after the unfreeze began, resumed
    assert got["steps"] == STEPS
    for pname, value in reference("progressive_unfreezing", 2).items():
        torch.testing.assert_close(got["params"][pname], value, rtol=1e-5, atol=1e-5,
                                   msg=pname)


def _outside_optimizer(rank: int, world: int, stages: list[int]) -> dict:
    """blocks.0 frozen at initialize and left out of model_parameters, then unfrozen: as in
    plain torch it gets gradients but no optimizer ever steps it."""
    logging.getLogger("meshzero").setLevel(logging.ERROR)
    pattern = BY_NAME["unfrozen_after_initialize"]
    out = {}
    for stage in stages:
        model = build(pattern)
        given = [p for p in model.parameters() if p.requires_grad]
        with meshzero.initialize(model=model, config=_config(pattern, stage),
                                 model_parameters=given)[0] as engine:
            before = engine.full_state_dict()
            assert pattern.after_initialize is not None
            pattern.after_initialize(model)
            _steps(engine, model, pattern, rank, world, range(STEPS))
            out[stage] = (before, engine.full_state_dict())
    return out


def test_unfrozen_parameter_outside_the_optimizer_is_never_stepped(launched):
    for before, after in launched[0][0]["outside"].values():
        for name in before:
            moved = not torch.equal(before[name], after[name])
            assert moved != name.startswith("blocks.0."), name


# -- a checkpoint in the middle of a schedule ----------------------------------------------
RESUME = ["freeze_then_unfreeze_keeps_state", "progressive_unfreezing"]
SAVE_AFTER = 2  # steps before the save: step 1 froze (or had not yet unfrozen) parameters
STAGE_PAIRS = [(1, 3), (3, 2), (2, 0)]


def _steps(engine, model: nn.Module, pattern: Pattern, rank: int, world: int,
           steps: range) -> None:
    gas = pattern.grad_accum
    data = make_data(pattern, STEPS)
    for step in steps:
        for micro in range(gas):
            if pattern.schedule is not None:
                pattern.schedule(model, step, micro)
            x, y = split_for_rank(data[step], rank, world, gas, micro)
            engine.backward(pattern.loss(engine, model, x, y, Ctx(rank, step, micro)))
            engine.step()


def _resumed(rank: int, world: int, root: str) -> dict:
    logging.getLogger("meshzero").setLevel(logging.ERROR)
    return {(name, save_stage): _resume_one(rank, world, f"{root}/{name}-{save_stage}",
                                            BY_NAME[name], save_stage, load_stage)
            for name in RESUME for save_stage, load_stage in STAGE_PAIRS}


def _resume_one(rank: int, world: int, where: str, pattern: Pattern, save_stage: int,
                load_stage: int) -> dict:
    """Train ``pattern`` to SAVE_AFTER, save, resume in a new engine, train to STEPS."""
    model = build(pattern)
    with meshzero.initialize(model=model, config=_config(pattern, save_stage))[0] as e:
        _steps(e, model, pattern, rank, world, range(1))
        before = e.memory_report()
        _steps(e, model, pattern, rank, world, range(1, SAVE_AFTER))
        e.save_checkpoint(where)
        saved = e.full_state_dict()
        memory = (before, e.memory_report())
    # the resumed run builds the model as the schedule left it: what was frozen at the
    # save is frozen at initialize, its optimizer state comes from the checkpoint
    model = build(pattern)
    pattern.schedule(model, SAVE_AFTER - 1, pattern.grad_accum - 1)
    with meshzero.initialize(model=model, config=_config(pattern, load_stage))[0] as e:
        e.load_checkpoint(where)
        _steps(e, model, pattern, rank, world, range(SAVE_AFTER, STEPS))
        return {"params": e.full_state_dict(), "saved": saved, "memory": memory,
                "steps": e.global_steps}


def test_resume_in_the_middle_of_a_schedule(launched, tmp_path):
    results = [r["resumed"] for r in launched[0]]
    saved_dir = launched[1] / "ckpt"
    for name in RESUME:
        want = reference(name, 2)
        for save_stage, load_stage in STAGE_PAIRS:
            got = results[0][(name, save_stage)]
            assert got["steps"] == STEPS
            for pname, value in want.items():
                torch.testing.assert_close(got["params"][pname], value, rtol=1e-5, atol=1e-5,
                                           msg=f"{name} {save_stage}->{load_stage} {pname}")
            # consolidated offline: the values at the save, frozen parameters included
            out = tmp_path / f"out-{name}-{save_stage}"
            merged = load_file(consolidate(saved_dir / f"{name}-{save_stage}", out)[0])
            for pname, value in got["saved"].items():
                assert torch.equal(merged[pname], value), (name, save_stage, pname)
    # memory_report counts what a group made trainable after initialize holds: at step 1
    # the progressive run unfroze blocks.2 (72 elements) and inp.bias, whose frozen group
    # (inp.weight and inp.bias, 72) became trainable: at stage 1 each keeps a full fp32
    # gradient buffer (72 * 4 bytes); rank 0's half of blocks.2 is fc.weight[0:36], which
    # gets AdamW's exp_avg, exp_avg_sq (36 * 4 bytes each) and step (a 4-byte tensor), and
    # its half of the input group is inp.weight[0:36], still frozen: no state
    before, after = results[0][("progressive_unfreezing", 1)]["memory"]
    assert after["grads"]["device"] - before["grads"]["device"] == 2 * 72 * 4
    grown = after["optimizer_states"]["device"] - before["optimizer_states"]["device"]
    assert grown == 2 * 36 * 4 + 4, (before, after)


# -- a GAN as two engines --------------------------------------------------------------------
class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Lin() for _ in range(2))

    def forward(self, z):
        for b in self.blocks:
            z = b(z)
        return z


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Lin() for _ in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


GAN_STEPS = 3
GAN_LR = 1e-2


def _gan_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL_BATCH, DIM, generator=gen) + 1.0,
             torch.randn(GLOBAL_BATCH, DIM, generator=gen)) for _ in range(GAN_STEPS)]


def _gan_models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return Generator(), Discriminator()


def _d_loss(d_real: torch.Tensor, d_fake: torch.Tensor, parts: int) -> torch.Tensor:
    return (F.softplus(-d_real).mean() + F.softplus(d_fake).mean()) / parts


def _g_loss(d_fake: torch.Tensor, parts: int) -> torch.Tensor:
    return F.softplus(-d_fake).mean() / parts


def _gan_engines(rank: int, world: int, stage: int) -> dict:
    """The DCGAN loop (DeepSpeed's way): ``fake`` made once; the discriminator steps on it
    detached, then the generator's loss runs back through the updated discriminator (its
    gradients there are not the discriminator engine's: dropped)."""
    logging.getLogger("meshzero").setLevel(logging.ERROR)
    g_model, d_model = _gan_models()
    cfg = {"train_batch_size": GLOBAL_BATCH,
           "optimizer": {"type": "AdamW", "params": {"lr": GAN_LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    g_engine = meshzero.initialize(model=g_model, config=cfg)[0]
    d_engine = meshzero.initialize(model=d_model, config=cfg)[0]
    try:
        for batch in _gan_data():
            real, z = split_for_rank(batch, rank, world, 1, 0)
            fake = g_engine(z)
            d_engine.backward(_d_loss(d_engine(real), d_engine(fake.detach()), 1))
            d_engine.step()
            g_engine.backward(_g_loss(d_engine(fake), 1))
            g_engine.step()
        return {"g": g_engine.full_state_dict(), "d": d_engine.full_state_dict(),
                "steps": (g_engine.global_steps, d_engine.global_steps)}
    finally:
        g_engine.close()
        d_engine.close()


def _gan_reference(world: int) -> dict:
    g_model, d_model = _gan_models()
    opts = [torch.optim.AdamW(m.parameters(), lr=GAN_LR, weight_decay=0.01, foreach=False,
                              fused=False) for m in (g_model, d_model)]
    opt_g, opt_d = opts
    for batch in _gan_data():
        cuts = [split_for_rank(batch, r, world, 1, 0) for r in range(world)]
        fakes = [g_model(z) for _, z in cuts]
        opt_d.zero_grad()
        for (real, _), fake in zip(cuts, fakes, strict=True):
            _d_loss(d_model(real), d_model(fake.detach()), world).backward()
        opt_d.step()
        opt_g.zero_grad()
        for fake in fakes:
            _g_loss(d_model(fake), world).backward()
        opt_g.step()
    return {"g": g_model.state_dict(), "d": d_model.state_dict()}


def test_gan_as_two_engines(launched):
    """Stages 1 and 3 (0 and 2 with the slow set)."""
    for stage in (1, 3):
        _check_gan([r["gan"][stage] for r in launched[0]])


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_gan_as_two_engines_stages_0_and_2(tmp_path, stage):
    _check_gan(run_distributed(_gan_engines, 2, tmp_path, stage, timeout=300))


def _check_gan(results: list[dict]) -> None:
    want = _gan_reference(2)
    for rank, got in enumerate(results):
        assert got["steps"] == (GAN_STEPS, GAN_STEPS)
        for part in ("g", "d"):
            for name, value in want[part].items():
                torch.testing.assert_close(got[part][name], value, rtol=1e-5, atol=1e-5,
                                           msg=f"rank {rank} {part}.{name}")
