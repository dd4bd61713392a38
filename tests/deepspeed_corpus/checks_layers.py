"""Checks: activation checkpointing (deepspeed.checkpointing), moe, pipe."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.deepspeed_corpus.context import Context, batch, check, ds, ds_from, make_model

TRACKER = "model-parallel-rng"


def _ckpt() -> Any:
    return ds().checkpointing


def _configure() -> None:
    """Megatron's / gpt-neox's keywords (runtime/activation_checkpointing/checkpointing.py:
    configure)."""
    _ckpt().configure(None, partition_activations=False, contiguous_checkpointing=False,
                      num_checkpoints=2, checkpoint_in_cpu=False, synchronize=False,
                      profile=False)


@check("deepspeed.checkpointing.configure")
def configure(ctx: Context) -> None:
    _configure()
    assert _ckpt().is_configured() is True


@check("deepspeed.checkpointing.is_configured")
def is_configured(ctx: Context) -> None:
    _configure()
    assert _ckpt().is_configured() is True


@check("deepspeed.checkpointing.checkpoint")
def checkpoint(ctx: Context) -> None:
    """The same outputs and gradients as without recomputation."""
    _configure()
    model, ref = make_model(), make_model()
    x, y = batch(0)

    def run(m: nn.Module, ckpt: bool) -> torch.Tensor:
        h = m.input(x)
        for block in m.blocks:
            h = _ckpt().checkpoint(block, h) if ckpt else block(h)
        return nn.functional.mse_loss(m.head(h), y)

    loss, want = run(model, True), run(ref, False)
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def _forked_draw() -> torch.Tensor:
    with _ckpt().get_cuda_rng_tracker().fork():
        return torch.rand(4, device=ds().get_accelerator().current_device_name())


@check("deepspeed.checkpointing.get_cuda_rng_tracker")
def rng_tracker(ctx: Context) -> None:
    """fork() draws from the model-parallel stream and leaves the default one alone."""
    dev = ds().get_accelerator().current_device_name()
    _ckpt().model_parallel_cuda_manual_seed(123)
    torch.manual_seed(5)
    a = _forked_draw()
    plain = torch.rand(4, device=dev)
    _ckpt().model_parallel_cuda_manual_seed(123)
    torch.manual_seed(5)
    torch.testing.assert_close(_forked_draw(), a)
    torch.testing.assert_close(torch.rand(4, device=dev), plain)


@check("deepspeed.checkpointing.model_parallel_cuda_manual_seed")
def mp_manual_seed(ctx: Context) -> None:
    _ckpt().model_parallel_cuda_manual_seed(11)
    assert TRACKER in _ckpt().get_cuda_rng_tracker().get_states()


@check("deepspeed.checkpointing.model_parallel_reconfigure_tp_seed")
def reconfigure_tp_seed(ctx: Context) -> None:
    """Reseeds the tracker's stream as model_parallel_cuda_manual_seed did."""
    _ckpt().model_parallel_cuda_manual_seed(21)
    a = _forked_draw()
    _forked_draw()
    _ckpt().model_parallel_reconfigure_tp_seed(21)
    torch.testing.assert_close(_forked_draw(), a)


@check("deepspeed.checkpointing.reset")
def reset(ctx: Context) -> None:
    _configure()
    _ckpt().reset()
    h = torch.randn(2, 8, requires_grad=True)
    block = make_model().blocks[0]
    torch.testing.assert_close(_ckpt().checkpoint(block, h), block(h))


@check("deepspeed.checkpointing._MODEL_PARALLEL_RNG_TRACKER_NAME")
def tracker_name(ctx: Context) -> None:
    assert _ckpt()._MODEL_PARALLEL_RNG_TRACKER_NAME == TRACKER


@check("deepspeed.runtime.activation_checkpointing.checkpointing")
def checkpointing_module_path(ctx: Context) -> None:
    mod = ds_from("deepspeed.runtime.activation_checkpointing.checkpointing")
    for name in ("checkpoint", "configure", "get_cuda_rng_tracker",
                 "model_parallel_cuda_manual_seed"):
        assert getattr(mod, name) is getattr(_ckpt(), name), name


# --- moe -----------------------------------------------------------------------------------


@check("deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer")
def split_moe_groups(ctx: Context) -> None:
    """Expert params (allreduce=False) move to a group named after their group_name with
    moe=True (moe/utils.py)."""
    model = make_model()
    expert = model.head.weight
    expert.allreduce = False  # type: ignore[attr-defined]
    expert.group_name = "ep_size_1"  # type: ignore[attr-defined]
    groups = [{"params": list(model.parameters()), "name": "default", "weight_decay": 0.1}]
    split = ds_from("deepspeed.moe.utils",
                    "split_params_into_different_moe_groups_for_optimizer")(groups)
    dense = [g for g in split if not g.get("moe")]
    moe = [g for g in split if g.get("moe")]
    assert len(dense) == 1 and all(p is not expert for p in dense[0]["params"])
    assert len(dense[0]["params"]) == len(list(model.parameters())) - 1
    assert len(moe) == 1 and moe[0]["params"] == [expert] and moe[0]["name"] == "ep_size_1"
    assert moe[0]["weight_decay"] == 0.1


@check("deepspeed.moe.layer.MoE")
def moe_layer(ctx: Context) -> None:
    """One expert, top-1: every token goes to it with gate weight 1 (moe/layer.py)."""
    expert = nn.Linear(8, 8)
    layer = ds_from("deepspeed.moe.layer", "MoE")(hidden_size=8, expert=copy.deepcopy(expert),
                                                  num_experts=1, ep_size=1, k=1)
    x = torch.randn(2, 4, 8)
    out, l_aux, _ = layer(x)
    torch.testing.assert_close(out, expert(x))
    assert l_aux.numel() == 1


# --- pipe ----------------------------------------------------------------------------------


@check("deepspeed.pipe.LayerSpec")
def layer_spec(ctx: Context) -> None:
    spec = ds_from("deepspeed.pipe", "LayerSpec")(nn.Linear, 4, 3)
    layer = spec.build()
    assert isinstance(layer, nn.Linear) and layer.weight.shape == (3, 4)


@check("deepspeed.pipe.TiedLayerSpec")
def tied_layer_spec(ctx: Context) -> None:
    spec = ds_from("deepspeed.pipe", "TiedLayerSpec")("embed", nn.Embedding, 10, 4,
                                                       tied_weight_attr="weight")
    assert spec.key == "embed" and isinstance(spec.build(), nn.Embedding)


@check("deepspeed.pipe.PipelineModule")
def pipeline_module(ctx: Context) -> None:
    """One stage: the layers in order (pipe/module.py)."""
    pipe = ds_from("deepspeed.pipe")
    torch.manual_seed(0)
    layers = [pipe.LayerSpec(nn.Linear, 5, 8), pipe.LayerSpec(nn.GELU),
              pipe.LayerSpec(nn.Linear, 8, 3)]
    module = pipe.PipelineModule(layers=layers, num_stages=1,
                                 loss_fn=nn.functional.mse_loss)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 8), nn.GELU(), nn.Linear(8, 3))
    x, _ = batch(0)
    torch.testing.assert_close(module(x), ref(x))


@check("deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology")
def pipe_topology(ctx: Context) -> None:
    cls = ds_from("deepspeed.runtime.pipe.topology", "PipeModelDataParallelTopology")
    topo = cls(num_pp=1, num_mp=1, num_dp=dist.get_world_size())
    assert topo.get_dim("data") == dist.get_world_size() and topo.get_dim("pipe") == 1
