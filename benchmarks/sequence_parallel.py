"""Ulysses sequence parallelism on CPU: per-rank activation memory and step time against
sequence length at sp = 1, 2, 4 (dp = 1, ZeRO-3, fp32, the demo GPT).

    python benchmarks/sequence_parallel.py                        # seq 256 512 1024, sp 1 2 4
    python benchmarks/sequence_parallel.py --seq-lens 512 --sp 1 2

Each sp runs ``sp`` ranks under torchrun (gloo, one thread per rank); every rank passes the
same full micro-batch and the engine keeps its sequence chunk. Per row, rank 0's:

- peak bytes: the most bytes of tensors created during one forward + backward that were
  alive at once (a ``TorchDispatchMode`` adds each new storage and drops it when it dies):
  activations, the all-to-all buffers, gathered ZeRO-3 units and temporaries;
- step s: the median wall time of ``--steps`` optimizer steps (after one warm-up), the
  slowest rank's;
- all_to_all bytes: what comm_report counted for the step.

On 2 shared cores the ranks of sp = 4 share the CPUs, so step time here shows the all-to-all's
cost, not the speed-up a GPU per rank would give.
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref

import torch
import torch.distributed as dist
from _torchrun import print_result, run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakBytes(TorchDispatchMode):
    """Peak live bytes of the storages ops create while active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def died(_ref, key=key, nbytes=nbytes) -> None:
            self.live -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, died)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out


def _engine(seq: int, sp: int):
    import meshzero
    from meshzero.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=seq, n_layer=2, n_head=4, n_embd=128)
    config = {"train_batch_size": 1, "sequence_parallel_size": sp,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}, "steps_per_print": 10**6}
    engine, *_ = meshzero.initialize(model=GPT(cfg), config=config)
    return engine


def _step(engine, x: torch.Tensor, y: torch.Tensor, counter: PeakBytes | None = None) -> None:
    """One optimizer step; ``counter`` counts its forward and backward."""
    import contextlib

    from meshzero.demo.gpt import loss_fn

    with counter if counter is not None else contextlib.nullcontext():
        logits = engine(x)
        sp = engine.sequence_parallel
        loss = loss_fn(logits, y) if sp is None else sp.loss(loss_fn, logits, y)
        engine.backward(loss)
        del logits, loss
    engine.step()


def _row(seq: int, steps: int) -> dict:
    sp = dist.get_world_size()
    engine = _engine(seq, sp)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (1, seq + 1), generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]
    _step(engine, x, y)  # warm-up
    counter = PeakBytes()
    _step(engine, x, y, counter)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        _step(engine, x, y)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
    a2a = engine.comm_report().get("all_to_all", {}).get("bytes", 0)
    engine.close()
    return {"seq": seq, "sp": sp, "peak_bytes": counter.peak,
            "step_s": statistics.median(times), "all_to_all_bytes": a2a}


def worker(seqs: list[int], steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = [_row(seq, steps) for seq in seqs]
    if dist.get_rank() == 0:
        print_result({"rows": rows})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.seq_lens, args.steps)
        return
    rows = []
    for sp in args.sp:
        rows += run_ranks(__file__, sp, ["--seq-lens", *map(str, args.seq_lens),
                                         "--steps", str(args.steps)])["rows"]
    base = {r["seq"]: r for r in rows if r["sp"] == 1}
    print(f"demo GPT (2 layers, 4 heads, 128 wide), micro batch 1, ZeRO-3 fp32, dp 1; rank 0; "
          f"median of {args.steps} steps\n")
    print("| seq len | sp | tokens per rank | peak bytes (fwd+bwd) | x sp=1 | step s | "
          "all_to_all bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["seq"], r["sp"])):
        ratio = (f"{r['peak_bytes'] / base[r['seq']]['peak_bytes']:.2f}"
                 if r["seq"] in base else "-")
        print(f"| {r['seq']} | {r['sp']} | {r['seq'] // r['sp']} | {r['peak_bytes']:,} | "
              f"{ratio} | {r['step_s']:.3f} | {r['all_to_all_bytes']:,} |")


if __name__ == "__main__":
    main()
