"""DeepSpeed's monitors: the training events of every `steps_per_print`-th optimizer step,
written from rank 0 to TensorBoard, Weights & Biases and CSV files as the config's
`tensorboard`, `wandb` and `csv_monitor` blocks ask, and the `comms_logger` lines.

The events keep DeepSpeed's names and x axis (samples seen so far): Train/Samples/train_loss
(the mean loss of the step's micro-batches), Train/Samples/lr (first param group),
Train/Samples/loss_scale, plus meshzero's own under the same prefix: skipped_steps (fp16
overflows so far), step_time (the step clock's seconds of the step, timing.py), grad_norm
(the global norm before clipping; every applied step),
memory_{device,host,nvme}_bytes
(engine.memory_report() summed by tier), memory_gathered_peak_bytes, and
comm_{intra,inter}_node_bytes (engine.comm_report() of the step). With comms_logger enabled,
Comms/<op>/<group>/{count,bytes,seconds} too. CSV needs nothing installed; TensorBoard needs
the `tensorboard` package and W&B the `wandb` package (the `meshzero[tensorboard]` and
`meshzero[wandb]` extras); an enabled block whose package is missing fails at ``initialize``,
on every rank, naming it.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import os
from dataclasses import dataclass
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
        # one W&B step per write, at DeepSpeed's step (samples seen): every event of a write
        # shares it
        by_x: dict[int, dict[str, float]] = {}
        for name, value, x in events:
            by_x.setdefault(x, {})[name] = value
        for x, values in sorted(by_x.items()):
            self.run.log(values, step=x)

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

    def write(self, events: list[Event]) -> None:
        for writer in self.writers:
            writer.write(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


@dataclass
class StepRecord:
    """What the monitors write of one optimizer step (x: samples seen so far)."""

    samples: int
    loss: float
    lr: float
    loss_scale: float
    skipped_steps: int
    step_time: float
    grad_norm: float | None  # None when the step computed none (an overflow, unit steps)
    memory: dict  # engine.memory_report()
    comm: dict  # engine.comm_report()


def tier_bytes(memory: dict) -> dict[str, int]:
    """Bytes at rest per tier, summed over memory_report()'s categories (its scalar
    gathered_params_peak is a transient, not a tier's holding)."""
    out = {"device": 0, "host": 0, "nvme": 0}
    for tiers in memory.values():
        if isinstance(tiers, dict):
            for tier, nbytes in tiers.items():
                out[tier] += nbytes
    return out


def step_events(r: StepRecord) -> list[Event]:
    x = r.samples
    values = {"train_loss": r.loss, "lr": r.lr, "loss_scale": r.loss_scale,
              "skipped_steps": float(r.skipped_steps), "step_time": r.step_time}
    if r.grad_norm is not None:
        values["grad_norm"] = r.grad_norm
    for tier, nbytes in tier_bytes(r.memory).items():
        values[f"memory_{tier}_bytes"] = float(nbytes)
    values["memory_gathered_peak_bytes"] = float(r.memory.get("gathered_params_peak", 0))
    for where in ("intra_node", "inter_node"):
        values[f"comm_{where}_bytes"] = float(sum(op[f"{where}_bytes"]
                                                  for op in r.comm.values()))
    return [(f"Train/Samples/{name}", value, x) for name, value in values.items()]


def _profiled(op: str, wanted: list[str]) -> bool:
    """DeepSpeed's prof_ops names the torch call (all_gather_into_tensor,
    reduce_scatter_tensor, send): it matches meshzero's op it starts with, or that starts
    with it (send -> send_recv)."""
    return any(op == w or w.startswith(op + "_") or op.startswith(w + "_") for w in wanted)


def comm_rows(by_group: dict[tuple[str, str], dict], config: Any) -> list[tuple[str, str, dict]]:
    """(op, group, {count, bytes, seconds, ...}) of CommStats.by_group() that the
    comms_logger block profiles (all ops, or with prof_all false those in prof_ops)."""
    return [(op, group, stats) for (op, group), stats in by_group.items()
            if config.prof_all or _profiled(op, config.prof_ops)]


def comm_events(rows: list[tuple[str, str, dict]], samples: int) -> list[Event]:
    return [(f"Comms/{op}/{group}/{key}", float(stats[key]), samples)
            for op, group, stats in rows for key in ("count", "bytes", "seconds")]
