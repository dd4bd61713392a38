"""``deepspeed.pipe``: a DeepSpeed pipeline model as the ``nn.Sequential`` meshzero's
pipeline splits (docs/parallelism.md: ``pipeline_parallel.layers: ""``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn


class LayerSpec:
    """DeepSpeed's `deepspeed.pipe.LayerSpec`: a layer class and its arguments, built when the
    PipelineModule is (every rank builds the whole model; meshzero's cut keeps this rank's
    stage)."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(f"LayerSpec(typename={typename!r}): typename must be an "
                             "nn.Module class")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """DeepSpeed's `deepspeed.pipe.TiedLayerSpec`: refused (a layer tied across pipeline
    stages); tie the weights inside one stage, or train without pipeline parallelism."""

    def __init__(self, key: str, typename: type[nn.Module], *module_args: Any, **kwargs: Any):
        raise NotImplementedError(
            f"TiedLayerSpec({key!r}): meshzero's pipeline does not tie layers across stages; "
            "tie them within one stage (pipeline_parallel.boundaries) or use data parallelism")


class PipelineModule(nn.Sequential):
    """DeepSpeed's `deepspeed.pipe.PipelineModule`: an nn.Sequential; one stage trains as is.

    The layers as an ``nn.Sequential`` with ``num_stages`` and ``loss_fn``. With one stage
    `meshzero.deepspeed.initialize` trains it data-parallel; with more it refuses, naming
    ``meshzero.initialize(model, config with pipeline_parallel, loss_fn=, example_inputs=)``:
    meshzero's pipeline fixes the shapes sent between stages from one micro-batch of inputs,
    which DeepSpeed's signature cannot carry."""

    def __init__(self, layers: Iterable[nn.Module | LayerSpec | Callable], num_stages:
                 int | None = None, topology: Any = None, loss_fn: Callable | None = None,
                 seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0, **kwargs: Any):
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule needs num_stages (or topology)")
        if topology is not None:
            num_stages = topology.get_dim("pipe")
        if activation_checkpoint_interval:
            raise ValueError(
                f"PipelineModule(activation_checkpoint_interval={activation_checkpoint_interval})"
                ": checkpoint inside the layers (deepspeed.checkpointing.checkpoint or "
                "torch.utils.checkpoint) instead")
        if partition_method not in ("parameters", "uniform"):
            raise ValueError(f"PipelineModule(partition_method={partition_method!r}): meshzero "
                             "cuts by parameter count ('parameters') or give explicit cuts "
                             "in pipeline_parallel.boundaries")
        built = [_build(layer) for layer in layers]
        super().__init__(*built)
        self.num_stages, self.loss_fn = int(num_stages), loss_fn  # type: ignore[arg-type]


class _Lambda(nn.Module):
    """A plain function among the layers (DeepSpeed allows callables)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def _build(layer: nn.Module | LayerSpec | Callable) -> nn.Module:
    if isinstance(layer, LayerSpec):
        return layer.build()
    if isinstance(layer, nn.Module):
        return layer
    if callable(layer):
        return _Lambda(layer)
    raise ValueError(f"PipelineModule layer {layer!r} is not a module, LayerSpec or callable")
