"""The ``meshzero`` command (also ``python -m meshzero``). Each subcommand is a module with
``add_parser(sub)`` and ``run(args) -> exit code``, listed in COMMANDS.

    meshzero consolidate CKPT_DIR OUT [--tag T] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]
                         [--overwrite]
    meshzero demo [--nproc N] [--config FILE] [--steps S] [--out DIR] [--scaling]
    meshzero env
    meshzero estimate MODEL|--params N [--nodes N --gpus-per-node G --gpu-memory M ...]
    meshzero plan MODEL|--params N [--nodes N --gpus-per-node G --gpu-memory M ...]

Only the module of the command that runs is imported, so ``meshzero --help`` and
``meshzero --version`` start without importing torch. docs/cli.md is the reference.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from meshzero import __version__
from meshzero.log import LEVEL_ENV, setup_logging

# Exit codes, for scripts (docs/cli.md). argparse itself exits 2 on a usage error.
EXIT_OK = 0
EXIT_ERROR = 1  # bad input: the message says which and what is valid, no traceback
EXIT_USAGE = 2
EXIT_DOES_NOT_FIT = 3  # estimate: the configuration does not fit; plan: none fits
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT

EXIT_CODES_HELP = """exit codes:
  0    success (estimate: the configuration fits; plan: at least one fits)
  1    an error in the input, one message on stderr
  2    a usage error (unknown option, missing argument)
  3    estimate: the configuration does not fit; plan: no configuration fits
  130  interrupted

environment:
  MESHZERO_LOG_LEVEL        DEBUG, INFO, WARNING, ERROR or CRITICAL (DEBUG also shows
                            the traceback of an error)
  MESHZERO_LOG_ALL_RANKS=1  log INFO/DEBUG on every rank, not only rank 0"""


@dataclass(frozen=True)
class Command:
    summary: str  # the line in `meshzero --help`
    module: str
    add: str = "add_parser"
    run: str = "run"


COMMANDS: dict[str, Command] = {
    "demo": Command("train a small byte-level GPT with ZeRO-3 on local ranks",
                    "meshzero.demo.run"),
    "env": Command("report the environment (like ds_report)", "meshzero.envreport"),
    "consolidate": Command("write a checkpoint's full model as safetensors", "meshzero.cli",
                           add="add_consolidate", run="run_consolidate"),
    "estimate": Command("memory per GPU and per node of a model, config and cluster",
                        "meshzero.estimate.command"),
    "plan": Command("the configs that fit a cluster, ranked by estimated step time",
                    "meshzero.estimate.plan_command"),
}


def add_consolidate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "consolidate",
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
    p.add_argument("--overwrite", action="store_true",
                   help="replace a model already in OUT (atomically: a kill leaves the old "
                        "model or the new one); without it an existing model is an error")
    return p


def run_consolidate(args: argparse.Namespace) -> int:
    from meshzero.checkpoint import consolidate

    paths = consolidate(args.ckpt_dir, args.out, tag=args.tag, dtype=args.dtype,
                        max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    for path in paths:
        print(path)
    return EXIT_OK


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` runs. A top-level option (--help, --version; none takes a
    value) before it acts first, and then no subcommand needs loading."""
    return argv[0] if argv and argv[0] in COMMANDS else None


SUBCOMMAND_EPILOG = ("exit codes: 0 success, 1 an error in the input, 2 a usage error, 3 does "
                     "not fit (estimate, plan), 130 interrupted; environment variables: "
                     "meshzero --help")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; of the subcommands only the one ``argv`` runs (all when ``argv`` is None)
    gets its options, which imports its module."""
    parser = argparse.ArgumentParser(
        prog="meshzero", description="meshzero: ZeRO sharded data parallelism on PyTorch.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"meshzero {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _chosen(argv) if argv is not None else None
    for name, command in COMMANDS.items():
        if argv is None or name == chosen:
            module = importlib.import_module(command.module)
            p = getattr(module, command.add)(sub)
            p.set_defaults(run=getattr(module, command.run))
            p.epilog = p.epilog or SUBCOMMAND_EPILOG
        else:  # listed in `meshzero --help`; its options load only when it runs
            sub.add_parser(name, help=command.summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (EXIT_* above, docs/cli.md)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    prog = f"meshzero {args.command}"
    try:
        setup_logging()
        return args.run(args)
    except (ValueError, OSError) as exc:  # the user's input or files: say which, no traceback
        if os.environ.get(LEVEL_ENV, "").strip().upper() == "DEBUG":
            raise
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
