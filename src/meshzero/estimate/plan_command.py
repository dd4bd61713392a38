"""``meshzero plan``: the command line of :func:`meshzero.estimate.plan.plan`."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from meshzero.checkpoint.model_files import parse_size
from meshzero.cli import EXIT_DOES_NOT_FIT, EXIT_OK
from meshzero.config import load_config
from meshzero.estimate.command import (
    add_cluster_args,
    add_model_args,
    add_settings_args,
    cluster_of,
    mesh_of,
    model_of,
    pipeline_layout_arg,
)
from meshzero.estimate.core import Estimator
from meshzero.estimate.plan import Assumptions, NothingFitsError, plan_with
from meshzero.estimate.report import fmt_bytes
from meshzero.estimate.settings import settings_from_config


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        description="Try every ZeRO stage, offload choice and micro batch, keep those that "
                    "fit (meshzero estimate) and rank them by a step time estimated from "
                    "FLOPs and communication volume under the stated assumptions. Equal "
                    "tokens/s (to 6 significant digits) ranks less GPU memory first, then "
                    "less host memory, less offload, a lower stage, no activation "
                    "checkpointing, smaller tp and pp, a larger micro batch: the order never "
                    "depends on the order configurations were tried in. Exits 3 when none "
                    "fits.")
    add_model_args(p)
    add_cluster_args(p)
    add_settings_args(p, search=True)
    defaults = Assumptions()
    g = p.add_argument_group("assumptions of the step-time model")
    g.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step (default: the config's train_batch_size, "
                        "else none: gradient accumulation 1)")
    g.add_argument("--gpu-flops", type=float, default=defaults.gpu_flops,
                   help=f"peak FLOP/s per GPU (default {defaults.gpu_flops:g}, A100 bf16)")
    g.add_argument("--mfu", type=float, default=defaults.mfu,
                   help=f"fraction of the peak reached (default {defaults.mfu:g})")
    for name, text in (("intra-node-bw", "ring bus bandwidth per GPU inside a node"),
                       ("inter-node-bw", "ring bus bandwidth per GPU across nodes"),
                       ("pcie-bw", "device <-> host per GPU"),
                       ("nvme-bw", "NVMe read or write per node")):
        value = getattr(defaults, name.replace("-", "_"))
        g.add_argument(f"--{name}", default=value, type=_size,
                       help=f"{text}, bytes/s (default {fmt_bytes(value)}/s)")
    g.add_argument("--cpu-adam-rate", type=float, default=defaults.cpu_adam_rate,
                   help=f"host optimizer elements/s per node (default {defaults.cpu_adam_rate:g})")
    p.add_argument("--search-mesh", action="store_true",
                   help="also try every tensor-parallel size inside a node and pipeline size "
                        "(powers of two) instead of the configured --tp/--pp")
    p.add_argument("--top", type=int, default=10, help="rows to show (0: all; default 10)")
    p.add_argument("--write-config", default=None, metavar="FILE",
                   help="write the fastest configuration as a ds_config JSON")
    return p


def _size(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float(parse_size(text.removesuffix("/s")))


def run(args: argparse.Namespace) -> int:
    if args.top < 0:
        raise ValueError(f"--top must be 0 (all rows) or more, got {args.top}")
    if args.write_config and not os.path.isdir(os.path.dirname(args.write_config) or "."):
        raise ValueError(f"--write-config {args.write_config}: the directory does not exist")
    cluster = cluster_of(args)
    spec, per_sample = model_of(args)
    assumptions = Assumptions(gpu_flops=args.gpu_flops, mfu=args.mfu,
                              intra_node_bw=args.intra_node_bw, inter_node_bw=args.inter_node_bw,
                              pcie_bw=args.pcie_bw, nvme_bw=args.nvme_bw,
                              cpu_adam_rate=args.cpu_adam_rate)
    base = settings_from_config(args.config, cluster.world_size, precision=args.precision,
                                grad_dtype=args.grad_dtype, seq_len=args.seq_len,
                                trainable=args.trainable, **mesh_of(args))
    global_batch = args.global_batch
    if global_batch is None and args.config is not None:
        global_batch = load_config(args.config).train_batch_size
    try:
        result = plan_with(Estimator(spec, per_sample, pipeline_layout_arg(args)), base, cluster,
                       assumptions, global_batch, bool(args.activation_checkpointing),
                       args.search_mesh)
    except NothingFitsError as exc:  # an answer, not an error in the input
        print(f"meshzero plan: {exc}")
        return EXIT_DOES_NOT_FIT
    print(result.format(args.top))
    if args.write_config:
        raw = _raw_config(args.config)
        with open(args.write_config, "w") as f:
            json.dump(result.best.ds_config(raw), f, indent=2)
            f.write("\n")
        print(f"wrote the fastest configuration to {args.write_config}")
    return EXIT_OK


def _raw_config(path: str | None) -> dict[str, Any] | None:
    if path is None:
        return None
    load_config(path)  # validated already; re-read the JSON to keep the user's own keys
    with open(path) as f:
        return json.load(f)
