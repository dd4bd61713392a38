"""Offload transfers (issue 23): ``engine.transfer_report()`` counts every copy between the
device and the host tier and every NVMe file access, and on CPU they equal the formula's
bytes per step, at stages 2 and 3, in each offload mode, at world sizes 1 and 2.

The formula, per rank and optimizer step, with S the elements of this rank's optimizer space
(the trainable groups' shards), g and c the gradient and compute itemsizes, A the
accumulation steps, L the optimizer leaves and G the bytes of the stage-3 shards gathered
in the step (A times each unit's shard: the default reuse plan keeps every unit gathered
from its forward into its backward):

    d2h         A S g                          each micro-step's reduced gradient shards
    h2d         S c   (parameters on the device)     the updated parameters
                G     (offload_param)          the shards, at their all-gather
    nvme_write  A S g + S (4 + c + 8) + 4 L    gradients; master, params, Adam m and v, step
    nvme_read   (A - 1) S g + S (4 + g + 8) + 4 L + S c (params back; G with offload_param)
                + S g when A > 1 (the non-finite guard reads the file: partial norms taken
                on the device cover a step's gradient only when it was not accumulated)
"""

from __future__ import annotations

import pytest
import torch

import meshzero
from tests.distributed import run_distributed
from tests.engine_runs import train, zero_config
from tests.models import build_model, loss_fn_for, make_batches, split_for_rank

STEPS = 2


def _train_reports(rank: int, world_size: int, stage: int, opt: str, param: str, path: str,
                   accum: int, bf16: bool) -> dict:
    zero: dict = {"offload_optimizer": {"device": opt}, "sub_group_size": 500}
    if param != "none":
        zero["offload_param"] = {"device": param}
    for key in zero:
        if isinstance(zero[key], dict) and zero[key]["device"] == "nvme":
            zero[key]["nvme_path"] = path
    cfg = zero_config(stage, global_batch=4 * accum, grad_accum=accum,
                      zero_optimization=zero, bf16={"enabled": bf16})
    model = build_model("mlp")
    engine, *_ = meshzero.initialize(model=model, config=cfg)
    loss_fn = loss_fn_for(model)
    reports = []
    for batch in make_batches("mlp", STEPS, engine.train_batch_size(), 0):
        for micro in range(accum):
            x, y = split_for_rank(batch, rank, world_size, accum, micro)
            engine.backward(loss_fn(engine(x).float(), y))
            engine.step()
        reports.append(engine.transfer_report())
    groups = engine.zero.groups
    out = {
        "reports": reports,
        "space": sum(g.owned[1] - g.owned[0] for g in groups if g.trainable),
        "shards": sum(g.layout.shard_numel for g in groups if g.sharded),
        "leaves": len(engine.zero.optim_state.fragment_index),
        "c": engine.compute_dtype.itemsize,
        "g": engine.zero.options.grad_dtype.itemsize,
        "pinned": engine.zero.tier.options.pin_memory,
    }
    engine.close()
    return out


def _expected(stage: int, opt: str, param: str, accum: int, r: dict) -> dict[str, int]:
    s, c, g, leaves = r["space"], r["c"], r["g"], r["leaves"]
    gathered = accum * r["shards"] * c if stage == 3 and param != "none" else 0
    h2d = gathered if param != "none" else s * c
    out = {"d2h": accum * s * g, "h2d": h2d, "nvme_read": 0, "nvme_write": 0}
    if opt == "nvme":
        out["nvme_write"] = accum * s * g + s * (4 + c + 8) + 4 * leaves
        params_back = gathered if param == "nvme" else s * c
        # the guard's finiteness check reads the gradient file only when the norms taken on
        # the device do not cover it (accumulated over micro-steps)
        guard = s * g if accum > 1 else 0
        out["nvme_read"] = (accum - 1) * s * g + s * (4 + g + 8) + 4 * leaves + params_back \
            + guard
    return out


CASES = [  # stage, offload_optimizer, offload_param
    (2, "cpu", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"),
    (2, "nvme", "none"), (3, "nvme", "nvme"),
]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage,opt,param", CASES)
def test_transfer_counters_equal_the_formula(tmp_path, world_size, stage, opt, param):
    accum = 2 if world_size == 1 else 1
    results = run_distributed(_train_reports, world_size, tmp_path, stage, opt, param,
                              str(tmp_path), accum, False)
    for r in results:
        want = _expected(stage, opt, param, accum, r)
        report = r["reports"][-1]  # a step after the first: the reuse plan and states exist
        got = {d: report[d]["bytes"] for d in want}
        assert got == want, (stage, opt, param, world_size)
        assert report["d2h"]["count"] > 0 and report["h2d"]["count"] > 0
        for d in want:
            assert not r["pinned"]  # a CPU device: nothing to pin for
            assert report[d]["pinned_count"] == 0
            assert report[d]["seconds"] >= report[d]["exposed_seconds"] >= 0.0


def test_transfer_counters_bf16_and_no_offload(tmp_path):
    """bf16 compute (2-byte gradients and parameters cross); without offload nothing does."""
    r = run_distributed(_train_reports, 1, tmp_path, 3, "cpu", "none", str(tmp_path), 1,
                        True)[0]
    assert r["c"] == r["g"] == 2
    report = r["reports"][-1]
    assert {d: report[d]["bytes"] for d in report} == _expected(3, "cpu", "none", 1, r)
    none = run_distributed(_train_reports, 1, tmp_path, 3, "none", "none", str(tmp_path),
                           1, False)[0]
    assert all(v["bytes"] == v["count"] == 0 for v in none["reports"][-1].values())


def test_transfers_on_cpu_copy_through_one_path():
    """The Transfers object itself: a landed copy, a staged add, a converting copy to the
    device, and the counters of each (CPU: synchronous, same code path)."""
    from meshzero.zero.offload.transfer import Transfers

    t = Transfers(torch.device("cpu"), pin=False)
    src = torch.arange(6, dtype=torch.float32)
    host = torch.zeros(6)
    t.to_host(host, src)
    t.to_host_staged(src, host.add_)
    dev = torch.empty(6, dtype=torch.bfloat16)
    t.to_device(dev, host)
    t.wait()
    assert torch.equal(host, 2 * src) and torch.equal(dev, (2 * src).bfloat16())
    report = t.take().report()
    assert report["d2h"]["bytes"] == 48 and report["d2h"]["count"] == 2
    assert report["h2d"]["bytes"] == 12 and report["h2d"]["count"] == 1
    assert t.take().report()["d2h"]["bytes"] == 0  # taken: the next step starts at zero
    t.close()


def _clip_runs(rank: int, world_size: int, path: str) -> dict:
    out = {}
    for stage in (2, 3):
        for opt in ("none", "cpu", "nvme"):
            zero: dict = {"stage": stage}
            if opt != "none":
                zero["offload_optimizer"] = {"device": opt, "nvme_path": path} \
                    if opt == "nvme" else {"device": opt}
            cfg = zero_config(stage, global_batch=8, gradient_clipping=0.05,
                              zero_optimization=zero)
            r = train(rank, world_size, "mlp", cfg, 3)
            out[(stage, opt)] = r.params
    return out


def test_clipping_from_device_norms_bit_identical(tmp_path):
    """Clipping without accumulation: the offload tiers take the global norm from the
    per-group norms taken on the device before the copy, and still train bit for bit like
    the device tier (which reads its gradient shards)."""
    for per_rank in run_distributed(_clip_runs, 2, tmp_path, str(tmp_path)):
        for (stage, opt), params in per_rank.items():
            for key, t in params.items():
                assert torch.equal(t, per_rank[(stage, "none")][key]), (stage, opt, key)


def test_device_norms_used_only_when_they_cover_the_step():
    """The tier's partial norms: summed like grad_scan.scan_grads (bit-identical), dropped
    when a gradient is accumulated or a norm wanted in fp64 was taken in fp32."""
    from meshzero.zero.grad_scan import scan_grads
    from meshzero.zero.offload import OffloadOptions
    from meshzero.zero.offload.host import HostTier

    class Group:  # what the tier reads of a flat group
        trainable = True

    tier = HostTier.__new__(HostTier)
    groups = [Group(), Group()]
    tier.units = [[groups[0]], [groups[1]]]
    tier.options = OffloadOptions(optimizer="cpu")
    grads = [torch.randn(1000), torch.randn(333)]
    for want, dtype, covered in [(True, torch.float64, True), (True, torch.float32, False),
                                 (False, torch.float32, True)]:
        tier.want_norms(True, dtype)
        for g, grad in zip(groups, grads, strict=True):
            tier.note_norm(g, grad)
        stats = tier.device_grad_stats(need_norm=want)
        if not covered:
            assert stats is None
            continue
        exact = scan_grads(grads, need_norm=want).tolist()
        assert stats == (exact[0], 0.0)
    tier.want_norms(True, torch.float64)
    tier.note_norm(groups[0], grads[0])  # one group missing: not every gradient covered
    assert tier.device_grad_stats(need_norm=True) is None
    tier.want_norms(True, torch.float64)
    for g in groups:
        tier.note_norm(g, torch.tensor([1.0, float("inf")]))
    assert tier.device_grad_stats(need_norm=True)[1] == 2.0


def _threaded_runs(rank: int, world_size: int, path: str) -> dict:
    """Copies on a thread (MESHZERO_OFFLOAD_COPIES=thread): the asynchronous path of CUDA,
    its buffers held and its gradients landed on the worker, on CPU."""
    import os

    from meshzero.zero.offload.transfer import Transfers

    os.environ["MESHZERO_OFFLOAD_COPIES"] = "thread"
    assert Transfers(torch.device("cpu"), pin=False).asynchronous
    out = {}
    for name, extra in [("plain", {}),
                        ("clip+accum", {"gradient_clipping": 0.05, "grad_accum": 2})]:
        accum = extra.pop("grad_accum", 1)
        for stage, opt, param in [(2, "none", "none"), (3, "none", "none"),
                                  (2, "cpu", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme")]:
            zero: dict = {"stage": stage}
            for key, where in (("offload_optimizer", opt), ("offload_param", param)):
                if where != "none":
                    zero[key] = {"device": where, "nvme_path": path}
            cfg = zero_config(stage, global_batch=8 * accum, grad_accum=accum,
                              zero_optimization=zero, **extra)
            out[(name, stage, opt)] = train(rank, world_size, "mlp", cfg, 3).params
    return out


def test_asynchronous_copies_on_a_thread_bit_identical(tmp_path):
    """With every copy run later on a thread, offload still trains bit for bit like the
    device tier: nothing reads a host gradient before it landed, overwrites a buffer in
    flight, or computes with parameters that have not crossed."""
    for per_rank in run_distributed(_threaded_runs, 2, tmp_path, str(tmp_path)):
        for (name, stage, opt), params in per_rank.items():
            base = per_rank[(name, stage, "none")]
            for key, t in params.items():
                assert torch.equal(t, base[key]), (name, stage, opt, key)


def _backward_on_another_thread(rank: int, world_size: int, path: str) -> dict:
    """Forward on this thread, backward on another, as autograd runs backward on CUDA: its
    hooks (stage 3 gathers each unit's shards again) issue host -> device copies from a
    thread that is neither the training thread nor one of ours. Copies run on a thread and
    late (each waits 20 ms), so a copy compute does not wait for is seen as a wrong value."""
    import os
    import threading
    import time

    from meshzero.zero.offload import transfer

    timed_copy = transfer._timed_copy

    def late_copy(dst, src):
        time.sleep(0.02)
        return timed_copy(dst, src)

    out = {}
    for mode in ("sync", "thread"):
        os.environ["MESHZERO_OFFLOAD_COPIES"] = mode
        transfer._timed_copy = late_copy
        try:
            zero = {"stage": 3, "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "cpu"}}
            cfg = zero_config(3, global_batch=8, zero_optimization=zero)
            model = build_model("mlp")
            engine, *_ = meshzero.initialize(model=model, config=cfg)
            loss_fn = loss_fn_for(model)
            for batch in make_batches("mlp", 3, engine.train_batch_size(), 0):
                x, y = split_for_rank(batch, rank, world_size, 1, 0)
                loss = loss_fn(engine(x).float(), y)
                backward = threading.Thread(target=engine.backward, args=(loss,),
                                            name="autograd-device-thread")
                backward.start()
                backward.join()
                engine.step()
            out[mode] = engine.full_state_dict()
            engine.close()
        finally:
            transfer._timed_copy = timed_copy
            os.environ.pop("MESHZERO_OFFLOAD_COPIES")
    return out


def test_copies_issued_by_backward_on_another_thread_are_joined(tmp_path):
    """Copies issued by a compute thread that is not the training thread (autograd's device
    thread on CUDA) are waited for by compute (the first GPU run found stage 3 with
    offload_param reading shards that had not crossed yet: non-finite gradients)."""
    for runs in run_distributed(_backward_on_another_thread, 2, tmp_path, str(tmp_path)):
        for key, t in runs["thread"].items():
            assert torch.equal(t, runs["sync"][key]), key
