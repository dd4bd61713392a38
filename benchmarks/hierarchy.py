"""Bytes sent inside and across nodes by ZeRO-3, with hpZ and with MiCS.

    python benchmarks/hierarchy.py [--nproc 4] [--ranks-per-node 2]

Runs the demo GPT (4 layers, width 128, 834,304 parameters, fp32 AdamW) on ``--nproc`` local
ranks under torchrun, pretending they are nodes of ``--ranks-per-node`` ranks
(``topology.ranks_per_node``), three times: plain ZeRO-3, ZeRO-3 with
``zero_hpz_partition_size`` = ranks per node, and ``mics_shard_size`` = ranks per node
instead. For each, rank 0's ``comm_report()`` of its second step split by phase and by
inside / across nodes, the gradient bytes it holds and its peak of gathered parameters.
Persistence is off (``stage3_param_persistence_threshold: 0``): every parameter is sharded
and gathered.
"""

from __future__ import annotations

import argparse
import os

import torch
from _torchrun import print_result, run_ranks

CONFIGS = {
    "ZeRO-3": {},
    "+ `zero_hpz_partition_size: {k}`": {"zero_hpz_partition_size": "k"},
    "`mics_shard_size: {k}` instead": {"mics_shard_size": "k"},
}


def worker(args: argparse.Namespace) -> None:
    import meshzero
    from meshzero.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_embd=128, block_size=64))
    world = int(os.environ["WORLD_SIZE"])
    # every tensor of this small model is under the default persistence threshold (1e5):
    # 0 makes ZeRO-3 shard and gather them all
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
            **{k: args.k for k in CONFIGS[args.config]}}
    config = {"train_batch_size": 2 * world, "optimizer": {"type": "AdamW"},
              "zero_optimization": zero, "topology": {"ranks_per_node": args.k}}
    engine, *_ = meshzero.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(engine.topology.dp_rank)
    for _ in range(2):
        x = torch.randint(0, 256, (2, 64), generator=gen)
        logits = engine(x)
        engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()))
        engine.step()
    if torch.distributed.get_rank() == 0:
        memory = engine.memory_report()
        print_result({"psi": sum(p.numel() for p in model.parameters()),
                      "comm": engine.comm_report(), "grads": memory["grads"]["device"],
                      "gathered_peak": memory["gathered_params_peak"]})
    torch.distributed.destroy_process_group()


def _split(comm: dict, op: str, phase: str | None = None) -> str:
    entry = comm.get(op)
    if entry is None:
        return "-"
    if phase is not None:
        entry = entry["phases"].get(phase, {"intra_node_bytes": 0, "inter_node_bytes": 0})
    return f"{entry['intra_node_bytes']:,} / {entry['inter_node_bytes']:,}"


def run(args: argparse.Namespace) -> None:
    rows = ["| config | all-gather forward: inside / across | all-gather backward: inside / "
            "across | reduce-scatter: inside / across | all-reduce: inside / across | "
            "grads held | gathered peak |", "|---|---|---|---|---|---|---|"]
    for label in CONFIGS:
        r = run_ranks(__file__, args.nproc, ["--config", label, "--k", str(args.k)])
        c = r["comm"]
        rows.append(f"| {label.format(k=args.k)} | {_split(c, 'all_gather', 'forward')} | "
                    f"{_split(c, 'all_gather', 'backward')} | {_split(c, 'reduce_scatter')} | "
                    f"{_split(c, 'all_reduce')} | {r['grads']:,} B | {r['gathered_peak']:,} B |")
    print(f"{args.nproc} ranks as nodes of {args.k}, ZeRO-3, demo GPT of {r['psi']:,} "
          "parameters, fp32; bytes rank 0 sent in its second step\n")
    print("\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--ranks-per-node", dest="k", type=int, default=2)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=list(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else run(args)


if __name__ == "__main__":
    main()
