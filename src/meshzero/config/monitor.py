"""Config sections of DeepSpeed's monitors: `tensorboard`, `wandb` and `csv_monitor`, with
DeepSpeed's keys and defaults."""

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
