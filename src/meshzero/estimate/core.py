"""``estimate()``: the memory of one training configuration on one cluster, per GPU and per
node, with a verdict and the largest micro batch that fits."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from meshzero.checkpoint.model_files import parse_size
from meshzero.config import Config
from meshzero.estimate.activations import ActivationProfile, profile_activations
from meshzero.estimate.mesh import (
    RankModule,
    fake_tp_group,
    mesh_note,
    pipeline_layout_of,
    profile_rank,
    rank_modules,
    stage_inputs,
)
from meshzero.estimate.model import InputsFn, ModelSpec, check_seq_len, load_model
from meshzero.estimate.settings import Cluster, Settings, settings_from_config
from meshzero.estimate.states import ModelStates, Report, total_bytes
from meshzero.zero.units import Layout, build_layout

MAX_MICRO_BATCH = 1 << 20


@dataclass
class Estimate:
    """Bytes per GPU (the rank holding the most) and per node; see ``str(estimate)``."""

    model: str
    num_params: int
    num_units: int
    largest_unit: int  # elements of the largest unit (all its groups)
    cluster: Cluster
    settings: Settings
    rank: int  # the rank the per-GPU figures are for
    model_states: Report  # what engine.memory_report() reports for that rank (with the
    # NVMe tile buffers under offload_buffers; without gathered_params_peak)
    gathered: int  # stage 3: full unit buffers alive at once (in use + prefetch)
    reduce_buckets: int
    allgather_buckets: int
    param_read_buffers: int  # host: parameter shards read ahead from NVMe (transient)
    activations: int | None  # None: not counted (no model to run)
    flops_per_micro_batch: int | None  # forward + backward (+ recompute) on one rank
    max_micro_batch: int | None = None  # None: unknown (activations not counted)
    notes: list[str] = field(default_factory=list)
    # the model states at rest once every parameter frozen at initialize is unfrozen (their
    # groups made trainable, zero/trainability.py), of the rank then holding the most; None
    # when nothing is frozen or the settings count every parameter trainable already
    unfrozen_states: Report | None = None

    @property
    def gpu_bytes(self) -> int:
        """Peak device bytes of one GPU: every term at its own peak (an upper bound)."""
        return (total_bytes(self.model_states, "device") + self.gathered + self.reduce_buckets
                + self.allgather_buckets + (self.activations or 0))

    @property
    def host_bytes_per_rank(self) -> int:
        return total_bytes(self.model_states, "host") + self.param_read_buffers

    @property
    def host_bytes_per_node(self) -> int:
        return self.host_bytes_per_rank * self.cluster.gpus_per_node

    @property
    def nvme_bytes_per_node(self) -> int:
        return total_bytes(self.model_states, "nvme") * self.cluster.gpus_per_node

    @property
    def fits(self) -> bool:
        return (self.gpu_bytes <= self.cluster.gpu_memory
                and self.host_bytes_per_node <= self.cluster.host_memory)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["settings"] = self.settings.to_dict()
        out.update(gpu_bytes=self.gpu_bytes, host_bytes_per_node=self.host_bytes_per_node,
                   nvme_bytes_per_node=self.nvme_bytes_per_node, fits=self.fits,
                   world_size=self.cluster.world_size)
        return out

    def __str__(self) -> str:
        from meshzero.estimate.report import format_estimate

        return format_estimate(self)


class Estimator:
    """One model: layouts and activation profiles are cached, so many settings and clusters
    (the planner's search) cost little more than one. ``pipeline_layout``: what
    ``initialize(pipeline_layout=...)`` gets (default: the config's, see estimate/mesh.py)."""

    def __init__(self, spec: ModelSpec, activations_per_sample: int | None = None,
                 pipeline_layout: Any = None):
        self.spec = spec
        self.activations_per_sample = activations_per_sample
        self.pipeline_layout = pipeline_layout
        self._profiles: dict[tuple, list[ActivationProfile]] = {}
        self._mesh_layouts: dict[tuple, list[Layout]] = {}

    @staticmethod
    def _mesh_key(s: Settings) -> tuple:
        return (s.tp, repr(s.tp_plan), s.sequence_parallel, s.pp, s.pp_schedule, s.pp_layers,
                s.pp_first, s.pp_last, s.pp_stages_per_rank, s.pp_boundaries, s.sp)

    def _mesh(self, s: Settings, group: Any) -> list[RankModule]:
        if s.pp > 1 and not self.spec.runnable:
            raise ValueError("a pipeline estimate needs a model to cut into stages, not a bare "
                             "parameter count")
        return rank_modules(self.spec, s, pipeline_layout_of(self.spec, s, self.pipeline_layout),
                            group)

    def rank_states(self, settings: Settings, world_size: int) -> list[ModelStates]:
        """Model states of every pp rank (tp rank 0), each over its dp x sp ZeRO ranks (dp =
        world / (tp * pp * sp)); one entry without a pipeline."""
        dp = settings.zero_size(world_size)
        if settings.model_parallel == 1:
            return [ModelStates(self.spec.layout(
                dp, stage=settings.stage, persistence_threshold=settings.persistence_threshold,
                unit_classes=settings.unit_classes), settings)]
        persistence = settings.persistence_threshold if settings.stage == 3 else None
        key = (self._mesh_key(settings), dp, persistence, settings.unit_classes)
        if key not in self._mesh_layouts:
            classes = list(settings.unit_classes) if settings.unit_classes is not None else None
            with fake_tp_group(settings.tp) as group:
                self._mesh_layouts[key] = [
                    build_layout(r.module, num_shards=dp, unit_classes=classes,
                                 persistence_threshold=persistence)
                    for r in self._mesh(settings, group)]
        return [ModelStates(layout, settings) for layout in self._mesh_layouts[key]]

    def largest(self, settings: Settings, world_size: int) -> tuple[int, ModelStates]:
        """(pp rank, its model states) of the pp rank whose busiest dp rank holds the most."""
        per_rank = self.rank_states(settings, world_size)
        totals = [total_bytes(st.largest_rank()[1]) for st in per_rank]
        pp_rank = totals.index(max(totals))
        return pp_rank, per_rank[pp_rank]

    def states(self, settings: Settings, world_size: int) -> ModelStates:
        """The model states of the pp rank holding the most (the only one without pp)."""
        return self.largest(settings, world_size)[1]

    def unfrozen_states(self, settings: Settings, world_size: int) -> Report | None:
        """The model states at rest of the rank holding the most once every parameter
        frozen at initialize is unfrozen; None if none is frozen (or all count already)."""
        if settings.trainable in ("all", "none") or all(
                g.requires_grad for st in self.rank_states(settings, world_size)
                for g in st.layout.groups()):
            return None
        return self.states(settings.replace(trainable="all"), world_size).largest_rank()[1]

    def rank_profiles(self, settings: Settings, micro_batch: int
                      ) -> list[ActivationProfile] | None:
        """Activations and FLOPs of one micro-step on every pp rank (None without a model)."""
        if not self.spec.runnable:
            return None
        s = settings
        key = (micro_batch, s.seq_len, s.precision, s.activation_checkpointing, s.unit_classes,
               self._mesh_key(s))
        if key in self._profiles:
            return self._profiles[key]
        classes = list(s.unit_classes) if s.unit_classes is not None else None
        if s.model_parallel == 1:
            paths = [u.path for u in self.rank_states(s, s.sp)[0].layout.units]  # any world
            out = [profile_activations(self.spec, micro_batch=micro_batch, seq_len=s.seq_len,
                                       precision=s.precision,
                                       checkpointing=s.activation_checkpointing,
                                       unit_paths=paths, sp=s.sp)]
        else:
            with fake_tp_group(s.tp) as group:
                ranks = self._mesh(s, group)
                if s.pp > 1:
                    layout = pipeline_layout_of(self.spec, s, self.pipeline_layout)
                    args, outputs = stage_inputs(self.spec, s, layout, micro_batch, s.seq_len)
                out = []
                for r in ranks:
                    paths = [u.path for u in build_layout(r.module, num_shards=1,
                                                          unit_classes=classes).units]
                    if s.pp > 1:
                        out.append(profile_rank(self.spec, r, s, micro_batch=micro_batch,
                                                seq_len=s.seq_len, args=args, outputs=outputs,
                                                unit_paths=paths))
                        continue
                    local = dataclasses.replace(self.spec, model=r.module,
                                                input_model=self.spec.model, _layouts={})
                    out.append(profile_activations(
                        local, micro_batch=micro_batch, seq_len=s.seq_len,
                        precision=s.precision, checkpointing=s.activation_checkpointing,
                        unit_paths=paths))
        self._profiles[key] = out
        return out

    def profile(self, settings: Settings, micro_batch: int, pp_rank: int = 0
                ) -> ActivationProfile | None:
        """One micro-step: the largest activations and FLOPs over the pp ranks, with the unit
        order of ``pp_rank`` (None without a model to run)."""
        profiles = self.rank_profiles(settings, micro_batch)
        if profiles is None:
            return None
        if len(profiles) == 1:
            return profiles[0]
        return dataclasses.replace(
            profiles[pp_rank], peak_bytes=max(p.peak_bytes for p in profiles),
            flops=max(p.flops for p in profiles), seconds=sum(p.seconds for p in profiles))

    def activation_bytes(self, settings: Settings, micro_batch: int) -> int | None:
        profile = self.profile(settings, micro_batch)
        if profile is not None:
            return profile.peak_bytes
        if self.activations_per_sample is not None:
            return self.activations_per_sample * micro_batch
        return None

    def estimate(self, settings: Settings, cluster: Cluster, *,
                 search_micro_batch: bool = True) -> Estimate:
        if settings.seq_len is None and self.spec.default_seq_len is not None:
            settings = settings.replace(seq_len=self.spec.default_seq_len)
        seq_note = check_seq_len(self.spec, settings.seq_len)
        pp_rank, states = self.largest(settings, cluster.world_size)
        dp_rank, report = states.largest_rank()
        dp = states.world_size
        rank = pp_rank * dp * settings.tp + dp_rank * settings.tp  # tp innermost, pp outermost
        profile = self.profile(settings, settings.micro_batch, pp_rank)
        reduce, allgather = states.bucket_bytes()
        layout = states.layout
        est = Estimate(
            model=self.spec.name, num_params=self.spec.num_params, num_units=len(layout.units),
            largest_unit=max(u.numel for u in layout.units), cluster=cluster,
            settings=settings, rank=rank, model_states=report,
            gathered=states.gathered_bytes(list(profile.forward_order) if profile else None),
            reduce_buckets=reduce, allgather_buckets=allgather,
            param_read_buffers=states.param_read_bytes(),
            activations=self.activation_bytes(settings, settings.micro_batch),
            flops_per_micro_batch=profile.flops if profile else None)
        est.unfrozen_states = self.unfrozen_states(settings, cluster.world_size)
        if seq_note:
            est.notes.append(seq_note)
        if settings.model_parallel > 1:
            est.notes.append(mesh_note(settings, dp, pp_rank, dp_rank))
        if profile is not None and profile.depth:
            est.notes.append(f"activations and FLOPs: {profile.depth}")
        if est.activations is None:
            est.notes.append("activations are not counted: give a model to run, or "
                             "activations_per_sample")
        elif search_micro_batch:
            est.max_micro_batch = self.max_micro_batch(est)
        return est

    def max_micro_batch(self, est: Estimate) -> int:
        """The largest micro batch whose activations fit beside everything else (0: none)."""
        if est.host_bytes_per_node > est.cluster.host_memory:
            return 0
        room = est.cluster.gpu_memory - (est.gpu_bytes - (est.activations or 0))
        settings = est.settings

        def fits(batch: int) -> bool:
            return (self.activation_bytes(settings, batch) or 0) <= room

        if not fits(1):
            return 0
        # Activations grow about linearly with the batch (plus a constant): predict from the
        # line through b = 1 and the last guess (secant steps), then search around it.
        a1 = self.activation_bytes(settings, 1) or 0
        x, y = 2, self.activation_bytes(settings, 2) or 0
        guess = 1
        for _ in range(3):
            slope = max(1e-9, (y - a1) / (x - 1))
            guess = int(min(MAX_MICRO_BATCH, max(1, 1 + (room - a1) // slope)))
            if guess in (1, x):
                break
            x, y = guess, self.activation_bytes(settings, guess) or 0
        step = 1
        if fits(guess):
            lo, hi = guess, guess + 1
            while hi <= MAX_MICRO_BATCH and fits(hi):
                lo, hi, step = hi, hi + 2 * step, 2 * step
            return lo if hi > MAX_MICRO_BATCH else self._bisect(fits, lo, hi)
        lo, hi = max(1, guess - 1), guess
        while not fits(lo):
            lo, hi, step = max(1, lo - 2 * step), lo, 2 * step
        return self._bisect(fits, lo, hi)

    @staticmethod
    def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
        """Largest b in [lo, hi) with fits(b), given fits(lo) and not fits(hi)."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo


def estimate(
    model: str | nn.Module | Callable[[], nn.Module] | None = None,
    *,
    params: int | str | None = None,
    largest_unit: int | str | None = None,
    cluster: Cluster | None = None,
    config: Config | dict[str, Any] | str | os.PathLike[str] | None = None,
    inputs: InputsFn | str | None = None,
    activations_per_sample: int | str | None = None,
    pipeline_layout: Any = None,
    **settings: Any,
) -> Estimate:
    """Memory per GPU and per node of training ``model`` on ``cluster``.

    ``model``: ``"pkg.mod:factory"``, a Hugging Face ``config.json`` path, an ``nn.Module``
    or a zero-argument callable (built on the meta device); or ``params``/``largest_unit``.
    ``config``: a ds_config (dict, path or Config); keyword ``settings`` (stage, precision,
    offload_optimizer, offload_param, micro_batch, seq_len, activation_checkpointing, and any
    other :class:`Settings` field) override it. ``inputs(micro_batch, seq_len)`` builds the
    forward arguments when they cannot be guessed. Tensor/pipeline parallelism: the config's
    ``tensor_parallel`` / ``pipeline_parallel`` blocks or the settings ``tp``, ``tp_plan``,
    ``pp``, ``pp_schedule``, ``pp_micro_batches``...; ``pipeline_layout`` as ``initialize``.
    """
    cluster = cluster if cluster is not None else Cluster()
    spec = load_model(model, params=params, largest_unit=largest_unit, inputs=inputs)
    per_sample = (parse_size(activations_per_sample) if activations_per_sample is not None
                  else None)
    resolved = settings_from_config(config, cluster.world_size, **settings)
    return Estimator(spec, per_sample, pipeline_layout).estimate(resolved, cluster)
