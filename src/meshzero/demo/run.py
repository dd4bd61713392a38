"""``meshzero demo``: the launcher. It starts N local ranks through PyTorch's own elastic
launcher (``torch.distributed.launcher.api.elastic_launch``, what ``torchrun`` runs), each
running :func:`meshzero.demo.train.train_rank`, and collects their return values.

    meshzero demo [--nproc N] [--config FILE] [--steps S] [--out DIR]
    meshzero demo --scaling [--world-sizes 1 2 4] [--steps S] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import meshzero

if TYPE_CHECKING:
    from meshzero.demo.gpt import GPTConfig

DEFAULT_STEPS = 80
DEFAULT_SCALING_STEPS = 6
GLOBAL_BATCH = 16  # sequences of GPTConfig.block_size bytes per optimizer step


def cuda_devices() -> int:
    """The GPUs this process sees, 0 without CUDA. torch is imported here rather than at the
    top so that `meshzero demo --help` starts without it."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_nproc() -> int:
    """One rank per GPU when CUDA is present, else 4 CPU ranks."""
    return cuda_devices() or 4


def demo_config(steps: int, nproc: int, out: Path | None, offload: bool = True
                ) -> dict[str, Any]:
    """The demo's ds_config: ZeRO-3 with every parameter sharded, the fp32 AdamW state in
    host memory (CPU optimizer offload; off for --scaling, which compares with 16 psi / N),
    warmup, the profiler at the middle step."""
    zero: dict[str, Any] = {"stage": 3, "overlap_comm": True,
                            "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda_devices() > 0}
    batch = GLOBAL_BATCH if GLOBAL_BATCH % nproc == 0 else 4 * nproc
    return {
        "train_batch_size": batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {
            "warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3,
            "warmup_num_steps": max(1, steps // 10), "warmup_type": "linear"}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,  # rank 0 draws a progress bar instead of log lines
        "seed": 0,
        "zero_optimization": zero,
        "flops_profiler": _profiler_block(steps, out),
    }


def _profiler_block(steps: int, out: Path | None) -> dict[str, Any]:
    block: dict[str, Any] = {"enabled": True, "profile_step": steps // 2, "module_depth": 2,
                             "top_modules": 3, "detailed": True}
    if out is not None:
        block["output_file"] = str(out / "profile.json")
    return block


def user_config(path: str, steps: int, out: Path | None) -> dict[str, Any]:
    """The user's ds_config; the demo adds an AdamW optimizer and the profiler where the
    file has none (meshzero validates every key when the ranks start)."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"config file '{path}' does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"config file '{path}' is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"config file '{path}' must hold a JSON object")
    base = demo_config(steps, 1, out)
    raw.setdefault("optimizer", base["optimizer"])
    raw.setdefault("flops_profiler", base["flops_profiler"])
    return raw


# Imported once by the forkserver the ranks are forked from, instead of once per rank: on 2
# cores, 4 ranks importing torch (and torch._dynamo, which the optimizer pulls in) at once
# would take longer than the training steps of a short run.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "meshzero", "meshzero.demo.train")


def launch(fn, nproc: int, *args: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks with torch's elastic launcher (c10d
    rendezvous on a free local port, no restarts); returns {rank: return value}."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    # the agent's per-run files (error.json of a failed rank) go in a directory removed after
    # the run; a failure's traceback is in the ChildFailedError already
    with tempfile.TemporaryDirectory(prefix="meshzero-demo-") as log_dir:
        config = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc,
            run_id=f"meshzero-{uuid.uuid4().hex}", rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
            start_method="forkserver", logs_specs=DefaultLogsSpecs(log_dir=log_dir))
        return elastic_launch(config, fn)(*args)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo",
        description="Train a small byte-level GPT (about 3.3 M parameters) on the Python "
                    "standard library's source with meshzero, on N local ranks started by "
                    "PyTorch's elastic launcher. Rank 0 shows the progress, the profiler "
                    "report, every rank's memory and a generated sample. --scaling instead "
                    "trains at several world sizes and compares the model-state bytes per "
                    "rank with the ZeRO-3 formula.")
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks (default: one per GPU, else 4 CPU ranks on gloo)")
    p.add_argument("--config", default=None,
                   help="a ds_config.json to train with (default: the demo's ZeRO-3 config)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps (default {DEFAULT_STEPS}; "
                        f"{DEFAULT_SCALING_STEPS} per world size with --scaling)")
    p.add_argument("--out", default="meshzero-demo",
                   help="directory for profile.json and scaling.png (default ./meshzero-demo)")
    p.add_argument("--scaling", action="store_true",
                   help="train at each of --world-sizes and print model-state bytes per rank "
                        "beside 16*psi/N")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4],
                   help="world sizes for --scaling (default 1 2 4)")
    return p


def run(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    out = Path(args.out)
    if not cuda_devices():
        os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank; the ranks share the cores
    try:
        return _run_scaling(args, out) if args.scaling else _run_demo(args, out)
    except ChildFailedError as exc:
        print(f"meshzero demo: a rank failed:\n{exc.format_msg()}")
        return 1


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")


def _check_ranks(name: str, nproc: int) -> None:
    _check_positive(name, nproc)
    gpus = cuda_devices()
    if gpus and nproc > gpus:
        raise ValueError(f"{name} {nproc}: one rank per GPU, and there are only {gpus}")


def _run_demo(args: argparse.Namespace, out: Path) -> int:
    from meshzero.demo.gpt import GPTConfig
    from meshzero.demo.train import TrainOptions, train_rank

    nproc = args.nproc if args.nproc is not None else default_nproc()
    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    _check_ranks("--nproc", nproc)
    _check_positive("--steps", steps)
    config = (user_config(args.config, steps, out) if args.config
              else demo_config(steps, nproc, out))
    meshzero.load_config(config).resolve_batch(nproc)  # fail here, not on every rank
    model = GPTConfig()
    print(f"meshzero demo: {nproc} ranks ({'NCCL' if cuda_devices() else 'gloo'}), "
          f"a byte-level GPT of {_num_params(model) / 1e6:.2f} M parameters, {steps} steps, "
          f"config {args.config or 'ZeRO-3 (built in)'}", flush=True)
    out.mkdir(parents=True, exist_ok=True)  # the profiler writes profile.json there
    returned = launch(train_rank, nproc, TrainOptions(steps=steps, config=config, model=model))
    profile = config.get("flops_profiler", {}).get("output_file")
    if profile and returned[0]["profiled"]:
        print(f"wrote the profile to {profile}")
    return 0


def _run_scaling(args: argparse.Namespace, out: Path) -> int:
    from meshzero.demo import scaling
    from meshzero.demo.gpt import GPTConfig
    from meshzero.demo.train import TrainOptions, train_rank

    if args.config:
        raise ValueError("--scaling trains the demo's own ZeRO-3 fp32 AdamW config, the one "
                         "the formula 16*psi/N describes; drop --config")
    steps = args.steps if args.steps is not None else DEFAULT_SCALING_STEPS
    _check_positive("--steps", steps)
    for world in args.world_sizes:
        _check_ranks("--world-sizes", world)
        if GLOBAL_BATCH % world:
            raise ValueError(f"--world-sizes: {world} does not divide the global batch of "
                             f"{GLOBAL_BATCH} sequences that every world size trains on")
    model = GPTConfig()
    results = {}
    for world in args.world_sizes:
        print(f"meshzero demo --scaling: world size {world}, {steps} steps", flush=True)
        config = demo_config(steps, world, None, offload=False)
        config["flops_profiler"] = {"enabled": False}
        config["train_batch_size"] = GLOBAL_BATCH  # the same global batch at every size
        returned = launch(train_rank, world, TrainOptions(steps=steps, config=config,
                                                          model=model, show=False))
        results[world] = returned[0]
    print(scaling.scaling_table(model, results))
    print(scaling.loss_summary(results))
    png = scaling.plot(model, results, out)
    print(f"wrote {png}" if png else "matplotlib is not installed: no plot "
          "(pip install -e '.[plot]')")
    return 0


def _num_params(cfg: GPTConfig) -> int:
    import torch

    from meshzero.demo.gpt import GPT

    with torch.device("meta"):
        return GPT(cfg).num_params()
