"""The monitor blocks: CSV files and TensorBoard event files hold each optimizer step's loss,
lr, loss scale and skipped steps at DeepSpeed's x (samples seen), read back from disk; an
enabled monitor whose package is missing fails at initialize naming it."""

from __future__ import annotations

import csv
import importlib.util
import struct
from pathlib import Path

import pytest
import torch

import meshzero
from meshzero.profiling.monitor import MonitorError

BATCH, STEPS = 4, 3


def _train(config: dict) -> tuple[list[float], list[float]]:
    """STEPS steps of a linear model; the mean loss and the lr of each step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    config = {"train_batch_size": BATCH, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                           "warmup_max_lr": 0.1,
                                                           "warmup_num_steps": 4}},
              **config}
    engine, *_ = meshzero.initialize(model=model, config=config)
    losses, lrs = [], []
    for _ in range(STEPS):
        lrs.append(engine.get_lr()[0])
        total = 0.0
        for _ in range(2):
            x = torch.randn(2, 3)
            loss = torch.nn.functional.mse_loss(engine(x), torch.zeros(2, 2))
            engine.backward(loss)
            engine.step()
            total += loss.item() / 2
        losses.append(total)
    engine.close()
    return losses, lrs


def test_csv_monitor_writes_every_step(tmp_path: Path) -> None:
    losses, lrs = _train({"csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                          "job_name": "run"}})
    rows = {}
    for path in (tmp_path / "run").glob("*.csv"):
        with path.open() as f:
            rows[path.stem] = list(csv.reader(f))
    assert set(rows) >= {"Train_Samples_train_loss", "Train_Samples_lr",
                         "Train_Samples_loss_scale", "Train_Samples_skipped_steps"}
    loss_rows = rows["Train_Samples_train_loss"]
    assert loss_rows[0] == ["step", "Train/Samples/train_loss"]
    assert [int(r[0]) for r in loss_rows[1:]] == [BATCH * (i + 1) for i in range(STEPS)]
    assert [float(r[1]) for r in loss_rows[1:]] == pytest.approx(losses)
    # the lr written after step i is the one step i + 1 runs at
    written = [float(r[1]) for r in rows["Train_Samples_lr"][1:]]
    assert written[:-1] == pytest.approx(lrs[1:])
    assert [float(r[1]) for r in rows["Train_Samples_loss_scale"][1:]] == [1.0] * STEPS


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of the TFRecord event files (length, crc, record, crc)."""
    from tensorboard.compat.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in log_dir.glob("events*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_event_file_reads_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    losses, _ = _train({"tensorboard": {"enabled": True, "output_path": str(tmp_path),
                                        "job_name": "tb"}})
    scalars = _scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["Train/Samples/train_loss"]] == [4, 8, 12]
    assert [v for _, v in scalars["Train/Samples/train_loss"]] == pytest.approx(losses, rel=1e-6)
    assert [v for _, v in scalars["Train/Samples/skipped_steps"]] == [0.0] * STEPS


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_missing_package_fails_at_initialize(package: str, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(MonitorError, match=f"'{package}' package is not installed"):
        _train({package: {"enabled": True}})
