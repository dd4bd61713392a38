"""The monitor blocks and the comms_logger: every `steps_per_print` steps, rank 0 writes each
event DeepSpeed writes (train loss, lr, loss scale at its x, samples seen) plus meshzero's own
(memory by tier, comm bytes, step time, grad norm) to CSV files, TensorBoard event files and
a W&B run, read back from disk and compared with what the engine reports; an enabled monitor
whose package is missing fails at initialize naming it."""

from __future__ import annotations

import csv
import importlib.util
import logging
import struct
import time
from pathlib import Path

import pytest
import torch

import meshzero
from meshzero.profiling.monitor import MonitorError, tier_bytes

MICRO, ACCUM = 2, 2


def _config(world: int, extra: dict) -> dict:
    return {"train_batch_size": MICRO * ACCUM * world, "gradient_accumulation_steps": ACCUM,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                         "warmup_max_lr": 0.1,
                                                         "warmup_num_steps": 4}},
            "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, **extra}


def _train(rank: int, world: int, extra: dict, steps: int) -> list[dict]:
    """`steps` steps of a linear model on rank-specific data; per step what the engine
    reports after it (mean micro-batch loss, lr, grad norm, memory and comm reports)."""
    torch.manual_seed(0)
    engine, *_ = meshzero.initialize(model=torch.nn.Linear(3, 2), config=_config(world, extra))
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(steps):
        loss_sum = 0.0
        for _ in range(ACCUM):
            x = torch.randn(MICRO, 3, generator=gen)
            loss = torch.nn.functional.mse_loss(engine(x), torch.ones(MICRO, 2))
            engine.backward(loss)
            engine.step()
            loss_sum += loss.item()
        out.append({"loss": loss_sum / ACCUM, "lr": engine.get_lr()[0],
                    "grad_norm": engine.last_grad_norm, "memory": engine.memory_report(),
                    "comm": engine.comm_report()})
    engine.close()
    return out


def _csv_rank(rank: int, world: int, root: str) -> list[dict]:
    # each rank its own output_path: a file under rank 1's is a write from rank 1
    monitor = {"enabled": True, "output_path": f"{root}/rank{rank}", "job_name": "run"}
    return _train(rank, world, {"steps_per_print": 2, "csv_monitor": monitor}, steps=4)


def _read_csv(directory: Path) -> dict[str, list[list[str]]]:
    rows = {}
    for path in directory.glob("*.csv"):
        with path.open() as f:
            rows[path.stem] = list(csv.reader(f))
    return rows


def test_csv_monitor_every_steps_per_print_on_rank_0(run_ranks, tmp_path: Path) -> None:
    ranks = run_ranks(_csv_rank, 2, str(tmp_path))
    assert not (tmp_path / "rank1").exists()  # rank 0 only
    rows = _read_csv(tmp_path / "rank0" / "run")
    names = ["train_loss", "lr", "loss_scale", "skipped_steps", "step_time", "grad_norm",
             "memory_device_bytes", "memory_host_bytes", "memory_nvme_bytes",
             "memory_gathered_peak_bytes", "comm_intra_node_bytes", "comm_inter_node_bytes"]
    assert set(rows) == {f"Train_Samples_{n}" for n in names}
    printed = [ranks[0][1], ranks[0][3]]  # steps 2 and 4
    samples = [2 * 8, 4 * 8]  # DeepSpeed's x: samples seen, global batch 8

    def column(name: str) -> list[float]:
        table = rows[f"Train_Samples_{name}"]
        assert table[0] == ["step", f"Train/Samples/{name}"]
        assert [int(r[0]) for r in table[1:]] == samples
        return [float(r[1]) for r in table[1:]]

    assert column("train_loss") == pytest.approx([s["loss"] for s in printed])
    assert column("train_loss") != pytest.approx([s["loss"] for s in (ranks[1][1], ranks[1][3])])
    assert column("lr") == pytest.approx([s["lr"] for s in printed])
    assert column("grad_norm") == pytest.approx([s["grad_norm"] for s in printed])
    assert column("loss_scale") == [1.0, 1.0]
    assert column("skipped_steps") == [0.0, 0.0]
    assert all(t > 0 for t in column("step_time"))
    for tier in ("device", "host", "nvme"):
        assert column(f"memory_{tier}_bytes") == [tier_bytes(s["memory"])[tier] for s in printed]
    assert column("memory_device_bytes")[0] > 0
    intra = [sum(op["intra_node_bytes"] for op in s["comm"].values()) for s in printed]
    assert column("comm_intra_node_bytes") == intra and intra[0] > 0
    assert column("comm_inter_node_bytes") == [0.0, 0.0]  # one node


def test_grad_norm_is_the_global_norm_before_clipping() -> None:
    """At world size 1 the engine's last_grad_norm is torch's norm of the step's gradient."""
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    gen = torch.Generator().manual_seed(100)
    xs = [torch.randn(MICRO, 3, generator=gen) for _ in range(ACCUM)]
    for x in xs:
        (torch.nn.functional.mse_loss(reference(x), torch.ones(MICRO, 2)) / ACCUM).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
    (step,) = _train(0, 1, {}, steps=1)
    assert step["grad_norm"] == pytest.approx(expected, rel=1e-5)
    (step,) = _train(0, 1, {"gradient_clipping": 0.0}, steps=1)
    assert step["grad_norm"] == pytest.approx(expected, rel=1e-5)  # every step has one


def test_comms_logger_lines_every_steps_per_print(caplog) -> None:
    caplog.set_level(logging.INFO, logger="meshzero")
    steps = _train(0, 1, {"steps_per_print": 2, "comms_logger": {"enabled": True}}, steps=3)
    lines = [r.getMessage() for r in caplog.records if " comm " in r.getMessage()]
    assert lines and all(line.startswith("step 2 comm ") for line in lines)
    ops = {op: v["count"] for op, v in steps[1]["comm"].items()}
    logged = {line.split()[3]: int(line.split()[7]) for line in lines}
    assert logged == ops  # one group (dp) at world size 1: its counts are the op's
    assert all(line.split()[5] == "dp" for line in lines)


def test_comms_logger_prof_ops_filter(caplog) -> None:
    caplog.set_level(logging.INFO, logger="meshzero")
    _train(0, 1, {"steps_per_print": 1, "comms_logger": {
        "enabled": True, "prof_all": False, "prof_ops": ["reduce_scatter_tensor"]}}, steps=1)
    ops = {r.getMessage().split()[3] for r in caplog.records if " comm " in r.getMessage()}
    assert ops == {"reduce_scatter"}  # DeepSpeed's torch-call name matches meshzero's op


def test_comms_logger_events_reach_the_monitor(tmp_path: Path) -> None:
    steps = _train(0, 1, {"steps_per_print": 1, "comms_logger": {"enabled": True},
                          "csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                                          "job_name": "c"}}, steps=1)
    rows = _read_csv(tmp_path / "c")
    for op, stats in steps[0]["comm"].items():
        assert [float(r[1]) for r in rows[f"Comms_{op}_dp_count"][1:]] == [stats["count"]]
        assert [float(r[1]) for r in rows[f"Comms_{op}_dp_bytes"][1:]] == [stats["bytes"]]


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
    steps = _train(0, 1, {"steps_per_print": 1, "tensorboard": {
        "enabled": True, "output_path": str(tmp_path), "job_name": "tb"}}, steps=3)
    scalars = _scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["Train/Samples/train_loss"]] == [4, 8, 12]
    assert [v for _, v in scalars["Train/Samples/train_loss"]] == pytest.approx(
        [s["loss"] for s in steps], rel=1e-6)
    assert [v for _, v in scalars["Train/Samples/lr"]] == pytest.approx(
        [s["lr"] for s in steps], rel=1e-6)
    assert [v for _, v in scalars["Train/Samples/skipped_steps"]] == [0.0] * 3


def _wandb_history(path: Path) -> list[dict[str, float]]:
    """History records of an offline run's .wandb file: a LevelDB-style log (7-byte file
    header, 32 KiB blocks of records with a crc32, length, kind header) of wandb's Record
    protobufs."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunk, out = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block padding
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record.FromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): float(i.value_json)
                            for i in record.history.item})
    return out


def test_wandb_offline_run_reads_back(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    steps = _train(0, 1, {"steps_per_print": 1, "wandb": {"enabled": True, "project": "mz"}},
                   steps=2)
    (run,) = (tmp_path / "wandb").glob("offline-run-*/*.wandb")
    # wandb's service process may append the records just after finish() returns (seen
    # once in a probe): wait for them, for a few seconds at most
    deadline = time.monotonic() + 10
    while True:
        history = [h for h in _wandb_history(run) if "Train/Samples/train_loss" in h]
        if len(history) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [h["_step"] for h in history] == [4, 8]  # DeepSpeed's step: samples seen
    assert [h["Train/Samples/train_loss"] for h in history] == pytest.approx(
        [s["loss"] for s in steps])
    assert [h["Train/Samples/lr"] for h in history] == pytest.approx([s["lr"] for s in steps])
    assert [h["Train/Samples/grad_norm"] for h in history] == pytest.approx(
        [s["grad_norm"] for s in steps])


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_missing_package_fails_at_initialize(package: str, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(MonitorError, match=f"'{package}' package is not installed"):
        _train(0, 1, {package: {"enabled": True}}, steps=1)
