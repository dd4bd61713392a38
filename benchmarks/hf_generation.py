"""Tokens per second of ``model.generate`` on a ZeRO-3 engine: parameters gathered once for
the generation vs gathered unit by unit per token (meshzero.hf.generation), 2 ranks on gloo,
one CPU thread each, a Llama built from a config, greedy decoding.

    python benchmarks/hf_generation.py                     # the defaults below
    python benchmarks/hf_generation.py --layers 8 --hidden 512 --new-tokens 64

Each arm runs ``--repeats`` generate calls after one warm-up call; rank 0 reports the median
seconds per call, tokens per second (new tokens x batch x ranks / seconds), and the
all-gathers per call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def worker(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from _torchrun import print_result

    import meshzero
    from meshzero.hf.generation import wrap_generate

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128), vocab_size=args.vocab,
        max_position_embeddings=args.prompt + args.new_tokens)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ds = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = meshzero.initialize(model=model, config=ds)
    rank = engine.topology.rank
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(rank))
    result: dict = {"params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                    "units": len(engine.zero.sharder.units)}
    for mode in ("once", "per_unit"):
        wrap_generate(engine, gather=mode == "once")
        times, gathers = [], 0
        for i in range(args.repeats + 1):
            engine.comm_stats.reset()
            t0 = time.perf_counter()
            engine.module.generate(prompts, max_new_tokens=args.new_tokens, do_sample=False,
                                   min_new_tokens=args.new_tokens, pad_token_id=0)
            if i:  # the first call warms up
                times.append(time.perf_counter() - t0)
                gathers = engine.comm_stats.by_op().get("all_gather", {}).get("count", 0)
        seconds = statistics.median(times)
        tokens = args.new_tokens * args.batch * engine.topology.world_size
        result[mode] = {"seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1),
                        "all_gathers": gathers}
    result["speedup"] = round(result["per_unit"]["seconds"] / result["once"]["seconds"], 2)
    if rank == 0:
        print_result(result)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2, help="prompts per rank")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from _torchrun import run_ranks

    forwarded = [a for a in sys.argv[1:] if a != "--worker"]
    result = run_ranks(os.path.abspath(__file__), args.ranks, forwarded)
    print(f"Llama {result['params_m']} M params, {result['units']} units, {args.ranks} ranks, "
          f"{args.batch} prompts/rank, {args.new_tokens} new tokens")
    for mode in ("once", "per_unit"):
        r = result[mode]
        print(f"  {mode:9s} {r['seconds']:.3f} s/generate  {r['tokens_per_s']:8.1f} tokens/s  "
              f"{r['all_gathers']} all-gathers")
    print(f"  gathered once is {result['speedup']}x faster")


if __name__ == "__main__":
    main()
