"""What runs inside one rank of ``benchmarks/compare.py``: a runner per system (meshzero,
PyTorch FSDP2, DeepSpeed and the one-process no-communication limit), each wrapping the same
model with the same AdamW, and ``worker``, which times the steps and prints one ``RESULT`` line
of JSON on rank 0 for the driver to read."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import statistics
import sys
import time
from typing import NoReturn

import torch
from _models import ModelSpec, build_model, gpt_spec, loss_fn, make_batches, mlp_spec
from torch.utils._python_dispatch import TorchDispatchMode

LR, WEIGHT_DECAY = 1e-4, 0.01


def offload_config(stage: int) -> dict:
    """The CPU-offload keys of ``zero_optimization``, spelled alike in meshzero and DeepSpeed:
    the optimizer (fp32 master, its gradient and Adam's states) at any stage, the parameter
    shards as well at stage 3, the only stage that shards them."""
    keys = {"offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        keys["offload_param"] = {"device": "cpu"}
    return keys


def describe(error: BaseException) -> str:
    """`Type: first line` of an exception, preferring a line about offload (config errors list
    one problem per line)."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()] or [""]
    line = next((ln for ln in lines if "offload" in ln), lines[0])
    return f"`{type(error).__name__}: {line[:200]}`"


# -- counting collectives ------------------------------------------------------------------------
def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(_nbytes(t) for t in x)
    return 0


class CommCounter(TorchDispatchMode):
    """Ring bytes one rank sends, per collective kind, from the c10d ops seen at dispatch."""

    # c10d op -> (kind, index of the "full" argument, factor of B (N-1)/N)
    OPS = {"_allgather_base_": ("all_gather", 0, 1), "allgather_": ("all_gather", 0, 1),
           "allgather_into_tensor_coalesced_": ("all_gather", 0, 1),
           "_reduce_scatter_base_": ("reduce_scatter", 1, 1),
           "reduce_scatter_": ("reduce_scatter", 1, 1),
           "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, 1),
           "allreduce_": ("all_reduce", 0, 2), "allreduce_coalesced_": ("all_reduce", 0, 2),
           "broadcast_": ("broadcast", 0, None),
           "alltoall_base_": ("all_to_all", 1, 1),
           "send": ("send", 0, None), "recv_": ("recv", None, None)}  # bytes sent only

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._opname
            kind, idx, factor = self.OPS.get(name, (name, None, None))
            full = _nbytes(args[idx]) if idx is not None else 0
            if name == "allgather_" or name == "reduce_scatter_":
                full = _nbytes(args[idx][0])  # list of per-rank lists: one rank's view
            n = self.world
            sent = full if factor is None else factor * full * (n - 1) // n
            self.bytes[kind] = self.bytes.get(kind, 0) + sent
        return func(*args, **(kwargs or {}))


# -- the systems ---------------------------------------------------------------------------------
class Meshzero:
    def __init__(self, model, spec: ModelSpec, job: dict):
        import meshzero

        config = {"train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW",
                                "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
                  "bf16": {"enabled": job["bf16"]}, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": job["stage"]}}
        if job["bf16"]:  # fp32 gradients, as FSDP2's reduce_dtype and DeepSpeed's reduction
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        if job["offload"]:
            config["zero_optimization"].update(offload_config(job["stage"]))
        self.spec = spec
        self.engine, *_ = meshzero.initialize(model=model, config=config)

    def forward_backward(self, x, y) -> float:
        loss = loss_fn(self.spec, self.engine(x), y)
        self.engine.backward(loss)
        return loss.item()

    def optimizer_step(self) -> None:
        self.engine.step()

    def state_bytes(self) -> int:
        return sum(v["device"] + v["host"] + v["nvme"]
                   for v in self.engine.memory_report().values() if isinstance(v, dict))

    def comm_report(self) -> dict:
        return self.engine.comm_report()


class FSDP2:
    def __init__(self, model, spec: ModelSpec, job: dict):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kw = {}
        if job["bf16"]:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
        if job["offload"]:
            kw["offload_policy"] = CPUOffloadPolicy()
        reshard = job["stage"] == 3  # ZeRO-2 equivalent: keep params gathered fwd -> bwd
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard, **kw)
        fully_shard(model, reshard_after_forward=reshard, **kw)
        self.model, self.spec = model, spec
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                     fused=True)

    def forward_backward(self, x, y) -> float:
        loss = loss_fn(self.spec, self.model(x), y)
        loss.backward()
        return loss.item()

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        def local(t):
            return _nbytes(t.to_local() if hasattr(t, "to_local") else t)

        total = sum(local(p) + (local(p.grad) if p.grad is not None else 0)
                    for p in self.model.parameters())
        return total + sum(local(t) for s in self.opt.state.values() for t in s.values()
                           if isinstance(t, torch.Tensor))


class DeepSpeed:
    def __init__(self, model, spec: ModelSpec, job: dict):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        zero = {"stage": job["stage"]}
        config = {"train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": 1,
                  "zero_optimization": zero, "steps_per_print": 10**9,
                  "bf16": {"enabled": job["bf16"]}}
        if job["bf16"]:
            config["communication_data_type"] = "fp32"  # as meshzero's and FSDP2's reduction
        optimizer = None
        if job["offload"]:  # DeepSpeedCPUAdam, DeepSpeed's own optimizer for ZeRO-Offload
            zero.update(offload_config(job["stage"]))
            config["optimizer"] = {"type": "AdamW",
                                   "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                          fused=True)
        self.engine, self.opt, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                         config=config)
        self.spec, self.bf16, self.stage = spec, job["bf16"], job["stage"]

    def forward_backward(self, x, y) -> float:
        if self.bf16 and x.is_floating_point():
            x = x.to(torch.bfloat16)
        loss = loss_fn(self.spec, self.engine(x), y)
        self.engine.backward(loss)
        return loss.item()

    def optimizer_step(self) -> None:
        self.engine.step()

    def state_bytes(self) -> int | None:
        o = self.opt
        if self.stage == 3:
            held = [o.fp16_partitioned_groups_flat, o.fp32_partitioned_groups_flat,
                    o.grad_partitions_flat_buffer,
                    [p.data for p in self.engine.module.parameters()
                     if p.ds_persist]]  # persistent params stay whole
        else:
            held = [o.bit16_groups_flat, o.single_partition_of_fp32_groups,
                    list(o.averaged_gradients.values())]
        held.append([t for s in o.optimizer.state.values() for t in s.values()])
        seen: dict[int, int] = {}

        def walk(x):
            if isinstance(x, torch.Tensor) and x.numel():
                st = x.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
            elif isinstance(x, list | tuple):
                for y in x:
                    walk(y)

        walk(held)
        return sum(seen.values())


class NoComm:
    """One process, no sharding: the same per-rank work with plain fused AdamW."""

    def __init__(self, model, spec: ModelSpec, job: dict):
        self.model, self.spec, self.bf16 = model, spec, job["bf16"]
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                     fused=True)

    def forward_backward(self, x, y) -> float:
        ctx = torch.autocast("cpu", torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        with ctx:
            out = self.model(x)
        loss = loss_fn(self.spec, out, y)
        loss.backward()
        return loss.item()

    optimizer_step = FSDP2.optimizer_step
    state_bytes = FSDP2.state_bytes


RUNNERS = {"meshzero": Meshzero, "fsdp2": FSDP2, "deepspeed": DeepSpeed, "nocomm": NoComm}


# -- one run (a rank) ----------------------------------------------------------------------------
def _spec(job: dict) -> ModelSpec:
    make = gpt_spec if job["model"] == "gpt" else mlp_spec
    return make(job["tiny"], **job["sizes"])


def worker(job: dict) -> None:
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(job["threads"])
    spec = _spec(job)
    n_steps = job["warmup"] + job["steps"]
    batches = make_batches(spec, job["seed"], rank, n_steps + 1)
    model = build_model(spec, job["seed"])
    psi = sum(p.numel() for p in model.parameters())
    try:
        run = RUNNERS[job["system"]](model, spec, job)
    except Exception as e:  # noqa: BLE001 - an offload a system cannot do here is a table row
        if not job["offload"]:
            raise
        _finish(rank, {"unsupported": describe(e)})
    times, exposed, loss = [], [], 0.0
    profile = None
    for i, (x, y) in enumerate(batches[:n_steps]):
        if i == job["warmup"] and job.get("profile") and rank == 0:
            import cProfile

            profile = cProfile.Profile()
            profile.enable()
        t0 = time.perf_counter()
        loss = run.forward_backward(x, y)
        run.optimizer_step()
        times.append(time.perf_counter() - t0)
        if isinstance(run, Meshzero):
            exposed.append(sum(v["exposed_seconds"] for v in run.comm_report().values()))
    if profile is not None:
        profile.disable()
        profile.dump_stats(f"{job['profile']}.{job['system']}.zero{job['stage']}.prof")
    own_comm = run.comm_report() if isinstance(run, Meshzero) else None  # last timed step
    counter = CommCounter(world)
    with counter:  # one extra, untimed step: count the collectives, take the model states
        run.forward_backward(*batches[n_steps])
        states = run.state_bytes()
        run.optimizer_step()
    mine = {"times": times, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    result = None
    if rank == 0:
        result = {"psi": psi, "step_s": statistics.median(
                      max(r["times"][i] for r in everyone) for i in range(job["warmup"], n_steps)),
                  "states": states, "rss": max(r["rss"] for r in everyone), "loss": loss,
                  "counted": counter.bytes,
                  "own_comm": {k: v["bytes"] for k, v in own_comm.items()} if own_comm else None,
                  "own_exposed": {k: round(v["exposed_seconds"], 4) for k, v in own_comm.items()}
                  if own_comm else None,
                  "exposed_s": statistics.median(exposed[job["warmup"]:]) if exposed else None}
    _finish(rank, result)


def _finish(rank: int, result: dict | None) -> NoReturn:
    """Print rank 0's ``RESULT`` line, leave the process group, exit without teardown."""
    import torch.distributed as dist

    if rank == 0 and result is not None:
        print("RESULT " + json.dumps(result), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown of torch (seconds per rank on 2 cores)

