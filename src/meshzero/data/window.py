"""The engine's accumulation window: which backward reduces and which step applies.

A mixin of :class:`meshzero.Engine` (it reads the engine's ``config``, ``topology``,
``pipeline`` and step counters, and owns ``batch``): the boundary of the window (counted, or
forced by the caller), ``no_sync`` (stages 0-1: backwards that only accumulate), a new
train_batch_size (the micro batch stays, the accumulation steps change), the ``"auto"`` micro
batch taken from the first batch, and the loader of ``initialize(training_data=...)``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

from meshzero.config.schema import Config
from meshzero.data.batch import BatchSizes, leading_dim
from meshzero.data.loader import DistributedLoader, loader_batch_size, training_loader
from meshzero.log import warn_once
from meshzero.topology import Topology

logger = logging.getLogger(__name__)


class AccumulationWindow:
    """Engine methods over ``self.batch`` (a :class:`BatchSizes`)."""

    batch: BatchSizes
    micro_steps: int
    pipeline: Any
    config: Config
    topology: Topology
    device: torch.device
    # micro_steps when the window counting started (moved by set_train_batch_size), the
    # caller's forced boundary (None: counted), whether inside no_sync()
    _window_base: int = 0
    _boundary_override: bool | None = None
    _in_no_sync: bool = False

    def init_batch(self, batch: tuple[int | None, int | None, int], dp_size: int) -> None:
        """At construction: the batch numbers build resolved (the first two None while an
        "auto" micro batch is pending); engine.config then holds them."""
        self.batch = BatchSizes(*batch, dp_size=dp_size)
        if not self.batch.pending:
            self.config = self.config.with_batch(*cast(tuple[int, int, int], batch))
        self.training_dataloader: Any = None  # initialize(training_data=...)'s loader
        self._data_iterator: Iterator | None = None  # train_batch() without data_iter

    def train_batch_size(self) -> int:
        return self.batch.global_batch

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro

    def gradient_accumulation_steps(self) -> int:
        return self.batch.accumulation

    @property
    def grad_accum(self) -> int:
        return self.batch.accumulation

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next backward reduces and the next step applies: the caller's
        :meth:`set_gradient_accumulation_boundary` when given, else every
        ``gradient_accumulation_steps``-th micro-step."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps - self._window_base + 1) % self.batch.accumulation == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Force the boundary for the following backwards and steps (True: the next
        backward reduces and ``step()`` applies; False: they only accumulate); None counts
        micro-steps again. Stays until changed."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise ValueError(f"set_gradient_accumulation_boundary(is_boundary): a bool or None, "
                             f"got {is_boundary!r}")
        self._boundary_override = is_boundary

    def reduces_in_backward(self) -> bool:
        """The boundary as the next backward sees it: never inside ``no_sync()``."""
        return self.is_gradient_accumulation_boundary() and not self._in_no_sync

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """``with engine.no_sync():`` backwards accumulate gradients without stepping: at
        stages 0-1 on this rank, unreduced, and the first backward on the boundary outside
        reduces everything; at stages 2-3 each backward still reduce-scatters into the shards
        (the same gradients, no saving; one WARNING). Not re-entrant. ``step()`` inside
        only counts a micro-step off the boundary; on it, it is refused. (DeepSpeed's
        refuses stages 2-3, and its compatibility engine keeps that, while Accelerate's
        ``no_sync(model)`` calls this at any stage.)"""
        stage = self.config.zero_optimization.stage
        if stage >= 2:
            warn_once(logger, f"no_sync() at zero_optimization.stage {stage}: gradients are "
                      "still reduce-scattered every backward (the shards hold them); the "
                      "result is the same, without the communication saving")
        if self._in_no_sync:
            raise ValueError("no_sync() is already active: it is not re-entrant")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def check_step_allowed(self) -> None:
        """A step that would apply inside ``no_sync()`` is refused (its gradients are not
        reduced); off the boundary ``step()`` only counts the micro-step, as the Trainer
        (MeshzeroTrainer) calls it every micro-batch."""
        if self._in_no_sync and self.is_gradient_accumulation_boundary():
            raise ValueError("engine.step() on the accumulation boundary inside no_sync(): "
                             "leave the block first (its gradients are not reduced yet)")

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """A new global batch: the micro batch stays, ``gradient_accumulation_steps``
        becomes train_batch_size / (micro batch x data-parallel size). Between optimizer
        steps only."""
        if self.pipeline is not None:
            raise ValueError("set_train_batch_size() with pipeline_parallel.size > 1: the "
                             "pipeline schedule's micro-batches are fixed at initialize")
        if (self.micro_steps - self._window_base) % self.batch.accumulation:
            raise ValueError("set_train_batch_size() in the middle of an accumulation window; "
                             "call it after engine.step() applied")
        batch = self.batch.set_train_batch_size(train_batch_size)
        self._window_base = self.micro_steps
        self.config = self.config.with_batch(*batch)

    def take_micro_batch(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """The first forward with a pending ``"auto"`` micro batch: its leading dimension."""
        batch = self.batch.resolve(leading_dim(args, kwargs),
                                   "the leading dimension of the first batch engine(...) saw")
        self.config = self.config.with_batch(*batch)

    def data_loader(self, training_data: Any, collate_fn: Any = None, *,
                    batch_size: int | None = None, shuffle: bool | None = None,
                    sampler: Any = None) -> DistributedLoader:
        """A loader of ``training_data`` (a map-style Dataset, or a DataLoader whose
        dataset, collate_fn and shuffling are kept) for this rank: ``batch_size`` (default
        the micro batch) samples per batch, a DistributedSampler over the data-parallel
        ranks, seeded by ``seed`` (``shuffle`` default: shuffled, except with pipeline
        parallelism, as DeepSpeed), ``dataloader_drop_last``; or the caller's
        ``sampler``."""
        given = loader_batch_size(training_data)
        if batch_size is None and given is not None and given != self.batch.micro:
            raise ValueError(f"training_data is a DataLoader with batch_size {given}, but the "
                             f"micro batch is {self.batch.micro} (train_micro_batch_size_per_"
                             "gpu, or train_batch_size / accumulation / data-parallel size); "
                             "make them agree")
        return training_loader(
            training_data, micro_batch=batch_size or self.batch.micro,
            dp_rank=self.topology.dp_rank, dp_size=self.topology.dp_size,
            collate_fn=collate_fn, drop_last=self.config.dataloader_drop_last,
            shuffle=self.pipeline is None if shuffle is None else shuffle,
            seed=self.config.seed or 0, pin_memory=self.device.type == "cuda", sampler=sampler)
