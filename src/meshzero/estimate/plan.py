"""``meshzero plan``: the configurations that fit a cluster, ranked by estimated step time.

For every ZeRO stage, offload choice (optimizer none/cpu/nvme at stages 1-3, parameters
none/cpu/nvme at stage 3) and micro batch, :mod:`meshzero.estimate` decides whether it fits;
those that fit are ranked by a step-time model whose assumptions are flags, printed with the
result:

    step     = max(gas * compute, communication) + offload   (collectives overlap compute,
               as meshzero's overlap_comm does; offload traffic and the host step do not)
    compute  = FLOPs of one micro-step / (gpu_flops * mfu); FLOPs counted on fake tensors
               (6 * params * tokens without a model)
    communication per step, over the ring bus bandwidth (inter-node when nodes > 1), with
               psi the padded parameter count and (N-1)/N the ring factor:
               stage 0  all-reduce 2 psi (gradient dtype)
               stage 1  reduce-scatter psi (gradients) + all-gather psi (compute dtype)
               stage 2  as stage 1, the reduce-scatter every micro-step
               stage 3  per micro-step all-gathers of 2 psi - psi_kept (the units kept
                        from forward into backward, zero/gather_plan.py) + 1
                        reduce-scatter psi
    offload  = PCIe copies of the gradient and parameter shards, the host optimizer step
               (cpu_adam_rate per node) and NVMe reads and writes (nvme_bw per node)
    ZeRO++ (zero_quantized_weights / _gradients, zero_hpz_partition_size): bytes are
               counted op by op, inside a node over intra_node_bw and across over
               inter_node_bw (estimate/timing.py communication_split; docs/compression.md)
    1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb; stage 0): the steps after the
               warm-up, packed signs and scales in place of the all-reduce
               (estimate/timing.py one_bit_bytes)

Tensor/pipeline parallelism (tp, pp from the config or --tp/--pp) is kept as given, or with
--search-mesh every tp inside a node and every pp is tried (estimate/mesh_search.py): ZeRO
works over dp = world / (tp * pp) (psi is the largest pp rank's local count, the bandwidth
inter-node when tp * dp exceeds a node); pp adds a bubble of pp - 1 micro-steps to compute
(gpipe / 1f1b) and stages 0-2 only; tp adds 4 activation all-reduces per layer per
micro-batch, not overlapped; pp sends each micro-batch's activation and its gradient
(estimate/timing.py). With pp give a global batch: the micro-batches are its accumulation.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from meshzero.checkpoint.model_files import parse_size
from meshzero.config import Config, ConfigError, load_config
from meshzero.config.optimizer import ONE_BIT_OPTIMIZERS
from meshzero.estimate.core import Estimate, Estimator
from meshzero.estimate.mesh_search import mesh_settings
from meshzero.estimate.model import InputsFn, load_model
from meshzero.estimate.report import fmt_bytes
from meshzero.estimate.settings import Cluster, Settings, settings_from_config
from meshzero.estimate.timing import (
    communication_bytes,  # noqa: F401  (re-exported: tests and callers import it here)
    communication_split,
    model_parallel_seconds,
    num_layers,
    offload_seconds,
)
from meshzero.profiling.report import seconds, si

# (offload_optimizer, offload_param) per stage; parameters move only at stage 3, and NVMe
# parameters need the NVMe optimizer (the NVMe step writes the parameter files)
OFFLOADS = {
    0: [("none", "none")],
    1: [("none", "none"), ("cpu", "none"), ("nvme", "none")],
    2: [("none", "none"), ("cpu", "none"), ("nvme", "none")],
    3: [("none", "none"), ("cpu", "none"), ("nvme", "none"), ("none", "cpu"), ("cpu", "cpu"),
        ("nvme", "cpu"), ("nvme", "nvme")],
}
MAX_MICRO_BATCH_LOG2 = 20


@dataclass(frozen=True)
class Assumptions:
    """The hardware the step-time model assumes (defaults: an A100-80GB HDR cluster)."""

    gpu_flops: float = 312e12  # peak FLOP/s per GPU (A100 bf16 dense)
    mfu: float = 0.5  # fraction of the peak that compute reaches
    intra_node_bw: float = 150e9  # ring bus bandwidth per GPU inside a node, bytes/s
    inter_node_bw: float = 25e9  # ring bus bandwidth per GPU across nodes, bytes/s
    pcie_bw: float = 25e9  # device <-> host per GPU, bytes/s
    nvme_bw: float = 3e9  # NVMe read (and write) per node, bytes/s
    cpu_adam_rate: float = 2e9  # optimizer elements per second on the host, per node

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"plan assumption {f.name} must be positive, got {value!r}")

    def lines(self) -> list[str]:
        return [
            f"  compute     --gpu-flops {si(self.gpu_flops)}FLOP/s x --mfu {self.mfu:g}",
            f"  collectives --intra-node-bw {fmt_bytes(self.intra_node_bw)}/s, --inter-node-bw "
            f"{fmt_bytes(self.inter_node_bw)}/s per GPU (ring bus bandwidth), overlapping compute",
            f"  offload     --pcie-bw {fmt_bytes(self.pcie_bw)}/s per GPU, --nvme-bw "
            f"{fmt_bytes(self.nvme_bw)}/s per node, --cpu-adam-rate {self.cpu_adam_rate:.3g} "
            "elements/s per node; not overlapped",
        ]


@dataclass
class Candidate:
    """One configuration that fits, with its estimated times (seconds per optimizer step)."""

    estimate: Estimate
    compute_s: float
    comm_s: float
    offload_s: float
    tokens_per_step: int

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.comm_s) + self.offload_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else float("inf")

    def ds_config(self, base: dict[str, Any] | None = None,
                  nvme_path: str = "/local_nvme") -> dict[str, Any]:
        """A ds_config for this candidate: ``base`` with the batch and zero_optimization set."""
        s, c = self.estimate.settings, self.estimate.cluster
        cfg = copy.deepcopy(base) if base else {}
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                    "gradient_accumulation_steps"):
            cfg.pop(key, None)
        cfg["train_micro_batch_size_per_gpu"] = s.micro_batch
        cfg["gradient_accumulation_steps"] = s.grad_accum
        cfg["train_batch_size"] = s.micro_batch * s.grad_accum * s.dp_size(c.world_size)
        if s.tp > 1:
            cfg["tensor_parallel"] = {**cfg.get("tensor_parallel", {}), "size": s.tp,
                                      "plan": s.tp_plan}
        if s.pp > 1:
            cfg["pipeline_parallel"] = {**cfg.get("pipeline_parallel", {}), "size": s.pp,
                                        "schedule": s.pp_schedule,
                                        "micro_batches": s.grad_accum}
        if "optimizer" not in cfg:  # the estimate assumed AdamW (default hyperparameters)
            cfg["optimizer"] = {"type": "AdamW", "params": {}}
        if s.precision != "fp32":
            cfg[s.precision] = {**cfg.get(s.precision, {}), "enabled": True}
        zero = dict(cfg.get("zero_optimization", {}))
        zero["stage"] = s.stage
        for key, device in (("offload_optimizer", s.offload_optimizer),
                            ("offload_param", s.offload_param)):
            zero.pop(key, None)
            if device != "none":
                zero[key] = {"device": device, **({"nvme_path": nvme_path}
                                                  if device == "nvme" else {})}
        cfg["zero_optimization"] = zero
        return cfg

    def row(self, index: int) -> list[str]:
        e, s = self.estimate, self.estimate.settings
        return [str(index), str(s.tp), str(s.pp), str(s.stage), s.offload_optimizer,
                s.offload_param,
                str(s.micro_batch), str(s.grad_accum),
                "on" if s.activation_checkpointing else "off", fmt_bytes(e.gpu_bytes),
                fmt_bytes(e.host_bytes_per_node),
                *(seconds(t) if t else "0" for t in (self.step_s, self.compute_s, self.comm_s,
                                                     self.offload_s)),
                si(self.tokens_per_s)]


HEADER = ["#", "tp", "pp", "stage", "off.opt", "off.param", "micro", "gas", "ckpt", "GPU mem",
          "host/node", "step", "compute", "comm", "offload", "tokens/s"]


@dataclass
class Plan:
    model: str
    num_params: int
    cluster: Cluster
    assumptions: Assumptions
    global_batch: int | None
    candidates: list[Candidate]  # fastest first
    considered: int
    notes: list[str] = field(default_factory=list)
    searched_mesh: bool = False

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def table(self, top: int | None = 10) -> str:
        shown = self.candidates if not top else self.candidates[:top]
        rows = [HEADER] + [c.row(i + 1) for i, c in enumerate(shown)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
        return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True))
                         for r in rows)

    def format(self, top: int | None = 10) -> str:
        c = self.cluster
        batch = (f"global batch {self.global_batch}" if self.global_batch
                 else "no global batch given: gradient accumulation 1")
        lines = [
            f"meshzero plan: {self.model} ({si(self.num_params)} parameters) on {c.nodes} "
            f"node(s) x {c.gpus_per_node} GPUs, {fmt_bytes(c.gpu_memory)} per GPU, "
            f"{fmt_bytes(c.host_memory)} host memory per node; {batch}",
            "assumptions (flags):", *self.assumptions.lines(),
            "step = max(gas x compute, communication) + offload; ranked by tokens/s",
            "",
            self.table(top),
            "",
            f"{len(self.candidates)} of {self.considered} configurations fit (every "
            + ("tp x pp mesh the notes name, " if self.searched_mesh else "")
            + "stage and offload choice; micro batches "
            + ("dividing the global batch" if self.global_batch else "1, 2, 4, ...")
            + " up to the largest whose activations fit)"
            + (f"; the first {top} shown (--top 0 shows all)"
               if top and len(self.candidates) > top else ""),
        ]
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


class NothingFitsError(ValueError):
    """No configuration fits the cluster; the message names the closest and what to change."""


class Planner:
    def __init__(self, estimator: Estimator, base: Settings, cluster: Cluster,
                 assumptions: Assumptions, global_batch: int | None):
        self.estimator = estimator
        self.base = base
        self.cluster = cluster
        self.assumptions = assumptions
        self.global_batch = global_batch

    def micro_batches(self, checkpointing: bool, room: int) -> list[int]:
        """Powers of two (or, with a global batch, the divisors of its share per rank) whose
        activations fit in ``room`` bytes, measured in increasing order."""
        n = self.base.dp_size(self.cluster.world_size)
        if self.global_batch is not None:
            if self.global_batch % n:
                raise ValueError(f"global batch {self.global_batch} is not divisible by the "
                                 f"{n} data-parallel ranks")
            per_rank = self.global_batch // n
            options = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        else:
            options = [1 << k for k in range(MAX_MICRO_BATCH_LOG2 + 1)]
        if not self.estimator.spec.runnable and self.estimator.activations_per_sample is None:
            return [b for b in options if b == self.base.micro_batch] or options[:1]
        settings = self.base.replace(activation_checkpointing=checkpointing)
        out = []
        for b in options:
            if (self.estimator.activation_bytes(settings, b) or 0) > room:
                break
            out.append(b)
        return out

    def run(self, checkpointing_options: tuple[bool, ...]) -> Plan:
        considered, fits, smallest = 0, [], None
        rooms = {}
        for ckpt in checkpointing_options:
            for stage, offloads in OFFLOADS.items():
                if stage == 3 and self.base.pp > 1:  # the engine's pipeline takes stages 0-2
                    continue
                for opt, par in offloads:
                    try:
                        settings = self.base.replace(
                            stage=stage, offload_optimizer=opt, offload_param=par,
                            micro_batch=1, grad_accum=1, activation_checkpointing=ckpt)
                    except ConfigError:  # a combination initialize refuses is no candidate
                        continue
                    first = self.estimator.estimate(settings, self.cluster,
                                                    search_micro_batch=False)
                    if smallest is None or _pressure(first) < _pressure(smallest):
                        smallest = first
                    rooms[(ckpt, stage, opt, par)] = (first, self.cluster.gpu_memory - (
                        first.gpu_bytes - (first.activations or 0)))
        # every configuration shares the activation runs: measure up to the largest room
        batches = {ckpt: self.micro_batches(ckpt, max(r for (k, *_), (_, r) in rooms.items()
                                                      if k == ckpt))
                   for ckpt in checkpointing_options}
        for (ckpt, *_), (first, _) in rooms.items():
            for b in batches[ckpt] or [1]:
                considered += 1
                gas = (self.global_batch // (b * self.base.dp_size(self.cluster.world_size))
                       if self.global_batch else 1)
                est = self.estimator.estimate(
                    first.settings.replace(micro_batch=b, grad_accum=gas),
                    self.cluster, search_micro_batch=False)
                if est.fits:
                    fits.append(self.timed(est))
        if not fits:
            raise NothingFitsError(_nothing_fits(smallest, self.cluster))
        fits.sort(key=_rank)
        spec = self.estimator.spec
        plan = Plan(spec.name, spec.num_params, self.cluster, self.assumptions,
                    self.global_batch, fits, considered)
        if not spec.runnable and self.estimator.activations_per_sample is None:
            plan.notes.append("activations are not counted (no model to run): give "
                              "--activation-memory per sample")
        return plan

    def timed(self, est: Estimate) -> Candidate:
        s, c, a = est.settings, est.cluster, self.assumptions
        tokens = s.micro_batch * (s.seq_len or 1)
        flops = est.flops_per_micro_batch
        if flops is None:
            flops = (8 if s.activation_checkpointing else 6) * est.num_params * tokens
        bubble = s.pp - 1 if s.pp > 1 else 0  # gpipe / 1f1b: pp - 1 idle micro-slots
        compute = (s.grad_accum + bubble) * flops / (a.gpu_flops * a.mfu)
        states = self.estimator.states(s, c.world_size)
        dp = states.world_size
        # bytes inside and across nodes (ZeRO++ qwZ / qgZ / hpZ: fewer across)
        inside, across = communication_split(states.layout, s, max(1, c.gpus_per_node // s.tp))
        comm = inside / a.intra_node_bw + across / a.inter_node_bw
        if s.model_parallel > 1:
            model = self.estimator.spec.model
            tp_s, pp_s = model_parallel_seconds(s, c, a, model, num_layers(model))
            compute += tp_s  # tp all-reduces sit between the matmuls: not overlapped
            comm += pp_s
        offload = offload_seconds(states.layout, s, c, a)
        return Candidate(est, compute, comm, offload, tokens * s.grad_accum * dp)


OFFLOAD_ORDER = {"none": 0, "cpu": 1, "nvme": 2}


def _rank(c: Candidate) -> tuple:
    """The ranking, a total order (no two configurations tie, whatever order they were tried
    in): most tokens/s first, equal to 6 significant digits counting as a tie (the step-time
    model is not more exact than that); then less GPU memory; less host memory per node; then
    fewer moving parts: less offload (none < cpu < nvme, the optimizer's, then the
    parameters'), a lower ZeRO stage, no activation checkpointing, smaller tp, smaller pp,
    and last a larger micro batch (fewer accumulation steps)."""
    e, s = c.estimate, c.estimate.settings
    return (-float(f"{c.tokens_per_s:.6g}"), e.gpu_bytes, e.host_bytes_per_node,
            OFFLOAD_ORDER[s.offload_optimizer], OFFLOAD_ORDER[s.offload_param], s.stage,
            s.activation_checkpointing, s.tp, s.pp, -s.micro_batch)


def _pressure(e: Estimate) -> float:
    """How far over its limits a configuration is: the larger of GPU and host use ratios."""
    return max(e.gpu_bytes / e.cluster.gpu_memory, e.host_bytes_per_node / e.cluster.host_memory)


def _nothing_fits(smallest: Estimate | None, cluster: Cluster) -> str:
    assert smallest is not None
    s = smallest.settings
    return (f"no configuration fits {smallest.model} ({si(smallest.num_params)} parameters) on "
            f"{cluster.nodes} node(s) x {cluster.gpus_per_node} GPUs: the closest needs "
            f"{fmt_bytes(smallest.gpu_bytes)} per GPU (of {fmt_bytes(cluster.gpu_memory)}) and "
            f"{fmt_bytes(smallest.host_bytes_per_node)} host memory per node (of "
            f"{fmt_bytes(cluster.host_memory)}), with stage {s.stage}, offload optimizer "
            f"{s.offload_optimizer} / params {s.offload_param}, micro batch 1; add GPUs, nodes "
            "or host memory, or use bf16, activation checkpointing, a shorter sequence or a "
            "smaller sub_group_size (NVMe tiles)")


def plan(
    model: str | nn.Module | Callable[[], nn.Module] | None = None,
    *,
    params: int | str | None = None,
    largest_unit: int | str | None = None,
    cluster: Cluster | None = None,
    config: Config | dict[str, Any] | str | os.PathLike[str] | None = None,
    inputs: InputsFn | str | None = None,
    activations_per_sample: int | str | None = None,
    global_batch: int | None = None,
    assumptions: Assumptions | None = None,
    try_activation_checkpointing: bool = False,
    search_mesh: bool = False,
    pipeline_layout: Any = None,
    **settings: Any,
) -> Plan:
    """Every stage / offload / micro batch that fits ``cluster``, fastest first.

    ``config`` and ``settings`` fix what is not searched (precision, seq_len, buckets...);
    ``try_activation_checkpointing`` also tries every configuration with it; ``search_mesh``
    also tries every tensor/pipeline-parallel size (estimate/mesh_search.py) instead of the
    configured one; ``pipeline_layout`` is what ``initialize(pipeline_layout=...)`` would get.
    """
    cluster = cluster if cluster is not None else Cluster()
    spec = load_model(model, params=params, largest_unit=largest_unit, inputs=inputs)
    per_sample = (parse_size(activations_per_sample) if activations_per_sample is not None
                  else None)
    base = settings_from_config(config, cluster.world_size, **settings)
    if global_batch is None and config is not None:
        global_batch = load_config(config).train_batch_size
    return plan_with(Estimator(spec, per_sample, pipeline_layout), base, cluster,
                     assumptions or Assumptions(), global_batch, try_activation_checkpointing,
                     search_mesh)


def _setting_notes(base: Settings) -> list[str]:
    notes = []
    if base.trainable == "all":
        notes.append("every parameter trainable (frozen ones unfrozen after initialize): each "
                     "configuration holds gradients, masters and optimizer states for all of "
                     "them (--trainable all)")
    optimizer = base.config.optimizer
    if optimizer is not None and optimizer.type in ONE_BIT_OPTIMIZERS:
        notes.append(f"{optimizer.type}: communication is that of a step after the warm-up "
                     "(packed signs and scales, ZeRO stage 0 only); the warm-up's steps "
                     "all-reduce the gradients as stage 0 does")
    return notes


def plan_with(estimator: Estimator, base: Settings, cluster: Cluster, assumptions: Assumptions,
          global_batch: int | None, try_checkpointing: bool, search_mesh: bool = False) -> Plan:
    if base.forward_only:
        raise ValueError("trainable 'none': a plan ranks training configurations; size an "
                         "engine without an optimizer with meshzero estimate --trainable none")
    if base.seq_len is None:
        seq = estimator.spec.default_seq_len
        if seq is None and not estimator.spec.runnable:
            raise ValueError("a plan needs the tokens per sample for its FLOPs: give --seq-len")
        base = base.replace(seq_len=seq)
    options = (False, True) if try_checkpointing else (base.activation_checkpointing,)
    if not search_mesh:
        result = Planner(estimator, base, cluster, assumptions, global_batch).run(options)
        result.notes.extend(_setting_notes(base))
        return result
    meshes, notes = mesh_settings(estimator.spec, base, cluster, estimator.pipeline_layout)
    notes = [*notes, *_setting_notes(base)]
    plans, failures = [], []
    for mesh in meshes:
        try:
            plans.append(Planner(estimator, mesh, cluster, assumptions, global_batch).run(options))
        except ValueError as exc:  # this mesh cannot run the model, or nothing fits on it
            failures.append((mesh, exc))
    if not plans:  # say that nothing fits if some mesh could run the model
        raise next((exc for _, exc in failures if isinstance(exc, NothingFitsError)),
                   failures[0][1])
    result = plans[0]
    result.candidates = sorted((c for p in plans for c in p.candidates), key=_rank)
    result.considered = sum(p.considered for p in plans)
    result.searched_mesh = True
    result.notes = list(dict.fromkeys([
        f"meshes tried (tp x pp): {', '.join(f'{m.tp}x{m.pp}' for m in meshes)}", *notes,
        *(f"tp {m.tp} x pp {m.pp}: {str(exc).splitlines()[0]}" for m, exc in failures),
        *(n for p in plans for n in p.notes)]))
    return result
