"""The seam between a training run and its checkpoints: what save and load read and write.

The engine hands the checkpoint functions a :class:`TrainingState` (references to its
module, ZeRO state, optimizer, scheduler, loss scaler, topology and step counters), never
itself, so this package knows nothing of the engine and the engine nothing of the format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshzero.comm import CommStats
from meshzero.precision import LossScaler
from meshzero.topology import Topology
from meshzero.zero.state import ZeroModelState


@dataclass
class StepCounters:
    """How far training is; saved in the manifest and restored by a load."""

    global_steps: int = 0  # optimizer steps taken (skipped ones included)
    micro_steps: int = 0  # forward/backward passes
    skipped_steps: int = 0  # steps skipped: inf/nan gradients (an fp16 overflow included)


@dataclass
class TrainingState:
    """What a checkpoint holds, as live objects (a load writes into them in place)."""

    module: nn.Module  # this rank's piece of the model (its stages, tp slices)
    zero: ZeroModelState
    optimizer: torch.optim.Optimizer | None  # None: an engine without one (forward only)
    lr_scheduler: Any  # a torch LR scheduler or None
    loss_scaler: LossScaler
    topology: Topology
    counters: StepCounters
    stats: CommStats  # the agreement all-reduces of save and load are counted here
    pipeline: Any = None  # parallel.pipeline.Pipeline of this rank, or None
    writes_state: bool = True  # False on MiCS blocks after the first (same shards)

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.zero.options.compute_dtype

    @property
    def zero_stage(self) -> int:
        return self.zero.options.stage
