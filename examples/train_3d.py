"""3D parallelism: pipeline stages across nodes, tensor parallelism inside each node, ZeRO
over the data-parallel rest.

    # one machine, 8 ranks pretending to be 4 nodes of 2 (topology.ranks_per_node = 2)
    torchrun --nproc-per-node 8 examples/train_3d.py --nodes 4 --pp 4 --tp 2
    # a real cluster of 4 nodes x 8 GPUs: pp 4 (a node each), tp 4 and dp 2 inside a node
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_3d.py --nodes 4 --pp 4 --tp 4

Trains the byte-level demo GPT on random tokens; rank 0 prints the mesh map (from
``initialize``), the loss, and the step's communication split inside / across nodes.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import meshzero
from meshzero.demo.gpt import GPT, GPTConfig, loss_fn
from meshzero.demo.layout import GPT_LAYOUT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // (args.pp * args.tp)
    micro, micro_batches = 2, 4
    config = {
        "train_batch_size": micro * micro_batches * dp,
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"size": args.tp, "plan": "gpt"},
        "pipeline_parallel": {"size": args.pp, "schedule": "1f1b",
                              "micro_batches": micro_batches},
        "topology": {"ranks_per_node": world // args.nodes},
        "seed": 0,
    }
    gpt = GPTConfig(vocab_size=256, block_size=32, n_layer=2 * args.pp, n_head=4, n_embd=64)
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (micro, gpt.block_size))
    engine, *_ = meshzero.initialize(model=GPT(gpt), config=config, loss_fn=loss_fn,
                                     example_inputs=tokens, pipeline_layout=GPT_LAYOUT)
    gen = torch.Generator().manual_seed(engine.topology.dp_rank)
    for step in range(args.steps):
        batch = [(torch.randint(0, 256, (micro, gpt.block_size), generator=gen),
                  torch.randint(0, 256, (micro, gpt.block_size), generator=gen))
                 for _ in range(micro_batches)]
        loss = engine.train_batch(iter(batch))
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if dist.get_rank() == 0:
        for op, v in engine.comm_report().items():
            print(f"{op:15s} inside nodes {v['intra_node_bytes']:>10,} B   across nodes "
                  f"{v['inter_node_bytes']:>10,} B")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
