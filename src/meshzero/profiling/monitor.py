"""DeepSpeed's monitors: the training events of each optimizer step, written from rank 0 to
TensorBoard, Weights & Biases and CSV files as the config's `tensorboard`, `wandb` and
`csv_monitor` blocks ask.

The events keep DeepSpeed's names and x axis (samples seen so far): Train/Samples/train_loss
(the mean loss of the step's micro-batches), Train/Samples/lr (first param group),
Train/Samples/loss_scale, plus meshzero's Train/Samples/skipped_steps (fp16 overflows so far)
and Train/Samples/step_time (seconds of forward, backward and step). CSV needs nothing
installed; TensorBoard needs the `tensorboard` package and W&B the `wandb` package (the
`meshzero[tensorboard]` and `meshzero[wandb]` extras); an enabled block whose package is
missing fails at ``initialize``, on every rank, naming it.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

Event = tuple[str, float, int]  # (name, value, x: samples seen)


class MonitorError(ValueError):
    """A monitor the config enables cannot run (its package is missing)."""


class Writer(Protocol):
    def write(self, events: list[Event]) -> None: ...

    def close(self) -> None: ...


def _require(package: str, block: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise MonitorError(
            f"{block}.enabled is true but the '{package}' package is not installed; "
            f"install it (pip install 'meshzero[{package}]') or set {block}.enabled false")


class CSVWriter:
    """DeepSpeed's csv_monitor layout: output_path/job_name/<event with / as _>.csv, each a
    "step,<event>" header and one row per write."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.dir = Path(output_path or ".") / job_name
        self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, events: list[Event]) -> None:
        for name, value, x in events:
            path = self.dir / (name.replace("/", "_") + ".csv")
            new = not path.exists()
            with path.open("a", newline="") as f:
                out = csv.writer(f)
                if new:
                    out.writerow(["step", name])
                out.writerow([x, value])

    def close(self) -> None:
        pass


class TensorBoardWriter:
    def __init__(self, output_path: str, job_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=os.path.join(output_path or "runs", job_name))

    def write(self, events: list[Event]) -> None:
        for name, value, x in events:
            self.writer.add_scalar(name, value, x)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        self.wandb: Any = importlib.import_module("wandb")
        self.run = self.wandb.init(project=project, group=group, entity=team)

    def write(self, events: list[Event]) -> None:
        for name, value, x in events:
            self.run.log({name: value, "Train/Samples": x})

    def close(self) -> None:
        self.run.finish()


class Monitor:
    """The writers the config enables, on rank 0 (other ranks hold none)."""

    def __init__(self, writers: list[Writer]) -> None:
        self.writers = writers

    @staticmethod
    def check(config: Any) -> None:
        """Fail on every rank, before any work, if an enabled monitor's package is missing."""
        if config.tensorboard.enabled:
            _require("tensorboard", "tensorboard")
        if config.wandb.enabled:
            _require("wandb", "wandb")

    @classmethod
    def from_config(cls, config: Any, rank: int) -> Monitor | None:
        """None when no monitor is enabled; writers are opened on rank 0 only."""
        cls.check(config)
        tb, wb, cm = config.tensorboard, config.wandb, config.csv_monitor
        if not (tb.enabled or wb.enabled or cm.enabled):
            return None
        writers: list[Writer] = []
        if rank == 0:
            if tb.enabled:
                writers.append(TensorBoardWriter(tb.output_path, tb.job_name))
            if wb.enabled:
                writers.append(WandbWriter(wb.project, wb.group, wb.team))
            if cm.enabled:
                writers.append(CSVWriter(cm.output_path, cm.job_name))
        return cls(writers)

    def write_step(self, *, samples: int, loss: float, lr: float, loss_scale: float,
                   skipped_steps: int, step_time: float) -> None:
        events = [("Train/Samples/train_loss", loss, samples), ("Train/Samples/lr", lr, samples),
                  ("Train/Samples/loss_scale", loss_scale, samples),
                  ("Train/Samples/skipped_steps", float(skipped_steps), samples),
                  ("Train/Samples/step_time", step_time, samples)]
        for writer in self.writers:
            writer.write(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []
