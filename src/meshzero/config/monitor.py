"""Config sections of DeepSpeed's monitors: `tensorboard`, `wandb` and `csv_monitor`, and its
`comms_logger`, with DeepSpeed's keys and defaults."""

from typing import Annotated

from pydantic import Field, Strict

from meshzero.config.scalars import Bool, Section

Text = Annotated[str, Strict()]
Name = Annotated[str, Strict(), Field(min_length=1)]


class TensorBoardConfig(Section):
    """`tensorboard`: event files under output_path/job_name (torch.utils.tensorboard)."""

    enabled: Bool = False
    output_path: Text = ""
    job_name: Name = "DeepSpeedJobName"


class WandbConfig(Section):
    """`wandb`: a Weights & Biases run in `project`, `group`, under the `team` entity."""

    enabled: Bool = False
    group: Text | None = None
    team: Text | None = None
    project: Name = "deepspeed"


class CSVMonitorConfig(Section):
    """`csv_monitor`: one CSV file per event under output_path/job_name."""

    enabled: Bool = False
    output_path: Text = ""
    job_name: Name = "DeepSpeedJobName"


class CommsLoggerConfig(Section):
    """`comms_logger`: every `steps_per_print` steps, one `meshzero` INFO line per (op, group)
    of the step's collectives (count, bytes, seconds), also written to the enabled monitors.
    `prof_all: false` keeps the ops named in `prof_ops`. `verbose` and `debug` (DeepSpeed's
    per-call print and caller names) are accepted and change nothing: the lines are per step."""

    enabled: Bool = False
    verbose: Bool = False
    prof_all: Bool = True
    prof_ops: list[Name] = Field(default_factory=list)
    debug: Bool = False
