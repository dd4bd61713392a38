"""DeepSpeed's `deepspeed.DeepSpeedEngine`: meshzero's `Engine` under DeepSpeed's names.

Each method maps one DeepSpeed name onto meshzero's own API (it is a map, not a second
engine): the training step is the core ``Engine``'s; what DeepSpeed spells differently
(keyword order, return values, file names) is translated here. Attributes the engine lacks
fall through to the wrapped model, as DeepSpeed's ``DeepSpeedEngine.__getattr__`` does
(``engine.generate(...)``, ``engine.config_class``). The optimizer ``initialize`` returns
stays the engine's own ``torch.optim.Optimizer`` and gains DeepSpeed's ZeRO-optimizer
attributes ``overflow``, ``cur_scale`` and ``loss_scale``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshzero.deepspeed.optimizer_view import as_zero_optimizer
from meshzero.engine import Engine

logger = logging.getLogger(__name__)

# DeepSpeed's default ``save_16bit_model`` file name: a pickle. meshzero writes safetensors.
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl")
# the config optimizer types DeepSpeed lower-cases (runtime/config.py: DEEPSPEED_OPTIMIZERS)
_DEEPSPEED_OPTIMIZERS = {"adagrad", "adam", "adamw", "lamb", "onebitadam", "onebitlamb",
                         "zerooneadam", "muadam", "muadamw", "musgd", "lion", "muon"}


def _local_rank(engine: Engine) -> int:
    """``LOCAL_RANK`` (torchrun's), else this rank's place on its node."""
    env = os.environ.get("LOCAL_RANK")
    if env is not None:
        return int(env)
    return engine.topology.rank % max(engine.topology.ranks_per_node, 1)


class DeepSpeedEngine(Engine):
    """DeepSpeed's `deepspeed.DeepSpeedEngine`: meshzero's `Engine` under DeepSpeed's names.

    DeepSpeed's method names, keyword order and return values, and attribute fall-through to
    the model."""

    training_dataloader: Any = None  # initialize(training_data=...)'s loader

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        topo = self.topology
        self.global_rank: int = topo.rank
        self.world_size: int = topo.world_size
        self.local_rank: int = _local_rank(self)
        self.dp_world_size: int = topo.dp_size
        self.mp_world_size: int = topo.tp_size
        self.step_overflowed = False  # the last optimizer step was skipped for inf/nan
        client = kwargs.get("optimizer")  # the caller's optimizer, its class, or a factory
        self._client_optimizer_name = None if client is None else (
            client.__name__ if isinstance(client, type) else type(client).__name__)
        if self.optimizer is not None:
            as_zero_optimizer(self.optimizer, self)

    def __getattr__(self, name: str) -> Any:
        """DeepSpeed's `DeepSpeedEngine.__getattr__`: a name the engine lacks is the model's.

        As ``engine.generate(...)`` or ``engine.config_class``."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
        try:
            return getattr(module, name)
        except AttributeError:
            raise AttributeError(f"'{type(self).__name__}' object and its model "
                                 f"{type(module).__name__} have no attribute '{name}'") from None

    # -- the training step -----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """DeepSpeed's `DeepSpeedEngine.backward`: `Engine.backward`; returns loss / gas.

        ``scale_wrt_gas=False``: neither the gradients nor the returned loss are divided by
        the gradient accumulation steps."""
        gas = self.gradient_accumulation_steps()
        # the core divides by gas: undo it when DeepSpeed's caller asks for no division
        core_loss = loss if scale_wrt_gas or gas == 1 else loss * gas
        super().backward(core_loss, **({"retain_graph": True} if retain_graph else {}))
        return loss / gas if scale_wrt_gas else loss

    def step(self, lr_kwargs: dict | None = None) -> bool:  # type: ignore[override]
        """DeepSpeed's `DeepSpeedEngine.step`: `Engine.step` (lr_kwargs to the scheduler).

        The optimizer steps at the accumulation boundary; it sets ``optimizer.overflow``."""
        skipped = self.skipped_steps
        boundary = self.is_gradient_accumulation_boundary()
        # the keyword goes to the core only when given
        applied = super().step(**({} if lr_kwargs is None else {"lr_kwargs": lr_kwargs}))
        if boundary:
            self.step_overflowed = self.skipped_steps > skipped
        return applied

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DeepSpeed's `DeepSpeedEngine.no_sync`: `Engine.no_sync`, refused at stages 2-3 as
        DeepSpeed's (gradient partitioning needs the reduction)."""
        stage = self.zero_stage
        if stage >= 2:
            raise ValueError(f"no_sync context manager is incompatible with gradient "
                             f"partitioning logic of ZeRO stage {stage}: use stage 0 or 1, "
                             "or accumulate with gradient_accumulation_steps")
        with super().no_sync():
            yield

    def get_lr(self) -> list[float]:
        """DeepSpeed's `DeepSpeedEngine.get_lr`: each param group's lr ([] without optimizer)."""
        return self._group_values("lr")

    def get_mom(self) -> list[Any]:
        """DeepSpeed's `DeepSpeedEngine.get_mom`: each group's momentum (SGD, RMSprop) or betas."""
        sgd_like = isinstance(self.optimizer, (torch.optim.SGD, torch.optim.RMSprop))
        return self._group_values("momentum" if sgd_like else "betas")

    def _group_values(self, key: str) -> list[Any]:
        if self.optimizer is None:
            return []
        return [g.get(key, 0.0) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """DeepSpeed's `DeepSpeedEngine.get_global_grad_norm`: `engine.last_grad_norm`.

        The global gradient norm (before clipping) of the last applied step; None before."""
        return self.last_grad_norm

    def allreduce_gradients(self, bucket_size: int = 500_000_000) -> None:
        """DeepSpeed's `DeepSpeedEngine.allreduce_gradients`: nothing left: backward reduced.

        meshzero reduces (stages 0-1) or reduce-scatters (2-3) the gradients in the backward
        at the accumulation boundary, in the config's ``reduce_bucket_size`` buckets
        (``bucket_size`` is DeepSpeed's own fallback's); DeepSpeed's also reduces only at
        the boundary. After a backward inside ``no_sync()`` it is refused: that reduction
        happens in the boundary's backward outside the block."""
        held = getattr(Engine, "reduces_in_backward", None)  # False inside no_sync()
        if held is not None and self.is_gradient_accumulation_boundary() and not held(self):
            raise ValueError("allreduce_gradients() inside no_sync(): meshzero reduces the "
                             "held gradients in the first backward at the accumulation "
                             "boundary outside the block; call backward there instead")

    def optimizer_name(self) -> str | None:
        """DeepSpeed's `DeepSpeedEngine.optimizer_name`: the caller's optimizer class, or the type.

        The class name of the optimizer given to ``initialize``, else the config's
        ``optimizer.type`` (lower-cased when DeepSpeed knows it: runtime/config.py); None
        without an optimizer."""
        if self._client_optimizer_name is not None:
            return self._client_optimizer_name
        optimizer = self.config.optimizer
        if optimizer is None:
            return None
        name = str(optimizer.type)
        return name.lower() if name.lower() in _DEEPSPEED_OPTIMIZERS else name

    def get_pld_theta(self) -> float | None:
        """DeepSpeed's `DeepSpeedEngine.get_pld_theta`: progressive layer drop's current
        keep probability, None when it is off."""
        return None if self.layer_drop is None else self.layer_drop.current

    def get_batch_info(self) -> tuple[int, int, int]:
        """DeepSpeed's `DeepSpeedEngine.get_batch_info`: (global, per-rank micro, accumulation)."""
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps())

    @property
    def global_samples(self) -> int:
        """DeepSpeed's `DeepSpeedEngine.global_samples`: samples of the steps taken."""
        return self.global_steps * self.train_batch_size()

    def destroy(self) -> None:
        """DeepSpeed's `DeepSpeedEngine.destroy`: ``Engine.close`` (collective)."""
        self.close()

    # -- configuration queries -------------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        """DeepSpeed's `DeepSpeedEngine.zero_optimization_stage`: ``zero_optimization.stage``."""
        return self.zero_stage

    def zero_optimization(self) -> bool:
        """DeepSpeed's `DeepSpeedEngine.zero_optimization`: whether the ZeRO stage is > 0."""
        return self.zero_stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        """DeepSpeed's `DeepSpeedEngine.zero_optimization_partition_gradients`: stage >= 2."""
        return self.zero_stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """DeepSpeed's `DeepSpeedEngine.zero_optimization_partition_weights`: stage 3."""
        return self.zero_stage == 3

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's `DeepSpeedEngine.zero_gather_16bit_weights_on_model_save`: True unless false.

        Whether ``save_16bit_model`` gathers and saves at stage 3: the config's
        ``stage3_gather_16bit_weights_on_model_save``, True when not given (meshzero's
        default; DeepSpeed's is False)."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save \
            is not False

    def fp16_enabled(self) -> bool:
        """DeepSpeed's `DeepSpeedEngine.fp16_enabled`: ``fp16.enabled``."""
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        """DeepSpeed's `DeepSpeedEngine.bfloat16_enabled`: ``bf16.enabled``."""
        return bool(self.config.bf16.enabled)

    def gradient_clipping(self) -> float:
        """DeepSpeed's `DeepSpeedEngine.gradient_clipping`: ``gradient_clipping``."""
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int:
        """DeepSpeed's `DeepSpeedEngine.steps_per_print`: ``steps_per_print``."""
        return int(self.config.steps_per_print)

    def wall_clock_breakdown(self) -> bool:
        """DeepSpeed's `DeepSpeedEngine.wall_clock_breakdown`: ``wall_clock_breakdown``."""
        return bool(self.config.wall_clock_breakdown)

    def _core(self, name: str) -> Callable[..., Any]:
        """The core ``Engine`` method ``name`` bound to this engine; one clear line if this
        meshzero build lacks it."""
        method = getattr(Engine, name, None)
        if method is None:
            raise NotImplementedError(f"this meshzero build has no Engine.{name}, which "
                                      f"DeepSpeed's name maps onto; update meshzero")
        return functools.partial(method, self)

    def get_data_parallel_group(self) -> Any:
        """DeepSpeed's `groups._get_data_parallel_group`: the engine's data-parallel group."""
        group = self.topology.dp_group
        return group if group is not None else dist.group.WORLD

    def get_data_parallel_rank(self) -> int:
        """DeepSpeed's `DeepSpeedEngine.get_data_parallel_rank`: this rank's dp index."""
        return self.topology.dp_rank

    def get_model_parallel_rank(self) -> int:
        """DeepSpeed's `DeepSpeedEngine.get_model_parallel_rank`: this rank's tp index."""
        return self.topology.coords["tp"]

    get_tensor_parallel_rank = get_model_parallel_rank

    # -- stage 3 ---------------------------------------------------------------------------------
    def empty_partition_cache(self) -> None:
        """DeepSpeed's `DeepSpeedEngine.empty_partition_cache`: release gathered parameters.

        Every gathered stage-3 unit is released (a no-op at stages 0-2)."""
        self.zero.after_step()

    def _zero3_consolidated_16bit_state_dict(
            self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """DeepSpeed's `DeepSpeedEngine._zero3_consolidated_16bit_state_dict`: rank 0's full dict.

        ``Engine.consolidated_16bit_state_dict`` (collective; the other ranks get {})."""
        return self._core("consolidated_16bit_state_dict")(
            exclude_frozen_parameters=exclude_frozen_parameters)

    def _consolidated_16bit_state_dict(
            self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """DeepSpeed's `DeepSpeedEngine._consolidated_16bit_state_dict`: rank 0's full dict.

        ``Engine.consolidated_16bit_state_dict`` at any stage (DeepSpeed's needs stage 3 or
        AutoTP); collective; the other ranks get {}."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def offload_states(  # type: ignore[override]  # DeepSpeed's device= comes second
            self, include: Any = None, device: Any = "cpu", pin_memory: bool = True,
            non_blocking: bool = False) -> None:
        """DeepSpeed's `DeepSpeedEngine.offload_states`: `Engine.offload_states` (to the CPU).

        ``include`` and ``device`` take DeepSpeed's ``OffloadStateTypeEnum`` /
        ``OffloadDeviceEnum`` members or their string values."""
        name = str(getattr(device, "value", device))
        if name != "cpu":
            raise ValueError(f"offload_states(device={name!r}): meshzero offloads states to "
                             "the CPU only (as DeepSpeed); pass device='cpu'")
        if include is not None:  # enum members as their names, the core's spelling
            include = [str(getattr(item, "value", item)) for item in include]
        self._core("offload_states")(include=include, pin_memory=pin_memory,
                                     non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's `DeepSpeedEngine.reload_states`: ``Engine.reload_states``."""
        self._core("reload_states")(non_blocking=non_blocking)

    # -- pipeline --------------------------------------------------------------------------------
    def eval_batch(self, data_iter: Iterator, return_logits: bool = False,
                   compute_loss: bool = True, reduce_output: str | None = "avg",
                   bcast_loss: bool = True, num_micro_batches: int | None = None) -> Any:
        """DeepSpeed's `PipelineEngine.eval_batch`: the pipeline's forward only; the mean loss.

        Over ``gradient_accumulation_steps`` micro-batches, without gradients or a step;
        ``return_logits=True``: ``(loss, outputs)``, the outputs on the last stage's rank
        (None on the others), as DeepSpeed."""
        pipe = self.pipeline
        if pipe is None:
            raise ValueError("eval_batch() drives a pipeline (pipeline_parallel.size > 1); "
                             "without one evaluate with `with torch.no_grad(): engine(x)`")
        refused = [f"{k}={v!r}" for k, v, ok in (
            ("compute_loss", compute_loss, compute_loss),
            ("reduce_output", reduce_output, reduce_output == "avg"),
            ("num_micro_batches", num_micro_batches,
             num_micro_batches in (None, pipe.micro_batches))) if not ok]
        if refused:
            raise NotImplementedError(
                f"eval_batch({', '.join(refused)}) is not supported: meshzero's pipeline "
                f"evaluates the mean loss over its {pipe.micro_batches} micro-batches "
                "(static shapes)")
        inputs = targets = None
        if pipe.has_first_stage or pipe.has_last_stage:
            items = [next(data_iter) for _ in range(pipe.micro_batches)]
            inputs = torch.cat([x for x, _ in items]).to(self.device)
            targets = torch.cat([y for _, y in items]).to(self.device)
        training = self.module.training
        self.module.eval()  # as DeepSpeed; the mode is restored after (train_batch keeps it)
        try:
            mean, logits = pipe.evaluate(inputs, targets)
        finally:
            self.module.train(training)
        loss = mean if bcast_loss or pipe.has_last_stage else None
        return (loss, logits) if return_logits else loss

    @property
    def is_pipe_parallel(self) -> bool:
        """DeepSpeed's `DeepSpeedEngine.is_pipe_parallel`: whether a pipeline runs."""
        return self.pipeline is not None

    def is_first_stage(self) -> bool:
        """DeepSpeed's `PipelineEngine.is_first_stage`: this rank runs the first stage."""
        return self.pipeline is None or self.pipeline.has_first_stage

    def is_last_stage(self) -> bool:
        """DeepSpeed's `PipelineEngine.is_last_stage`: this rank runs the last stage."""
        return self.pipeline is None or self.pipeline.has_last_stage

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: Any = None,  # type: ignore[override]
                        client_state: Any = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's `DeepSpeedEngine.save_checkpoint`: `Engine.save_checkpoint`; True."""
        # the keywords go to the core only when not its default
        extra: dict[str, bool] = {}
        if not save_latest:
            extra["save_latest"] = False
        if exclude_frozen_parameters:
            extra["exclude_frozen_parameters"] = True
        tag = None if tag is None else str(tag)
        super().save_checkpoint(save_dir, tag, client_state, **extra)
        return True

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: Any = None,  # type: ignore[override]
                        load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Callable | None = None) -> tuple[str | None, Any]:
        """DeepSpeed's `DeepSpeedEngine.load_checkpoint`: `Engine.load_checkpoint`, its order.

        DeepSpeed's positional order (load_module_strict third); collective; returns
        ``(path, client_state)``."""
        if custom_load_fn is not None:
            raise NotImplementedError(
                "load_checkpoint(custom_load_fn=...) is not supported: load the tag with "
                "engine.load_checkpoint, then change the module's weights inside "
                "deepspeed.zero.GatheredParameters(params, modifier_rank=0)")
        extra: dict[str, bool] = {}
        if not load_module_strict:
            extra["load_module_strict"] = False
        if load_module_only:
            extra["load_module_only"] = True
        tag = None if tag is None else str(tag)
        return super().load_checkpoint(load_dir, tag, load_optimizer_states,
                                       load_lr_scheduler_states, **extra)

    def save_16bit_model(self, save_dir: str | os.PathLike,  # type: ignore[override]
                         save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's `DeepSpeedEngine.save_16bit_model`: `Engine.save_16bit_model`; True.

        Safetensors: a pickle name such as ``pytorch_model.bin`` is written as
        ``model.safetensors`` (``<stem>.safetensors`` for another); returns True when it
        saved, as DeepSpeed."""
        name = _safetensors_name(save_filename)
        if name != save_filename:
            logger.info("save_16bit_model: writing %s instead of %s (meshzero writes "
                        "safetensors, never a pickle)", name, save_filename)
        extra = {"exclude_frozen_parameters": True} if exclude_frozen_parameters else {}
        super().save_16bit_model(save_dir, name, **extra)  # the path on rank 0 only
        return self.zero_stage < 3 or self.zero_gather_16bit_weights_on_model_save()

    def save_fp16_model(self, save_dir: str | os.PathLike,
                        save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's `DeepSpeedEngine.save_fp16_model`: the old name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)


def _safetensors_name(filename: str) -> str:
    """The safetensors file meshzero writes for DeepSpeed's ``save_filename``: Hugging Face's
    ``model.safetensors`` for ``pytorch_model.bin``, else ``<stem>.safetensors`` for a pickle
    suffix; any other name is kept."""
    path = Path(filename)
    if path.name == "pytorch_model.bin":
        return str(path.with_name("model.safetensors"))
    if path.suffix in _PICKLE_SUFFIXES:
        return str(path.with_suffix(".safetensors"))
    return filename
