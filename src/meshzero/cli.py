"""The ``meshzero`` command. Each subcommand registers its parser and handler in COMMANDS.

    meshzero consolidate CKPT_DIR OUT [--tag T] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
    meshzero demo [--nproc N] [--config FILE] [--steps S] [--out DIR] [--scaling]
    meshzero env
    meshzero estimate MODEL|--params N [--nodes N --gpus-per-node G --gpu-memory M ...]
    meshzero plan MODEL|--params N [--nodes N --gpus-per-node G --gpu-memory M ...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from meshzero import envreport
from meshzero.demo import run as demo
from meshzero.estimate import command as estimate_command
from meshzero.estimate import plan as plan_command


def _add_consolidate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "consolidate",
        help="write a checkpoint's full model as safetensors",
        description="Write the full model of a meshzero checkpoint as safetensors under the "
                    "model's own parameter names (sharded with model.safetensors.index.json "
                    "when larger than --max-shard-size). Runs on one CPU process; memory is "
                    "about one parameter.")
    p.add_argument("ckpt_dir", help="the save_dir given to engine.save_checkpoint")
    p.add_argument("out", help="output directory")
    p.add_argument("--tag", default=None, help="tag to export (default: the one 'latest' names)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="dtype of the floating-point tensors written (default fp32)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest output file, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    return p


def _run_consolidate(args: argparse.Namespace) -> int:
    from meshzero.checkpoint import consolidate

    paths = consolidate(args.ckpt_dir, args.out, tag=args.tag, dtype=args.dtype,
                        max_shard_size=args.max_shard_size)
    for path in paths:
        print(path)
    return 0


# name -> (add the subparser, run it)
COMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], argparse.ArgumentParser],
                          Callable[[argparse.Namespace], int]]] = {
    "demo": (demo.add_parser, demo.run),
    "env": (envreport.add_parser, envreport.run),
    "consolidate": (_add_consolidate, _run_consolidate),
    "estimate": (estimate_command.add_parser, estimate_command.run),
    "plan": (plan_command.add_parser, plan_command.run),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshzero", description="meshzero tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add, run) in COMMANDS.items():
        add(sub).set_defaults(run=run, command=name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"meshzero {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
