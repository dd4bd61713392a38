"""What every rank of ``meshzero demo`` runs: train the byte-level GPT with meshzero, then (on
rank 0) print the profiler report, the per-rank memory table and a generated sample.

The launcher (run.py) starts this function on every rank through PyTorch's elastic
launcher, which sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address;
``meshzero.initialize`` joins the process group from them.
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import meshzero
from meshzero.demo.data import global_batch, load_corpus, rank_micro_batch
from meshzero.demo.gpt import GPT, GPTConfig, loss_fn
from meshzero.profiling.report import si
from meshzero.zero.state import CATEGORIES

PROMPT = "def "


@dataclass(frozen=True)
class TrainOptions:
    """Everything a rank needs; picklable, since the launcher sends it to each rank."""

    steps: int
    config: dict[str, Any]  # a ds_config dict
    model: GPTConfig = field(default_factory=GPTConfig)
    seed: int = 0
    corpus_bytes: int = 2_000_000
    show: bool = True  # rank 0 prints the bar, the losses, the report, the table, the sample
    sample_bytes: int = 160
    temperature: float = 0.8


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def train_rank(opts: TrainOptions) -> dict[str, Any]:
    """Train ``opts.steps`` optimizer steps on this rank; return the losses (mean over the
    global batch), every rank's memory_report() and timings."""
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    corpus = load_corpus(opts.corpus_bytes, opts.seed)
    torch.manual_seed(opts.seed)
    engine, _, _, _ = meshzero.initialize(model=GPT(opts.model), config=opts.config)
    rank, world = engine.topology.dp_rank, engine.topology.dp_size
    show = opts.show and dist.get_rank() == 0
    losses, seconds = _train(engine, corpus, opts, rank, show)

    memory: list[Any] = [None] * dist.get_world_size()  # all_gather_object fills in dicts
    dist.all_gather_object(memory, {"rank": dist.get_rank(), "memory": engine.memory_report(),
                                    "peak_rss": _peak_rss()})
    state = engine.full_state_dict()  # a collective: every rank takes part
    tokens = engine.train_batch_size() * opts.model.block_size * opts.steps
    if show:
        if engine.last_profile is not None:
            print(engine.last_profile, flush=True)
        print(memory_table(memory, engine.zero_stage), flush=True)
        print(sample_text(state, opts, engine.device), flush=True)
        print(f"trained {opts.steps} steps on {world} ranks in {seconds:.1f} s "
              f"({tokens / seconds:.0f} tokens/s over all ranks)", flush=True)
    result = {"losses": losses, "memory": memory, "seconds": seconds, "world_size": world,
              "params": engine.zero.layout.numel, "profiled": engine.last_profile is not None}
    dist.destroy_process_group()
    return result


def _train(engine, corpus: torch.Tensor, opts: TrainOptions, rank: int, show: bool
           ) -> tuple[list[float], float]:
    """The training loop; rank 0 draws the bar and writes a loss line every few steps."""
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    batch, block = engine.train_batch_size(), opts.model.block_size
    fcfg = engine.config.flops_profiler
    profile_step = fcfg.profile_step if fcfg.enabled else -1
    every = max(1, opts.steps // 10)
    bar = tqdm(total=opts.steps, desc="training", unit="step", disable=not show,
               file=sys.stderr, dynamic_ncols=True)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(opts.steps):
        t0 = time.perf_counter()
        x, y = global_batch(corpus, step, batch, block, opts.seed)
        total = torch.zeros((), device=engine.device)
        # the profiler prints its report inside step(); keep it for after the bar
        quiet = (contextlib.redirect_stdout(io.StringIO()) if engine.global_steps == profile_step
                 else contextlib.nullcontext())
        with quiet:
            for m in range(accum):
                xb, yb = (t.to(engine.device) for t in rank_micro_batch(x, y, rank, micro, accum,
                                                                        m))
                loss = loss_fn(engine(xb), yb)
                engine.backward(loss)
                engine.step()
                total += loss.detach().float() / accum
        dist.all_reduce(total)  # mean over the data-parallel ranks = loss of the global batch
        losses.append(total.item() / dist.get_world_size())
        tok_s = batch * block / (time.perf_counter() - t0)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tok_s:.0f}")
        bar.update()
        if show and (step % every == 0 or step == opts.steps - 1):
            recent = losses[-every:]
            bar.write(f"step {step:4d} loss {losses[-1]:.4f} (mean of the last {len(recent)}: "
                      f"{sum(recent) / len(recent):.4f}) tokens/s {tok_s:.0f}", file=sys.stdout)
    bar.close()
    return losses, time.perf_counter() - start


def memory_table(memory: list[dict[str, Any]], stage: int) -> str:
    """One line per rank: the bytes memory_report() counts, summed over tiers."""
    head = ["rank", *CATEGORIES, "model states", "on device", "in host", "on nvme",
            "gathered peak", "peak RSS"]
    rows = []
    for entry in memory:
        rep = entry["memory"]
        sums = [sum(rep[c].values()) for c in CATEGORIES]
        tiers = [sum(rep[c][t] for c in CATEGORIES) for t in ("device", "host", "nvme")]
        rows.append([str(entry["rank"]), *(si(b, "B") for b in sums), si(sum(sums), "B"),
                     *(si(b, "B") for b in tiers), si(rep["gathered_params_peak"], "B"),
                     si(entry["peak_rss"], "B")])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    title = f"{'-' * 20} memory per rank at rest (engine.memory_report(), ZeRO-{stage}) {'-' * 20}"
    return "\n".join(["", title, fmt(head), *(fmt(r) for r in rows),
                      "(model states = params + master_params + grads + optimizer_states; "
                      "peak RSS is the whole process)"])


def sample_text(state: dict[str, torch.Tensor], opts: TrainOptions, device: torch.device
                ) -> str:
    """Load the gathered weights into a plain GPT on this rank and sample from it."""
    model = GPT(opts.model)
    model.load_state_dict(state)
    model.to(device).eval()
    if device.type == "cpu":  # the other ranks are done: use the cores they leave
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    prompt = torch.tensor([list(PROMPT.encode())], device=device)
    gen = torch.Generator(device=device).manual_seed(opts.seed)
    out = model.generate(prompt, opts.sample_bytes, temperature=opts.temperature,
                         generator=gen)
    text = bytes(out[0].tolist()).decode("utf-8", errors="replace")
    title = (f"{'-' * 20} sample (temperature {opts.temperature}, {opts.sample_bytes} bytes "
             f"after {PROMPT!r}) {'-' * 20}")
    return "\n".join(["", title, text, "-" * len(title)])
