"""DeepSpeed's ``deepspeed.checkpointing`` (its activation checkpointing,
deepspeed/runtime/activation_checkpointing/checkpointing.py) over ``torch.utils.checkpoint``.

``checkpoint`` gives the gradients a plain forward gives (torch recomputes the function in
backward). ``configure`` takes DeepSpeed's arguments: ``checkpoint_in_cpu`` is honoured
(the inputs ``checkpoint`` saves go to host memory, ``torch.autograd.graph.save_on_cpu``),
``synchronize`` is honoured (a device synchronize around each call), ``profile`` logs each
call's forward time; ``partition_activations`` and ``contiguous_checkpointing`` /
``num_checkpoints`` (how DeepSpeed lays the saved inputs out across tensor-parallel ranks
and in memory; results do not change) are not implemented and say so in one INFO line each.
Megatron's RNG tracker (``get_cuda_rng_tracker``, ``model_parallel_cuda_manual_seed``) keeps
named states of torch's RNG (CUDA's on a GPU, the CPU's otherwise).

DeepSpeed keeps these settings process-wide, and so does this map: one ``_SETTINGS`` and one
tracker, as DeepSpeed's module globals.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["CheckpointFunction", "CudaRNGStatesTracker", "checkpoint", "configure",
           "get_cuda_rng_tracker", "is_configured", "model_parallel_cuda_manual_seed",
           "model_parallel_reconfigure_tp_seed", "non_reentrant_checkpoint",
           "partition_activations_in_checkpoint", "reset", "set_num_layers"]

_MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's and Megatron's tracker name
_MODEL_PARALLEL_RNG_TRACKER_NAME = _MODEL_PARALLEL_RNG  # the name gpt-neox reads at import

# DeepSpeed's config keys of its "activation_checkpointing" section -> configure()'s names
_CONFIG_KEYS = {"partition_activations": "partition_activations",
                "contiguous_memory_optimization": "contiguous_checkpointing",
                "number_checkpoints": "num_checkpoints", "cpu_checkpointing": "checkpoint_in_cpu",
                "synchronize_checkpoint_boundary": "synchronize", "profile": "profile"}
_NOT_IMPLEMENTED = {
    "partition_activations": "activations are not split across tensor-parallel ranks (each "
                             "rank keeps its checkpointed inputs whole)",
    "contiguous_checkpointing": "checkpointed inputs are not copied into one buffer",
    "num_checkpoints": "no contiguous buffer to size",
}


@dataclass
class _Settings:
    configured: bool = False
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False
    mpu: Any = None


_SETTINGS = _Settings()


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _section(deepspeed_config: Any) -> dict[str, Any]:
    """The ``activation_checkpointing`` section of a ds_config dict, JSON path or config."""
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, (str, Path)):
        from meshzero.config.errors import read_json  # noqa: PLC0415 (a file given only)

        deepspeed_config = read_json(Path(deepspeed_config))
    raw = getattr(deepspeed_config, "_param_dict", deepspeed_config)
    if not isinstance(raw, dict):
        raise ValueError(f"configure(deepspeed_config=...): expected a ds_config dict or JSON "
                         f"path, got {type(deepspeed_config).__name__}")
    section = raw.get("activation_checkpointing", {})
    unknown = sorted(set(section) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"activation_checkpointing: unknown key(s) {unknown}; valid: "
                         f"{sorted(_CONFIG_KEYS)}")
    return {_CONFIG_KEYS[k]: v for k, v in section.items()}


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's `deepspeed.checkpointing.configure`: checkpoint()'s settings (module doc).

    ``deepspeed_config``'s ``activation_checkpointing`` section first, the arguments given
    over it (DeepSpeed's order). ``mpu_``: the tensor-parallel rank for
    ``model_parallel_cuda_manual_seed``.
    """
    given = _section(deepspeed_config)
    given.update({k: v for k, v in dict(
        partition_activations=partition_activations,
        contiguous_checkpointing=contiguous_checkpointing, num_checkpoints=num_checkpoints,
        checkpoint_in_cpu=checkpoint_in_cpu, synchronize=synchronize,
        profile=profile).items() if v is not None})
    for key, why in _NOT_IMPLEMENTED.items():
        if given.get(key):
            logger.info("deepspeed.checkpointing.configure(%s=%r): not implemented in meshzero, "
                        "results are unchanged: %s", key, given[key], why)
    _SETTINGS.configured = True
    _SETTINGS.checkpoint_in_cpu = bool(given.get("checkpoint_in_cpu", False))
    _SETTINGS.synchronize = bool(given.get("synchronize", False))
    _SETTINGS.profile = bool(given.get("profile", False))
    if mpu_ is not None:
        _SETTINGS.mpu = mpu_


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's `deepspeed.checkpointing.partition_activations_in_checkpoint`: INFO line."""
    if partition_activation:
        logger.info("partition_activations_in_checkpoint(True): not implemented in meshzero, "
                    "results are unchanged: %s", _NOT_IMPLEMENTED["partition_activations"])


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's `deepspeed.checkpointing.set_num_layers`: sizes nothing here (INFO line)."""
    logger.info("set_num_layers(%d): %s", nlayers, _NOT_IMPLEMENTED["num_checkpoints"])


def is_configured() -> bool:
    """DeepSpeed's `deepspeed.checkpointing.is_configured`: whether configure() was called."""
    return _SETTINGS.configured


def reset() -> None:
    """DeepSpeed's `deepspeed.checkpointing.reset`: nothing to free (no contiguous buffers here)."""


@contextlib.contextmanager
def _around(name: str) -> Iterator[None]:
    """synchronize / profile around one checkpointed forward."""
    if _SETTINGS.synchronize:
        _sync()
    start = time.perf_counter()
    yield
    if _SETTINGS.synchronize:
        _sync()
    if _SETTINGS.profile:
        logger.info("%s forward %.3f ms", name, (time.perf_counter() - start) * 1e3)


def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's `deepspeed.checkpointing.checkpoint`: torch.utils.checkpoint, reentrant.

    ``function(*args, **kwargs)``'s outputs, its activations recomputed in backward. With
    ``checkpoint_in_cpu`` the inputs it saves wait in host memory. As DeepSpeed's (and
    torch's reentrant) checkpoint, parameters get gradients only when an input requires
    grad (torch warns otherwise).
    """
    cpu = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
           if _SETTINGS.checkpoint_in_cpu else contextlib.nullcontext())
    with _around("checkpoint"), cpu:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)


def non_reentrant_checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's `deepspeed.checkpointing.non_reentrant_checkpoint`: torch's, non-reentrant.

    Gradients reach parameters whether or not an input requires grad. torch's non-reentrant
    checkpoint saves nothing to move, so ``checkpoint_in_cpu`` has nothing to act on here.
    """
    with _around("non_reentrant_checkpoint"):
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


class CheckpointFunction:
    """DeepSpeed's `deepspeed.checkpointing.CheckpointFunction`: apply() over checkpoint().

    DeepSpeed's autograd Function appends the outputs to ``all_outputs`` (a list) and returns
    them; so does this.
    """

    @staticmethod
    def apply(function: Callable, all_outputs: list, *args: Any) -> Any:
        """DeepSpeed's `CheckpointFunction.apply`: checkpoint(function, *args)."""
        out = checkpoint(function, *args)
        all_outputs += list(out) if isinstance(out, tuple) else [out]
        return out


# -- Megatron's RNG tracker ---------------------------------------------------------------------
def _get_rng_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """DeepSpeed's `deepspeed.checkpointing.CudaRNGStatesTracker`: named torch RNG states."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """DeepSpeed's `CudaRNGStatesTracker.reset`: forget every state."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """DeepSpeed's `CudaRNGStatesTracker.get_states`: a copy of the name -> state dict."""
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """DeepSpeed's `CudaRNGStatesTracker.set_states`: replace the states."""
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """DeepSpeed's `CudaRNGStatesTracker.add`: a new state ``name`` seeded with ``seed``."""
        if seed in self.seeds_:
            raise ValueError(f"rng tracker: seed {seed} already exists; give each state its own")
        if name in self.states_:
            raise ValueError(f"rng tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        before = _get_rng_state()
        _manual_seed(seed)
        self.states_[name] = _get_rng_state()
        _set_rng_state(before)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        """DeepSpeed's `CudaRNGStatesTracker.fork`: the block on state ``name``, then back."""
        if name not in self.states_:
            raise ValueError(f"rng tracker: state {name!r} was not added; known: "
                             f"{sorted(self.states_)}")
        before = _get_rng_state()
        _set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_rng_state(before)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """DeepSpeed's `deepspeed.checkpointing.get_cuda_rng_tracker`: the process's RNG tracker."""
    return _TRACKER


def _tp_rank() -> int:
    mpu = _SETTINGS.mpu
    if mpu is None:
        return 0
    for getter in ("get_tensor_model_parallel_rank", "get_model_parallel_rank"):
        if hasattr(mpu, getter):
            return int(getattr(mpu, getter)())
    raise ValueError("the mpu given to configure() has neither get_tensor_model_parallel_rank "
                     "nor get_model_parallel_rank")


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """DeepSpeed's `deepspeed.checkpointing.model_parallel_cuda_manual_seed`: RNG seeds.

    torch's RNG gets ``seed``, the tracker's model-parallel state seed + 2718 + tp rank
    (DeepSpeed's offsets). The tp rank is the mpu's given to configure() (0 without one).
    """
    _TRACKER.reset()
    _manual_seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG, seed + 2718 + _tp_rank())


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """DeepSpeed's `deepspeed.checkpointing.model_parallel_reconfigure_tp_seed`: tracker reseed.

    The tracker's model-parallel state becomes seed + 2718 + tp rank; torch's own RNG is
    left as it was.
    """
    with _TRACKER.fork():
        _manual_seed(seed + 2718 + _tp_rank())
