"""``meshzero estimate``: the command line of :func:`meshzero.estimate.estimate`. The model,
cluster and config arguments are shared with ``meshzero plan``."""

from __future__ import annotations

import argparse
import importlib
import json

from meshzero.checkpoint.model_files import parse_size
from meshzero.cli import EXIT_DOES_NOT_FIT, EXIT_OK
from meshzero.estimate.core import Estimator
from meshzero.estimate.model import ModelSpec, load_model
from meshzero.estimate.settings import (
    OFFLOAD_DEVICES,
    PRECISIONS,
    TRAINABLE,
    Cluster,
    settings_from_config,
)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (one of)")
    g.add_argument("model", nargs="?", default=None,
                   help="an import path 'pkg.mod:factory' (a zero-argument callable returning "
                        "an nn.Module) or a Hugging Face config.json; built on the meta device")
    g.add_argument("--params", default=None,
                   help="no model: this many parameters (7e9, 7B, 350M)")
    g.add_argument("--largest-unit", default=None,
                   help="with --params: parameters of the largest unit (one transformer block)")
    g.add_argument("--inputs", default=None, metavar="PKG.MOD:FN",
                   help="fn(micro_batch, seq_len) -> the forward's arguments, when they cannot "
                        "be guessed (default: token ids for a model that starts with an "
                        "embedding, features for one that starts with a Linear)")
    g.add_argument("--activation-memory", default=None, metavar="BYTES",
                   help="with --params: activation bytes per sample (e.g. 2GB)")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    g.add_argument("--gpu-memory", default="80GB", help="per GPU (default 80GB)")
    g.add_argument("--host-memory", default="1TB", help="per node (default 1TB)")


def add_settings_args(p: argparse.ArgumentParser, *, search: bool = False) -> None:
    g = p.add_argument_group("config (flags override the ds_config)")
    g.add_argument("--config", default=None, help="a ds_config.json")
    if not search:
        g.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None,
                       help="ZeRO stage (default: the config's zero_optimization.stage, else 0)")
        g.add_argument("--offload-optimizer", choices=OFFLOAD_DEVICES, default=None,
                       help="where the fp32 master weights and optimizer states live, stages "
                            "1-3 (default: the config's offload_optimizer.device, else none)")
        g.add_argument("--offload-param", choices=OFFLOAD_DEVICES, default=None,
                       help="where the parameter shards live between uses, stage 3 (default: "
                            "the config's offload_param.device, else none)")
        g.add_argument("--micro-batch", type=int, default=None,
                       help="samples per GPU per micro-step (default: the config's, else 1)")
    g.add_argument("--trainable", choices=list(TRAINABLE), default=None,
                   help="which parameters hold gradients, masters and optimizer states: "
                        "'initialize' (default) those with requires_grad at initialize; "
                        "'all' every one, as after unfreezing a backbone frozen at "
                        "initialize (its flat groups keep their own padding); 'none' an "
                        "engine without an optimizer (a frozen reference / reward / EMA model: "
                        "forward only, parameters and nothing else)")
    g.add_argument("--precision", choices=list(PRECISIONS), default=None,
                   help="compute dtype; fp32 master weights unless the config sets "
                        "bf16.bf16_master_weights_and_grads (default: the config's bf16/fp16 "
                        "section, else fp32)")
    g.add_argument("--grad-dtype", choices=list(PRECISIONS), default=None,
                   help="the dtype gradients are held, accumulated and reduced in "
                        "(data_types.grad_accum_dtype; default: the config's, else the compute "
                        "dtype, as DeepSpeed); fp32 accumulates more accurately over many "
                        "micro-steps, 16 bits hold the ZeRO paper's 2 bytes per parameter")
    g.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sample (default: the model's context length)")
    g.add_argument("--tp", type=int, default=None,
                   help="tensor parallel size (default: the config's tensor_parallel.size, else 1)")
    g.add_argument("--tp-plan", default=None,
                   help="tensor parallel plan: gpt, hf_gpt2 or llama (default: the config's)")
    g.add_argument("--sp", type=int, default=None,
                   help="Ulysses sequence parallel size: each rank holds seq-len / sp of every "
                        "sample, ZeRO shards over dp x sp (default: the config's "
                        "sequence_parallel_size, else 1)")
    g.add_argument("--pp", type=int, default=None,
                   help="pipeline parallel size (default: the config's, else 1)")
    g.add_argument("--pp-schedule", default=None,
                   help="pipeline schedule: gpipe, 1f1b, ... (default: the config's, else 1f1b)")
    g.add_argument("--pp-micro-batches", type=int, default=None,
                   help="micro-batches per pipeline step (default: the config's, else the "
                        "gradient accumulation steps)")
    g.add_argument("--pipeline-layout", default=None, metavar="PKG.MOD:NAME",
                   help="a PipelineLayout object (as initialize(pipeline_layout=...)); default: "
                        "the config's pipeline_parallel layers/first/last")
    g.add_argument("--activation-checkpointing", action="store_true", default=None,
                   help="also try every configuration with every unit (repeated block) run "
                        "under torch.utils.checkpoint" if search else
                        "count activations as if every unit (repeated block) were run under "
                        "torch.utils.checkpoint")


def cluster_of(args: argparse.Namespace) -> Cluster:
    return Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                   gpu_memory=args.gpu_memory, host_memory=args.host_memory)


def mesh_of(args: argparse.Namespace) -> dict:
    """The tp/pp/sp flags as settings overrides (None: the config's)."""
    return {"tp": args.tp, "tp_plan": args.tp_plan, "pp": args.pp, "sp": args.sp,
            "pp_schedule": args.pp_schedule, "pp_micro_batches": args.pp_micro_batches}


def pipeline_layout_arg(args: argparse.Namespace) -> object | None:
    if args.pipeline_layout is None:
        return None
    module_name, _, attr = args.pipeline_layout.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"--pipeline-layout {args.pipeline_layout!r}: {exc}") from None


def model_of(args: argparse.Namespace) -> tuple[ModelSpec, int | None]:
    spec = load_model(args.model, params=args.params, largest_unit=args.largest_unit,
                      inputs=args.inputs)
    per_sample = (parse_size(args.activation_memory) if args.activation_memory is not None
                  else None)
    return spec, per_sample


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "estimate",
        description="Estimate the memory of training a model with meshzero: per GPU "
                    "parameters, gradients, master parameters, optimizer states (the bytes "
                    "engine.memory_report() reports), the stage-3 gathered working set, "
                    "communication buckets and activations (one forward/backward on fake "
                    "tensors); per node host memory; whether it fits, and the largest micro "
                    "batch that does. Exits 3 when it does not fit.")
    add_model_args(p)
    add_cluster_args(p)
    add_settings_args(p)
    p.add_argument("--json", action="store_true", help="print the estimate as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    cluster = cluster_of(args)
    spec, per_sample = model_of(args)
    settings = settings_from_config(
        args.config, cluster.world_size, stage=args.stage, precision=args.precision,
        grad_dtype=args.grad_dtype,
        offload_optimizer=args.offload_optimizer, offload_param=args.offload_param,
        micro_batch=args.micro_batch, seq_len=args.seq_len,
        activation_checkpointing=args.activation_checkpointing, trainable=args.trainable,
        **mesh_of(args))
    est = Estimator(spec, per_sample, pipeline_layout_arg(args)).estimate(settings, cluster)
    print(json.dumps(est.to_dict(), indent=2, default=str) if args.json else est)
    return EXIT_OK if est.fits else EXIT_DOES_NOT_FIT

