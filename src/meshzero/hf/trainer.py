"""``MeshzeroTrainer``: ``transformers.Trainer`` with meshzero's engine under the loop.

Switching is one line: ``MeshzeroTrainer(..., meshzero_config="ds_config.json")`` instead of
``Trainer(...)``, launched with torchrun. The Trainer keeps everything it owns (data loading
and sharding, the loop, evaluation, callbacks, logging, ``report_to``, checkpoint folders and
their rotation); the engine takes the model, its gradients and the optimizer:

    training_step     the Trainer's loss, then ``engine.backward`` and ``engine.step`` (a
                      counted no-op until the accumulation boundary, where it clips and steps)
    optimizer / lr_scheduler
                      facades the loop can call: the step already happened in the engine
    _clip_grad_norm   the engine's pre-clip norm of the step, for the logs
    save_model        hf/save.py (collective): a PEFT adapter, or sharded safetensors + index
                      and config.json: what from_pretrained reads
    torch_compile     the config's "compile" section (hf/config.py): the engine compiles
                      each unit's forward; Accelerate's dynamo plugin is switched off
    ref_model ...     TRL's reference / reward models: ZeRO-3 engines without an optimizer
                      (hf/frozen.py); generate at stage 3 gathers once (hf/generation.py)
    checkpoint-N      the Trainer's files + the engine's sharded checkpoint in ``meshzero/``,
                      loadable at another world size and stage

The override points past the public ones are Trainer internals; the module checks at import
that they exist with the parameters it relies on (``INTERNALS``), so a transformers release
that renames or reshapes one fails here, by name, rather than training wrongly.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:
    import transformers
    from transformers import Trainer
except ImportError as e:  # an extra: say which, rather than a bare ModuleNotFoundError
    raise ImportError("meshzero.hf.MeshzeroTrainer needs transformers: "
                      "pip install 'meshzero[hf]'") from e

import meshzero
from meshzero.config import Config, ConfigError, load_config
from meshzero.hf.config import argument_values, read_raw_config, resolve_auto, resolve_compile
from meshzero.hf.frozen import shard_frozen_models
from meshzero.hf.generation import attach
from meshzero.hf.save import save_pretrained
from meshzero.parallel.sequence_hf import gather_batch

MESHZERO_DIR = "meshzero"  # the engine's sharded checkpoint inside checkpoint-N
SUPPORTED_TRANSFORMERS = ">=5.17,<6"  # pyproject's hf extra; 5.17.0 and 5.25.0 tested
# The Trainer internals MeshzeroTrainer overrides, with the parameters it relies on; the
# public hooks it uses (training_step, compute_loss, create_scheduler, save_model, ...) are
# documented API. A release that drops or reshapes one fails at import, naming it.
INTERNALS: dict[str, tuple[str, ...]] = {
    "_build_accelerator_args": ("kwargs",),
    "_prepare_for_training": ("max_steps", "train_dataloader", "resume_from_checkpoint"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_clip_grad_norm": ("model",),
    "_get_grad_norm": ("model", "grad_norm"),
    "_wrap_model": ("model", "training", "dataloader"),
    "_prepare_inputs": ("inputs",),
    "get_optimizer_cls_and_kwargs": ("args", "model"),
    "get_decay_parameter_names": ("model",),
    "create_scheduler": ("num_training_steps", "optimizer"),
}
# attributes Trainer.__init__ sets that training_step reads (checked once built)
INSTANCE_ATTRIBUTES = ("model_accepts_loss_kwargs", "compute_loss_func", "accelerator",
                       "callback_handler")


def missing_internals(trainer: type) -> list[str]:
    """Each entry of `INTERNALS` that `trainer` lacks or whose parameters changed."""
    out = []
    for name, params in INTERNALS.items():
        method = getattr(trainer, name, None)
        if method is None:
            out.append(f"{name} (missing)")
            continue
        have = inspect.signature(method).parameters
        if any(p not in have for p in params):
            out.append(f"{name}{tuple(have)} (meshzero calls it with {params})")
    return out


def _unsupported(what: list[str]) -> str:
    return (f"meshzero.hf.MeshzeroTrainer needs Trainer internals that transformers "
            f"{transformers.__version__} lacks or changed: {'; '.join(what)}; install a "
            f"supported release: pip install 'transformers{SUPPORTED_TRANSFORMERS}' "
            "(5.17 through 5.25 are tested)")


if _missing := missing_internals(Trainer):
    raise ImportError(_unsupported(_missing))


class _EngineOptimizer:
    """What the Trainer's loop calls on ``self.optimizer``: the engine already stepped."""

    def __init__(self, engine: meshzero.Engine):
        self.engine = engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [] if self.engine.optimizer is None else self.engine.optimizer.param_groups

    def step(self, closure: Callable | None = None) -> None:
        """A no-op: ``engine.step()`` ran in ``training_step`` at the boundary."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A no-op: the engine zeroes its gradient shards after each step."""


class _EngineSchedule:
    """What the Trainer's loop calls on ``self.lr_scheduler``: the engine's scheduler steps
    inside ``engine.step()``; ``get_last_lr`` is the rate the last step used (what a plain
    Trainer logs, read before its scheduler steps)."""

    def __init__(self, engine: meshzero.Engine):
        self.engine = engine
        self.last_lr = engine.get_lr()

    def get_last_lr(self) -> list[float]:
        return list(self.last_lr)

    def step(self) -> None:
        """A no-op: see the class docstring."""


class MeshzeroTrainer(Trainer):
    """``transformers.Trainer`` on a meshzero engine: ZeRO stages 0-3, offload, the
    ds_config's "auto" values resolved from the ``TrainingArguments``.

    ``meshzero_config``: a ds_config dict or JSON path. With an ``optimizer`` section the
    engine builds it; without, the Trainer's ``optim`` choice (with its weight-decay groups)
    is built over the engine's shard fragments. Likewise ``scheduler`` vs ``lr_scheduler_type``.
    Tensor and pipeline parallelism are not available through the Trainer (its data loader
    shards over every rank).
    """

    def __init__(self, *args: Any,
                 meshzero_config: dict[str, Any] | str | os.PathLike[str] | None = None,
                 **kwargs: Any):
        if meshzero_config is not None:
            self.meshzero_raw_config = read_raw_config(meshzero_config)
        elif "meshzero_raw_config" not in self.__dict__:  # on_meshzero's classes set it first
            raise TypeError(f"{type(self).__name__} needs meshzero_config= (a ds_config dict "
                            "or JSON path)")
        self.engine: meshzero.Engine | None = None
        self.frozen_engines: dict[str, meshzero.Engine] = {}
        super().__init__(*args, **kwargs)
        if lacking := [name for name in INSTANCE_ATTRIBUTES if not hasattr(self, name)]:
            raise ImportError(_unsupported([f"Trainer.{name} (not set by __init__)"
                                            for name in lacking]))
        self._check_arguments()
        probe_steps = self.args.max_steps if self.args.max_steps > 0 else 1_000_000
        self.engine_config(probe_steps)  # every config problem now, before any work

    def _check_arguments(self) -> None:
        problems = []
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            problems.append("--deepspeed / --fsdp: meshzero replaces them; drop the argument")
        if self.optimizer is not None or self.lr_scheduler is not None:
            problems.append("optimizers=(...): the engine builds the optimizer over its shards; "
                            "set TrainingArguments.optim / lr_scheduler_type or the config's "
                            "'optimizer' / 'scheduler' sections instead")
        if self.args.n_gpu > 1:
            problems.append(f"{self.args.n_gpu} GPUs in one process (DataParallel): launch one "
                            "process per GPU with torchrun")
        if self.args.load_best_model_at_end:
            problems.append("load_best_model_at_end=True: not supported yet; load the best "
                            "checkpoint-N folder with from_pretrained after training")
        if problems:
            raise ValueError("MeshzeroTrainer cannot run with:\n" + "\n".join(problems))

    def engine_config(self, max_steps: int) -> Config:
        """The meshzero config for a run of ``max_steps`` optimizer steps: "auto" resolved,
        agreement with the arguments checked, validated."""
        config = load_config(self.resolved_config(max_steps))
        if config.tensor_parallel.size > 1 or config.pipeline_parallel.size > 1:
            raise ConfigError("tensor_parallel.size / pipeline_parallel.size > 1: the Trainer's "
                              "data loader shards over every rank; use meshzero.initialize for "
                              "3D parallelism")
        return config

    def resolved_config(self, max_steps: int) -> dict[str, Any]:
        """The ds_config dict with "auto" resolved from the arguments (not yet validated)."""
        hidden = getattr(getattr(self.model, "config", None), "hidden_size", None)
        sp = self.meshzero_raw_config.get("sequence_parallel_size", 1)
        values = argument_values(self.args, world_size=self.args.world_size,
                                 max_steps=max_steps, hidden_size=hidden,
                                 sequence_parallel=sp if isinstance(sp, int) else 1)
        return resolve_compile(resolve_auto(self.meshzero_raw_config, values), self.args)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """The Trainer's Accelerator arguments without its dynamo plugin: ``torch_compile``
        went into the config's "compile" section (``resolve_compile``), so the engine compiles
        each unit and Accelerate never wraps the model or the engine in ``torch.compile``."""
        args = super()._build_accelerator_args(**kwargs)
        if "dynamo_plugin" in args:
            try:
                from accelerate.utils import (  # type: ignore[import-untyped]
                    DynamoBackend,
                    TorchDynamoPlugin,
                )
            except ImportError as e:  # the Trainer needs accelerate: an extra, say which
                raise ImportError("MeshzeroTrainer needs accelerate: "
                                  "pip install 'meshzero[hf]'") from e
            args["dynamo_plugin"] = TorchDynamoPlugin(backend=DynamoBackend.NO)
        return args

    # -- building the engine (the Trainer's _prepare_for_training) -----------------------------
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any,
                              resume_from_checkpoint: str | None) -> tuple[nn.Module, Any]:
        if self.engine is not None:
            raise RuntimeError("MeshzeroTrainer.train() runs once per trainer (the model is "
                               "sharded now); continue with a new trainer and "
                               "train(resume_from_checkpoint=...)")
        self._check_accumulation(train_dataloader)
        config = self.engine_config(max_steps)
        optimizer, groups = (None, None) if config.optimizer is not None else self._optimizer()
        self.lr_scheduler = None  # create_scheduler below builds only when it is None
        schedule = None if config.scheduler is not None else (
            lambda opt: self.create_scheduler(num_training_steps=max_steps, optimizer=opt))
        engine, _, _, _ = meshzero.initialize(model=self.model, optimizer=optimizer,
                                              model_parameters=groups, lr_scheduler=schedule,
                                              config=config)
        self.engine = engine
        self.frozen_engines = shard_frozen_models(self, self.resolved_config(max_steps))
        attach(self, engine)  # accelerator.unwrap_model, generate at stage 3 (hf/generation.py)
        if resume_from_checkpoint is not None:
            engine.load_checkpoint(os.path.join(resume_from_checkpoint, MESHZERO_DIR))
        # duck-typed stand-ins: the Trainer calls only the methods they define
        self.optimizer = _EngineOptimizer(engine)  # type: ignore[assignment]
        self.lr_scheduler = _EngineSchedule(engine)  # type: ignore[assignment]
        self.model_wrapped = engine
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def _optimizer(self) -> tuple[Callable, list[dict[str, Any]]]:
        """The Trainer's optimizer choice as a factory over fragment groups, and its groups
        (weight decay except on the parameters the Trainer exempts)."""
        model = self.model
        assert model is not None  # Trainer.__init__ requires a model or model_init
        # Trainer.create_optimizer passes its model (any nn.Module) the same way; the
        # annotation says PreTrainedModel only
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)  # type: ignore[arg-type]
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        return (lambda fragment_groups: cls(fragment_groups, **kwargs)), [
            g for g in groups if g["params"]]

    def _check_accumulation(self, train_dataloader: Any) -> None:
        """The engine steps every ``gradient_accumulation_steps`` micro-batches; the Trainer
        also steps on an epoch's last, shorter window. Refuse an epoch that has one."""
        accum = self.args.gradient_accumulation_steps
        try:
            batches = len(train_dataloader)
        except TypeError:  # an iterable dataset: checked step by step in training_step
            return
        if batches % accum:
            raise ValueError(
                f"{batches} batches per epoch per rank is not a multiple of "
                f"gradient_accumulation_steps = {accum}: the last step of each epoch would "
                "have fewer micro-batches, which the engine does not support; change the "
                "dataset size, per_device_train_batch_size or gradient_accumulation_steps")

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        """Called before the engine exists: only check the folder; the engine loads its
        sharded checkpoint in ``_prepare_for_training``."""
        where = os.path.join(resume_from_checkpoint, MESHZERO_DIR)
        if not os.path.isfile(os.path.join(where, "latest")):
            raise ValueError(f"{resume_from_checkpoint} holds no meshzero checkpoint ({where}/"
                             "latest is missing): resume from a checkpoint-N folder that "
                             "MeshzeroTrainer saved")

    # -- the step ------------------------------------------------------------------------------
    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Under sequence parallelism the ranks of an sp group train on one batch: their
        micro-batches together (each rank then keeps its sequence chunk)."""
        inputs = super()._prepare_inputs(inputs)
        sp = self.engine.sequence_parallel if self.engine is not None else None
        return inputs if sp is None else gather_batch(inputs, sp)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The Trainer's, except in training under sequence parallelism: a loss it multiplied
        by the number of processes (to undo the data-parallel average of a loss over the
        tokens of all of them) is multiplied by the dp ranks only, as the ranks of an sp group
        share one batch, whose loss the engine has summed over them. (Training counts the
        tokens of each rank's own batch, before the group's are joined; evaluation counts the
        joined batch on every rank, which the multiplication cancels.)"""
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        sp = self.engine.sequence_parallel if self.engine is not None else None
        scaled = (self.args.average_tokens_across_devices and num_items_in_batch is not None
                  and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None))
        if sp is None or not scaled or not model.training:
            return result
        if isinstance(result, tuple):  # return_outputs
            return result[0] / sp.size, result[1]
        return result / sp.size

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        engine = self.engine
        if engine is None or model is not engine:
            raise RuntimeError("MeshzeroTrainer.training_step runs inside train() only")
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs, num_items_in_batch=num_items_in_batch)
        assert isinstance(loss, torch.Tensor)  # return_outputs=False: the loss alone
        del inputs
        if not self._loss_scaled_for_accumulation(num_items_in_batch):
            loss = loss / self.current_gradient_accumulation_steps
        # the Trainer's loss is already scaled for accumulation; the engine divides by it again
        engine.backward(loss * engine.gradient_accumulation_steps())
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary != self.accelerator.sync_gradients:
            raise RuntimeError(
                f"the Trainer {'steps' if self.accelerator.sync_gradients else 'accumulates'} "
                f"after micro-step {engine.micro_steps} but the engine "
                f"{'steps' if boundary else 'accumulates'}: the epoch's last window is shorter "
                "than gradient_accumulation_steps")
        if boundary:
            assert isinstance(self.lr_scheduler, _EngineSchedule)
            self.lr_scheduler.last_lr = engine.get_lr()
        engine.step()
        return loss.detach()

    def _loss_scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """The Trainer's own rule: a loss normalised by the tokens of the whole accumulated
        batch (by the model or a ``compute_loss_func``) is not divided again."""
        override = getattr(self, "loss_is_scaled_for_ga", None)  # not in transformers 5.17
        if override is not None:
            return bool(override)
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            self.compute_loss_func is not None)

    def _clip_grad_norm(self, model: nn.Module) -> float | None:
        """The engine clipped inside its step; this is the norm before clipping."""
        return self.engine.last_grad_norm if self.engine is not None else None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm

    def _wrap_model(self, model: nn.Module, training: bool = True,
                    dataloader: Any = None) -> nn.Module:
        """Evaluation after training runs through the engine (stage 3 gathers parameters)."""
        if self.engine is not None:
            return self.engine
        return super()._wrap_model(model, training, dataloader)

    def memory_report(self) -> dict[str, dict]:
        """Bytes this rank holds at rest, per engine: ``{"model": ..., "ref_model": ...,
        "reward_funcs[i]": ...}`` (each an ``Engine.memory_report``); inside ``train()``."""
        if self.engine is None:
            raise RuntimeError("MeshzeroTrainer.memory_report: the engines exist once train() "
                               "has started")
        return {"model": self.engine.memory_report(),
                **{name: e.memory_report() for name, e in self.frozen_engines.items()}}

    # -- saving --------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A ``from_pretrained`` directory (hf/save.py): a PEFT model's adapter
        (``adapter_config.json``, ``adapter_model.safetensors``), any other model's weights
        gathered unit by unit in the compute dtype as sharded safetensors with an index, and
        config.json (and generation_config.json); the tokenizer/processor. Collective: call it
        on every rank, as the Trainer does."""
        if self.engine is None:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        assert output_dir is not None  # TrainingArguments defaults it to "trainer_output"
        save_pretrained(self.engine, output_dir)
        if self.args.should_save and self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's sharded checkpoint (master weights, optimizer and scheduler state,
        step counters) in ``checkpoint-N/meshzero``; collective."""
        assert self.engine is not None, "checkpoints are saved inside train()"
        self.engine.save_checkpoint(os.path.join(output_dir, MESHZERO_DIR))
