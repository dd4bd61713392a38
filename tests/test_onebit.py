"""1-bit Adam (DeepSpeed's "OneBitAdam") at ZeRO stage 0 equals a plain-torch replay of the
algorithm on one process, and sends the bytes of packed signs and scales after the warm-up.

What DeepSpeed computes, and where (DeepSpeed 0.19.6):
* ``OnebitAdam.step`` (runtime/fp16/onebit/adam.py): the first step only creates the state;
  warm-up Adam without bias correction on the all-reduced gradient; after the step count
  reaches ``freeze_step`` the engine's gradient all-reduce is switched off
  (``enable_backward_allreduce = False``), ``v`` is frozen and the momentum of the local
  gradient goes through ``compressed_allreduce``; ``p -= lr (m / (sqrt(v) + eps) + wd p)``;
* ``NcclBackend.compressed_allreduce`` (runtime/comm/nccl.py): padding to a multiple of
  ``N lcm(N, 8)``, worker scale ``||m + e|| / sqrt(P)`` and worker error, the server
  average of chunk r on rank r with its own error, signs ``x >= 0 -> +1``;
* ``DeepSpeedEngine._configure_basic_optimizer`` (runtime/engine.py): ``assert not
  self.zero_optimization()`` for the 1-bit family: ZeRO stage 0 only;
* what one ``compressed_allreduce`` takes: ``OnebitAdam.step`` calls it on each tensor of
  its param groups, each with its own ``worker_error``/``server_error`` and padding
  (``corrected_tensor_size``). In fp32 ``DeepSpeedEngine._do_optimizer_sanity_check``
  picks no wrapper, so those tensors are the model's parameters: one scale per parameter.
  Under fp16/bf16 ``_configure_fp16_optimizer`` wraps it in ``FP16_Optimizer``
  (runtime/fp16/fused_optimizer.py), whose param groups hold one flat fp32 master each
  (``param_group['params'] = [self.fp32_groups_flat[i]]``): one vector per group.

The replay below simulates the N ranks in one process with whole vectors (no bit packing,
no communicator); the engine runs them on real gloo ranks.
"""

from __future__ import annotations

import math

import pytest
import torch

import meshzero
from meshzero.comm.compressed import compressed_bytes, padded_numel
from tests.distributed import run_distributed
from tests.engine_runs import train
from tests.models import build_model, make_batches, mlp_loss, split_for_rank

STEPS, FREEZE, BATCH = 6, 3, 8
PARAMS = {"lr": 1e-2, "freeze_step": FREEZE, "betas": [0.9, 0.999], "eps": 1e-4,
          "weight_decay": 0.01, "cuda_aware": False, "comm_backend_name": "nccl"}


def config(dtype: str, stage: int = 0) -> dict:
    """``dtype``: fp32, bf16 (bf16 gradients, all-reduced in bf16 during the warm-up), or
    bf16+fp32grads (data_types.grad_accum_dtype fp32)."""
    cfg: dict = {"train_batch_size": BATCH, "zero_optimization": {"stage": stage},
                 "optimizer": {"type": "OneBitAdam", "params": PARAMS}}
    if dtype.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    if dtype == "bf16+fp32grads":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x < 0, -1.0, 1.0)


def _one_bit_mean(momenta: list[torch.Tensor], worker: list[torch.Tensor],
                  server: list[torch.Tensor]) -> torch.Tensor:
    """The mean of the ranks' momenta as the two compression rounds give it; the errors in
    place. ``momenta``: N vectors of the unpadded size."""
    n, numel, total = len(momenta), momenta[0].numel(), worker[0].numel()
    chunk = total // n
    signs, scales = [], []
    for r in range(n):
        buf = torch.cat([momenta[r], torch.zeros(total - numel)]) + worker[r]
        scale = torch.linalg.norm(buf) / math.sqrt(total)
        worker[r] = buf - scale * _sign(buf)
        signs.append(_sign(buf))
        scales.append(scale)
    out = []
    for c in range(n):  # rank c averages chunk c
        parts = torch.stack([signs[r][c * chunk:(c + 1) * chunk] * (scales[r] * (1.0 / n))
                             for r in range(n)])
        avg = parts.sum(0) + server[c]
        scale = torch.linalg.norm(avg) / math.sqrt(chunk)
        server[c] = avg - scale * _sign(avg)
        out.append(scale * _sign(avg))
    return torch.cat(out)[:numel]


def _local_gradients(w: torch.Tensor, batch, world: int) -> list[torch.Tensor]:
    """Each rank's gradient of its share of ``batch`` at the flat parameters ``w``."""
    model = build_model("mlp", 0)
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(w[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    grads = []
    for r in range(world):
        x, y = split_for_rank(batch, r, world, 1, 0)
        gs = torch.autograd.grad(mlp_loss(model(x), y), list(model.parameters()))
        grads.append(torch.cat([g.reshape(-1) for g in gs]))
    return grads


class Compressor:
    """The 1-bit mean of flat vectors cut into ``sizes`` (one segment per parameter, each
    with its own padding and errors: DeepSpeed in fp32), or of the whole vector as one
    (``sizes`` of one element: DeepSpeed's fp16/bf16 ``FP16_Optimizer`` flat group)."""

    def __init__(self, sizes: list[int], world: int):
        self.sizes = sizes
        total = [padded_numel(n, world) for n in sizes]
        self.worker = [[torch.zeros(t) for _ in range(world)] for t in total]
        self.server = [[torch.zeros(t // world) for _ in range(world)] for t in total]

    def __call__(self, vectors: list[torch.Tensor]) -> torch.Tensor:
        pieces = [v.split(self.sizes) for v in vectors]
        return torch.cat([_one_bit_mean([p[i] for p in pieces], self.worker[i], self.server[i])
                          for i in range(len(self.sizes))])


def param_sizes(flat: bool) -> list[int]:
    """The segments compressed apart: every parameter (fp32), or all as one (fp16/bf16:
    the test model is one param group)."""
    sizes = [p.numel() for p in build_model("mlp", 0).parameters()]
    return [sum(sizes)] if flat else sizes


def reference(world: int, seen: list[list[torch.Tensor]] | None = None,
              flat: bool = False, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The flat parameter vector after every step, plain torch on one process. ``seen``:
    the gradients each rank's optimizer saw at each step (the all-reduced mean during the
    warm-up, its own after), to replay the optimizer and the compression alone on them;
    None: fp32 gradients computed here. ``flat``: the momentum compressed as one vector
    (bf16) instead of per parameter (fp32). ``mask``: the group's exp_avg_mask (flat),
    multiplied into the momentum after each compressed step."""
    w = torch.cat([p.detach().reshape(-1) for p in build_model("mlp", 0).parameters()])
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    compress = Compressor(param_sizes(flat), world)
    (b1, b2), eps, lr, wd = PARAMS["betas"], PARAMS["eps"], PARAMS["lr"], PARAMS["weight_decay"]
    t, compressing, history = 0, False, []
    for step, batch in enumerate(make_batches("mlp", STEPS, BATCH)):
        grads = _local_gradients(w, batch, world) if seen is None else seen[step]
        if t == 0:  # the first step creates the state only
            t = 1
            history.append(w.clone())
            continue
        t += 1
        if compressing:
            momenta = [b1 * m + (1 - b1) * g for g in grads]
            m = compress(momenta) if world > 1 else momenta[0]
            m = m if mask is None else m * mask
        else:  # the engine's all-reduce: the sum, times 1 / N
            g = torch.stack(grads).sum(0) * (1.0 / world) if seen is None else grads[0]
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (v.sqrt() + eps) + wd * w)
        compressing = compressing or t >= max(FREEZE, 2)
        history.append(w.clone())
    return history


def family_config(kind: str, params: dict, batch: int, stage: int = 0,
                  bf16: bool = False) -> dict:
    """A config with the 1-bit optimizer ``kind`` (its ``params``), fp32 or bf16."""
    cfg: dict = {"train_batch_size": batch, "zero_optimization": {"stage": stage},
                 "optimizer": {"type": kind, "params": params}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def record_seen_gradients(engine) -> list[torch.Tensor]:
    """The flat gradients the engine's optimizer sees at each step (a step pre-hook): what a
    bf16 replay runs on, since bf16 gradients differ by an ulp between the engine's views
    into its flat buffer and separate tensors."""
    seen: list[torch.Tensor] = []
    engine.optimizer.register_step_pre_hook(lambda opt, *_: seen.append(torch.cat(
        [p.grad.reshape(-1) for g in opt.param_groups for p in g["params"]])))
    return seen


def by_step(per_rank: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Each rank's seen gradients, regrouped as each step's list over the ranks."""
    return [list(s) for s in zip(*per_rank, strict=True)]


# the 1-bit family's equivalence runs: W = 4 fp32 and W = 2 bf16 by default, the rest slow
FP32_AND_BF16 = pytest.mark.parametrize("world_size,bf16", [
    pytest.param(1, False, marks=pytest.mark.slow),
    pytest.param(2, False, marks=pytest.mark.slow),
    (4, False),
    pytest.param(1, True, marks=pytest.mark.slow),
    (2, True),
    pytest.param(4, True, marks=pytest.mark.slow)])


def _train(rank: int, world_size: int, dtype: str) -> dict:
    engine, _, _, _ = meshzero.initialize(model=build_model("mlp", 0), config=config(dtype))
    history, reports, seen = [], [], record_seen_gradients(engine)
    for batch in make_batches("mlp", STEPS, BATCH):
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x).float(), y))
        engine.step()
        state = engine.full_state_dict()
        history.append(torch.cat([t.float().reshape(-1) for t in state.values()]))
        reports.append(engine.comm_report())
    padded = sum(g.layout.padded_numel for g in engine.zero.groups if g.trainable)
    engine.close()
    return {"history": history, "reports": reports, "padded": padded, "seen": seen}


def _bytes(report: dict, op: str) -> int:
    return report.get(op, {}).get("bytes", 0)


# W = 4 fp32 and W = 2 bf16 by default; the rest with -m slow
@pytest.mark.parametrize("world_size,dtype", [
    pytest.param(1, "fp32", marks=pytest.mark.slow),
    pytest.param(2, "fp32", marks=pytest.mark.slow),
    (4, "fp32"),
    pytest.param(1, "bf16", marks=pytest.mark.slow),
    (2, "bf16"),
    pytest.param(4, "bf16", marks=pytest.mark.slow),
    pytest.param(4, "bf16+fp32grads", marks=pytest.mark.slow)])
def test_onebit_adam_equals_plain_replay(tmp_path, world_size, dtype):
    """Every step's parameters, warm-up (steps 0-2) and compressed (3-5), at fp32 (each
    parameter's momentum compressed on its own) and bf16 (whose stage 0 all-reduces bf16
    gradients, as DeepSpeed's requires; the group's momenta compressed as one vector). A
    sign that flips on round-off moves an element by an lr-sized step, so the tolerance is
    tight."""
    results = run_distributed(_train, world_size, tmp_path, dtype, timeout=300)
    if dtype == "fp32":
        want = reference(world_size)
    else:  # bf16 LayerNorm gradients differ by an ulp between the engine's views into its
        # flat buffer and separate tensors: replay on the gradients the ranks saw
        want = reference(world_size, by_step([r["seen"] for r in results]), flat=True)
    tol = {"rtol": 1e-5, "atol": 1e-6}
    sizes = param_sizes(flat=dtype != "fp32")
    for rank, got in enumerate(results):
        for step, (g, w) in enumerate(zip(got["history"], want, strict=True)):
            torch.testing.assert_close(g, w, **tol, msg=lambda m, s=step, r=rank:
                                       f"rank {r} step {s}: {m}")
        # warm-up steps all-reduce the gradients (bf16: 2 bytes); compressed ones only the
        # packed signs and scales
        n, size = world_size, 2 if dtype == "bf16" else 4
        for step, report in enumerate(got["reports"]):
            compressed = step >= FREEZE
            sent = _bytes(report, "compressed_all_to_all") + _bytes(report,
                                                                    "compressed_all_gather")
            want_sent = sum(compressed_bytes(size, n) for size in sizes)
            assert sent == (want_sent if compressed else 0), (step, report)
            flag = 2 * 4 * (n - 1) // n  # local gradients: one float agrees on inf/nan
            assert _bytes(report, "nonfinite_check") == (flag if compressed else 0)
            full = 2 * (n - 1) * got["padded"] * size // n
            assert _bytes(report, "all_reduce") == (0 if compressed else full), (step, report)


def test_onebit_packed_bytes_formula():
    """``compressed_bytes`` is what one rank sends: two rounds of N-1 rows of packed signs
    (P / 8N bytes) and one fp32 scale."""
    assert compressed_bytes(2733, 4) == 2 * 3 * (padded_numel(2733, 4) // 4 // 8 + 4)
    assert padded_numel(2733, 4) % 32 == 0 and padded_numel(2733, 3) % (3 * 24) == 0
    assert compressed_bytes(2733, 1) == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_onebit_refused_with_zero_stages(stage):
    with pytest.raises(meshzero.ConfigError) as info:
        meshzero.load_config(config("fp32", stage))
    message = str(info.value)
    assert "OneBitAdam" in message and f"zero_optimization.stage {stage}" in message


def test_onebit_params_checked():
    bad = config("fp32")
    bad["optimizer"]["params"] = dict(PARAMS, comm_backend_name="gloo", amsgrad=True)
    with pytest.raises(meshzero.ConfigError) as info:
        meshzero.load_config(bad)
    assert "comm_backend_name" in str(info.value) and "amsgrad" in str(info.value)


def test_onebit_padding_matches_deepspeed():
    """``corrected_tensor_size`` in OnebitAdam.step: a multiple of N * lcm(N, 8)."""
    for n in (1, 2, 3, 4, 6, 8, 16):
        unit = n * (n * 8 // math.gcd(n, 8))
        for numel in (1, 7, 8, 100, 2733):
            p = padded_numel(numel, n)
            assert p % unit == 0 and numel <= p < numel + unit


def _train_fp16_overflow(rank: int, world_size: int) -> tuple[int, torch.Tensor]:
    cfg = dict(config("fp32"), fp16={"enabled": True, "initial_scale_power": 8})
    result = train(rank, world_size, "mlp", cfg, STEPS, overflow_step=FREEZE + 1)
    return result.skipped_steps, torch.cat([t.reshape(-1) for t in result.params.values()])


def test_onebit_inf_on_one_rank_skips_the_step_on_all(tmp_path):
    """After the warm-up the gradients stay local, so an inf on rank 0 alone must still
    skip the step on every rank (else rank 1 waits in the compressed all-reduce)."""
    results = run_distributed(_train_fp16_overflow, 2, tmp_path, timeout=300)
    assert [skipped for skipped, _ in results] == [1, 1]
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)


def _save_and_resume(rank: int, world_size: int, path: str) -> tuple[bool, dict, dict]:
    batches = make_batches("mlp", STEPS, BATCH)
    engine, _, _, _ = meshzero.initialize(model=build_model("mlp", 0), config=config("fp32"))
    for batch in batches[:FREEZE + 1]:  # into the compressed phase
        x, y = split_for_rank(batch, rank, world_size, 1, 0)
        engine.backward(mlp_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(path, tag="t")
    saved = engine.full_state_dict()
    engine.close()
    fresh, _, _, _ = meshzero.initialize(model=build_model("mlp", 0), config=config("fp32"))
    fresh.load_checkpoint(path, tag="t")
    local = fresh.zero.reducer.local_gradients
    x, y = split_for_rank(batches[FREEZE + 1], rank, world_size, 1, 0)
    fresh.backward(mlp_loss(fresh(x), y))
    fresh.step()
    report = fresh.comm_report()
    state = fresh.full_state_dict()
    fresh.close()
    return local, report, {"saved": saved, "after": state}


def test_onebit_checkpoint_resumes_in_the_compressed_phase(tmp_path):
    """A checkpoint saved after the warm-up loads into the compressed phase: the gradients
    stay local and the next step sends only the packed signs and scales."""
    results = run_distributed(_save_and_resume, 2, tmp_path, str(tmp_path / "ckpt"))
    per_param = sum(compressed_bytes(t.numel(), 2) for t in results[0][2]["saved"].values())
    for local, report, _ in results:
        assert local
        sent = _bytes(report, "compressed_all_to_all") + _bytes(report, "compressed_all_gather")
        assert sent == per_param and _bytes(report, "all_reduce") == 0
    for name, value in results[0][2]["after"].items():  # the ranks agree after the step
        torch.testing.assert_close(results[1][2]["after"][name], value, rtol=0, atol=0)
