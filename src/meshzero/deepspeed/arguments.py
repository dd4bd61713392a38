"""DeepSpeed's command-line arguments: ``add_config_arguments`` (deepspeed/__init__.py
``_add_core_arguments``) and ``add_tuning_arguments`` (deepspeed/runtime/lr_schedules.py),
the same flags, defaults and types, so a DeepSpeed script's parser reads the same command
line. ``--deepspeed_config`` is what the script passes on to ``initialize(config=...)``."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's `deepspeed.add_config_arguments`: DeepSpeed's four flags (--deepspeed...)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for user code; meshzero reads nothing)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated: --deepspeed_config")
    return parser


def _add_args(group: argparse._ArgumentGroup, table: dict[str, tuple[type, object, str]]
                ) -> None:
    for flag, (kind, default, helptext) in table.items():
        group.add_argument(flag, type=kind, default=default, help=helptext)


_TUNING: dict[str, tuple[type, object, str]] = {
    "--lr_schedule": (str, None, "LR schedule for training."),
    "--lr_range_test_min_lr": (float, 0.001, "Starting lr value."),
    "--lr_range_test_step_rate": (float, 1.0, "scaling rate for LR range test."),
    "--lr_range_test_step_size": (int, 1000, "training steps per LR change."),
    "--lr_range_test_staircase": (bool, False, "use staircase scaling for LR range test."),
    "--cycle_first_step_size": (int, 1000, "size of first step of 1Cycle schedule."),
    "--cycle_first_stair_count": (int, -1, "first stair count for 1Cycle schedule."),
    "--cycle_second_step_size": (int, -1, "size of second step of 1Cycle schedule."),
    "--cycle_second_stair_count": (int, -1, "second stair count for 1Cycle schedule."),
    "--decay_step_size": (int, 1000, "size of intervals for post cycle decay."),
    "--cycle_min_lr": (float, 0.01, "1Cycle LR lower bound."),
    "--cycle_max_lr": (float, 0.1, "1Cycle LR upper bound."),
    "--decay_lr_rate": (float, 0.0, "post cycle LR decay rate."),
}
_MOMENTUM_AND_WARMUP: dict[str, tuple[type, object, str]] = {
    "--cycle_min_mom": (float, 0.8, "1Cycle momentum lower bound."),
    "--cycle_max_mom": (float, 0.9, "1Cycle momentum upper bound."),
    "--decay_mom_rate": (float, 0.0, "post cycle momentum decay rate."),
    "--warmup_min_lr": (float, 0, "WarmupLR minimum/initial LR value"),
    "--warmup_max_lr": (float, 0.001, "WarmupLR maximum LR value."),
    "--warmup_num_steps": (int, 1000, "WarmupLR step count for LR warmup."),
    "--warmup_type": (str, "log", "WarmupLR increasing function during warmup"),
    "--warmup_min_ratio": (float, 0.01, "Cosine LR lower bound."),
    "--cos_min_ratio": (float, 0.01, "Cosine LR lower bound."),
}


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's `deepspeed.add_tuning_arguments`: its LR-schedule flags (lr_schedules.py)."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    _add_args(group, _TUNING)
    group.add_argument("--cycle_momentum", default=False, action="store_true",
                       help="Enable 1Cycle momentum schedule.")
    _add_args(group, _MOMENTUM_AND_WARMUP)
    return parser
