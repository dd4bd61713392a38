"""The engine's checkpoint and weight-file methods (a mixin of :class:`meshzero.Engine`): each
enters the phase check, brings every state into memory, and hands the checkpoint package a
:class:`TrainingState`, never the engine."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch

from meshzero.checkpoint.sharded import frozen_names, load_checkpoint, save_checkpoint
from meshzero.checkpoint.training import TrainingState
from meshzero.checkpoint.weights import consolidated_state_dict, load_weights, save_16bit_model

if TYPE_CHECKING:
    from meshzero.config import Config
    from meshzero.zero.state import ZeroModelState

logger = logging.getLogger(__name__)


class CheckpointMethods:
    """``save_checkpoint``, ``load_checkpoint``, ``save_16bit_model``,
    ``consolidated_16bit_state_dict`` and ``load_weights`` over ``training_state()``."""

    zero: ZeroModelState
    config: Config

    def training_state(self) -> TrainingState:
        raise NotImplementedError  # the engine's

    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None,
                        client_state: Any = None, *, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> str:
        """Sharded checkpoint ``save_dir/tag`` (default ``global_step{N}``); collective.
        ``client_state`` (rank 0's) may hold tensors, numpy arrays, argparse Namespaces and
        plain values, saved without pickle (docs/checkpoints.md). ``save_latest=False``
        leaves ``latest`` as it is; ``exclude_frozen_parameters`` leaves the frozen
        parameters out (a load keeps the model's own). Returns the tag's directory."""
        with self.zero.phases.entry("save_checkpoint"), self.zero.materialized():
            return save_checkpoint(
                self.training_state(), save_dir, tag, client_state, save_latest=save_latest,
                exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, *,
                        load_module_strict: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, Any]:
        """Load a tag (default: ``latest``) saved at any data-parallel size and stage, with
        the same tensor and pipeline parallel sizes; collective. ``load_module_strict=False``
        allows missing (kept as they are) and unexpected (ignored) names;
        ``load_module_only`` loads the weights and buffers only (no optimizer, scheduler,
        counters or RNG). Returns ``(path, client_state)``, or ``(None, None)`` if there is
        no ``latest``."""
        with self.zero.phases.entry("load_checkpoint"), self.zero.materialized(True):
            return load_checkpoint(
                self.training_state(), load_dir, tag, load_optimizer_states,
                load_lr_scheduler_states, strict=load_module_strict,
                module_only=load_module_only)

    def save_16bit_model(self, save_dir: str | os.PathLike,
                         save_filename: str = "model.safetensors", *,
                         exclude_frozen_parameters: bool = False) -> str | None:
        """The full model in the compute dtype as safetensors; collective (one file per
        pipeline stage, with an index, when pp > 1); ``exclude_frozen_parameters`` leaves
        the frozen parameters out. At stage 3 with
        ``stage3_gather_16bit_weights_on_model_save`` false it saves nothing and returns None,
        as DeepSpeed does."""
        if self.config.zero_optimization.stage == 3 and \
                self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save is False:
            logger.warning("save_16bit_model saved nothing: zero_optimization."
                           "stage3_gather_16bit_weights_on_model_save is false; save a "
                           "checkpoint, or set it true")
            return None
        state = self.training_state()
        skip = frozen_names(state) if exclude_frozen_parameters else frozenset()
        with self.zero.phases.entry("save_16bit_model"), self.zero.materialized():
            return save_16bit_model(state, save_dir, save_filename, skip=skip)

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                      ) -> dict[str, torch.Tensor]:
        """``{name: full CPU tensor in the compute dtype}`` of ``model.state_dict()`` on
        rank 0 (tied names share one tensor), ``{}`` on the other ranks; a collective at
        every stage; ``exclude_frozen_parameters`` leaves the frozen parameters out."""
        state = self.training_state()
        skip = frozen_names(state) if exclude_frozen_parameters else frozenset()
        # the phase check names it as the 16-bit model save it shares its gathers with
        with self.zero.phases.entry("save_16bit_model"), self.zero.materialized():
            return consolidated_state_dict(state, skip)

    def load_weights(self, path: str | os.PathLike) -> None:
        """Load safetensors weights (file, index or directory), each rank reading only its
        fragments; collective. Pickle files are refused."""
        with self.zero.phases.entry("load_weights"), self.zero.materialized(True):
            load_weights(self.training_state(), path)

