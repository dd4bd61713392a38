"""``bf16.bf16_optimizer_states`` (issue 25): Adam's m and v kept in bf16 (the arithmetic in
fp32, each result rounded once into the state). Equal to a one-process reference that rounds
its states the same way, at every stage and with CPU offload; memory_report() and the
estimator count 2 + 2 bytes per element instead of 4 + 4."""

from __future__ import annotations

import functools

import pytest
import torch

from meshzero.config import load_config
from meshzero.estimate import Estimator, load_model, settings_from_config
from tests.distributed import run_distributed
from tests.engine_runs import ADAM_EPS, train, zero_config
from tests.models import build_model, make_batches, mlp_loss, reference_train

STEPS = 4
LR, WD = 1e-2, 0.01


class Bf16StateAdamW(torch.optim.Optimizer):
    """AdamW whose m and v are stored in bf16 after every update, computed in fp32 on the
    parameters' own dtype (fp32, or bf16 parameters and gradients rounded once per step:
    tests/test_autocast_bf16.py)."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for p in (p for g in self.param_groups for p in g["params"]):
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p, dtype=torch.bfloat16),
                             v=torch.zeros_like(p, dtype=torch.bfloat16))
            state["t"] += 1
            t, w, g = state["t"], p.float(), p.grad.float()
            m = 0.9 * state["m"].float() + 0.1 * g
            v = 0.999 * state["v"].float() + 0.001 * g * g
            state["m"], state["v"] = m.bfloat16(), v.bfloat16()
            w -= LR * ((m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + ADAM_EPS) + WD * w)
            p.copy_(w)


def _config(stage: int, offload: str = "none", path: str | None = None, **extra) -> dict:
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0,
                  "offload_optimizer": {"device": offload}}
    if offload == "nvme":  # several tiles, fragments cut at their edges
        zero["offload_optimizer"]["nvme_path"] = path
        zero["sub_group_size"] = 300
    bf16 = {"enabled": False, "bf16_optimizer_states": True, **extra}
    return zero_config(stage, global_batch=8, zero_optimization=zero, bf16=bf16)


RUNS = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (3, "cpu")]


def _train_all(rank: int, world_size: int, runs: list, path: str | None = None) -> dict:
    out = {}
    for run in runs:
        result = train(rank, world_size, "tricky", _config(*run, path=path), STEPS)
        out[run] = (result.params, result.memory)
    return out


def _max_diff(got: dict, want: dict) -> float:
    return max(float((got[n] - w).abs().max()) for n, w in want.items())


def _mean_diff(got: dict, want: dict) -> float:
    diffs = torch.cat([(got[n] - w).abs().flatten() for n, w in want.items()])
    return float(diffs.mean())


# W = 2 by default; every world size with -m slow
@pytest.mark.parametrize("world_size", [
    pytest.param(1, marks=pytest.mark.slow),
    2,
    pytest.param(4, marks=pytest.mark.slow)])
def test_bf16_states_equal_reference(tmp_path, world_size):
    batches = make_batches("tricky", STEPS, 8)
    ref = reference_train(lambda: build_model("tricky", 0), batches,
                          optimizer=Bf16StateAdamW).params
    fp32 = reference_train(lambda: build_model("tricky", 0), batches, eps=ADAM_EPS).params
    off_by = _max_diff(ref, fp32)  # what rounding the states changes
    assert off_by > 1e-4
    results = run_distributed(_train_all, world_size, tmp_path, RUNS, str(tmp_path),
                              timeout=300)
    estimator = Estimator(load_model(functools.partial(build_model, "tricky")))
    for rank, per_rank in enumerate(results):
        for run, (params, memory) in per_rank.items():
            # summation order may flip a bf16 rounding of m or v: far below what it changes
            assert _max_diff(params, ref) < off_by / 20, (run, _max_diff(params, ref), off_by)
            states = sum(memory["optimizer_states"].values())
            settings = settings_from_config(_config(*run, path=str(tmp_path)), world_size,
                                            seq_len=6)
            want = estimator.states(settings, world_size).report(rank)
            assert want == {k: memory[k] for k in want}, (run, rank)
            # m and v at 2 bytes each (+ a 4-byte step per fragment)
            fp32_settings = settings_from_config(
                _config(*run, path=str(tmp_path), bf16_optimizer_states=False), world_size,
                seq_len=6)
            fp32_states = estimator.states(fp32_settings, world_size).report(rank)
            assert sum(fp32_states["optimizer_states"].values()) > states


def test_bf16_states_config():
    cfg = load_config({"bf16": {"enabled": True, "bf16_optimizer_states": True},
                       "optimizer": {"type": "AdamW"}})
    assert cfg.bf16.bf16_optimizer_states
    with pytest.raises(ValueError, match=r"bf16\.bf16_optimizer_states.*'SGD'"):
        load_config({"bf16": {"bf16_optimizer_states": True},
                     "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    with pytest.raises(ValueError, match=r"bf16\.bf16_optimizer_states.*amsgrad"):
        load_config({"bf16": {"bf16_optimizer_states": True},
                     "optimizer": {"type": "Adam", "params": {"amsgrad": True}}})
    with pytest.raises(ValueError, match=r"bf16\.bf16_optimizer_states.*'nvme'"):
        load_config({"bf16": {"bf16_optimizer_states": True}, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})
    masters = {"bf16_master_weights_and_grads": True}
    assert load_config({"bf16": {"enabled": True, **masters}}).master_dtype == torch.bfloat16
    for extra, words in (
            ({"bf16": masters}, "needs bf16.enabled"),
            ({"data_types": {"grad_accum_dtype": "fp32"}}, "grad_accum_dtype is 'fp32'"),
            ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "'SGD'"),
            ({"zero_optimization": {"stage": 2, "offload_optimizer": {
                "device": "nvme", "nvme_path": "/tmp"}}}, "'nvme' is not supported")):
        with pytest.raises(ValueError, match=r"bf16\.bf16_master_weights_and_grads.*" + words):
            load_config({"bf16": {"enabled": True, **masters}, **extra})


class Bf16MasterAdamW(torch.optim.Optimizer):
    """AdamW on bf16 parameters with bf16 gradients: fp32 arithmetic and fp32 m and v, the
    new parameter rounded once to bf16."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for p in (p for g in self.param_groups for p in g["params"]):
            state = self.state[p]
            if not state:
                state.update(t=0, m=torch.zeros_like(p, dtype=torch.float32),
                             v=torch.zeros_like(p, dtype=torch.float32))
            state["t"] += 1
            t, w, g = state["t"], p.float(), p.grad.float()
            state["m"] = m = 0.9 * state["m"] + 0.1 * g
            state["v"] = v = 0.999 * state["v"] + 0.001 * g * g
            w -= LR * ((m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + ADAM_EPS) + WD * w)
            p.copy_(w)


def _bf16_master_reference() -> dict[str, torch.Tensor]:
    """The whole model in bf16 (parameters are the master), gradients bf16, one process."""
    model = build_model("mlp", 0).to(torch.bfloat16)
    opt = Bf16MasterAdamW(model.parameters())
    for x, y in make_batches("mlp", STEPS, 8):
        mlp_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach().float() for name, p in model.named_parameters()}


def _master_config(stage: int, offload: str) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": offload}}
    return zero_config(stage, global_batch=8, zero_optimization=zero,
                       bf16={"enabled": True, "bf16_master_weights_and_grads": True})


def _train_masters(rank: int, world_size: int, runs: list) -> dict:
    out = {}
    for run in runs:
        result = train(rank, world_size, "mlp", _master_config(*run), STEPS)
        out[run] = (result.params, result.memory)
    return out


def test_bf16_masters_and_grads(tmp_path):
    """bf16 masters (the parameters themselves on the device tier) stepped on bf16
    gradients: bf16 training, 2 + 2 + 8 bytes per element, counted by the estimator."""
    ref = _bf16_master_reference()
    fp32_master = reference_train(lambda: build_model("mlp", 0), make_batches("mlp", STEPS, 8),
                                  eps=ADAM_EPS, dtype=torch.bfloat16).params
    runs = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "cpu")]
    world_size = 2
    results = run_distributed(_train_masters, world_size, tmp_path, runs, timeout=300)
    estimator = Estimator(load_model(functools.partial(build_model, "mlp")))
    for rank, per_rank in enumerate(results):
        for run, (params, memory) in per_rank.items():
            # within a bf16 rounding of the reference, far nearer it than fp32 masters are
            for name, want in ref.items():
                torch.testing.assert_close(params[name], want, rtol=1e-2, atol=4e-3)
            assert _mean_diff(params, ref) < _mean_diff(fp32_master, ref) / 4, run
            settings = settings_from_config(_master_config(*run), world_size)
            want = estimator.states(settings, world_size).report(rank)
            assert want == {k: memory[k] for k in want}, (run, rank)
            if run[1] == "none":  # the bf16 parameters are the master: no copy
                assert sum(memory["master_params"].values()) == 0


def _one_process(config: dict, optimizer=None) -> tuple[object, dict]:
    """Two steps on one process; the engine and its full parameters."""
    import meshzero

    model = build_model("mlp", 0)
    opt = optimizer(model) if optimizer is not None else None
    engine, *_ = meshzero.initialize(model=model, optimizer=opt, config=config)
    try:
        for x, y in make_batches("mlp", 2, 8):
            engine.backward(mlp_loss(engine(x).float(), y))
            engine.step()
        return engine.optimizer, engine.full_state_dict()
    finally:
        engine.close()


def test_bf16_states_with_the_callers_adamw():
    """A torch AdamW passed to initialize (as Hugging Face's Trainer does when the config has
    no optimizer block) is rebuilt with bf16 states: the same result as the config's AdamW."""
    from meshzero.optimizers import DeepSpeedAdam

    base = {"train_batch_size": 8, "bf16": {"bf16_optimizer_states": True}}
    adamw = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "eps": ADAM_EPS}}
    opt, by_config = _one_process({**base, "optimizer": adamw})
    theirs, by_caller = _one_process(base, lambda m: torch.optim.AdamW(
        m.parameters(), lr=LR, weight_decay=WD, eps=ADAM_EPS))
    assert isinstance(theirs, DeepSpeedAdam)
    assert {s["exp_avg"].dtype for s in theirs.state.values()} == {torch.bfloat16}
    for name, want in by_config.items():
        assert torch.equal(by_caller[name], want), name
    with pytest.raises(ValueError, match=r"bf16\.bf16_optimizer_states needs an Adam.*SGD"):
        _one_process(base, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
