"""A Megatron-DeepSpeed pretraining script (pretrain_gpt.py's shape) running on meshzero.

    torchrun --nproc-per-node 2 examples/megatron_style.py --train-iters 6 --save runs/gpt \\
        --save-interval 3 --checkpoint-activations
    torchrun --nproc-per-node 2 examples/megatron_style.py --train-iters 6 --load runs/gpt \\
        --load-tag iter_0000003 --checkpoint-activations     # resumes at iteration 3

What Megatron-DeepSpeed does with DeepSpeed (megatron/arguments.py, initialize.py,
training.py, checkpointing.py, core/tensor_parallel/random.py): `deepspeed.init_distributed()`,
`parser = deepspeed.add_config_arguments(parser)`, `deepspeed.checkpointing.configure(...)` and
its RNG tracker, `deepspeed.checkpointing.checkpoint(...)` around the transformer layers,
`deepspeed.initialize(args=args, model=..., model_parameters=...)` with the config named by
`--deepspeed_config`, `model.backward` / `model.step`, and `save_checkpoint` /
`load_checkpoint` carrying Megatron's client state (iteration, args, RNG states). Apart from the
import line this is a DeepSpeed script; the GPT is tiny so it runs on a CPU.
"""

import meshzero.deepspeed as deepspeed  # noqa: I001 - the one changed line: import deepspeed

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_CONFIG = Path(__file__).with_name("megatron_style.json")


def get_args():
    """megatron/arguments.py: parse_args (a few of Megatron's flags) + DeepSpeed's."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    group = parser.add_argument_group(title="model and training")
    group.add_argument("--num-layers", type=int, default=3)
    group.add_argument("--hidden-size", type=int, default=32)
    group.add_argument("--num-attention-heads", type=int, default=4)
    group.add_argument("--seq-length", type=int, default=16)
    group.add_argument("--padded-vocab-size", type=int, default=64)
    group.add_argument("--micro-batch-size", type=int, default=4)
    group.add_argument("--train-iters", type=int, default=6)
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--checkpoint-activations", action="store_true")
    group.add_argument("--partition-activations", action="store_true")
    group.add_argument("--save", type=str, default=None)
    group.add_argument("--save-interval", type=int, default=None)
    group.add_argument("--load", type=str, default=None)
    group.add_argument("--load-tag", type=str, default=None)
    group.add_argument("--local_rank", type=int, default=None)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if args.deepspeed_config is None:
        args.deepspeed_config = str(DEFAULT_CONFIG)
    return args


def _create_ds_config_dict(args):
    """training.py: since DeepSpeed 0.9 initialize() refuses a config path in args together
    with a config dict, so Megatron reads the file and clears the path."""
    with open(args.deepspeed_config, encoding="utf-8") as config_file:
        ds_config_dict = json.load(config_file)
    args.deepspeed_config = None
    return ds_config_dict


def initialize_megatron(args):
    """megatron/initialize.py: _initialize_distributed, _set_random_seed,
    setup_deepspeed_random_and_activation_checkpointing."""
    deepspeed.init_distributed()
    args.rank = torch.distributed.get_rank()
    args.world_size = torch.distributed.get_world_size()
    deepspeed.checkpointing.configure(
        None,  # mpu: no tensor parallelism here
        deepspeed_config=args.deepspeed_config,
        partition_activations=args.partition_activations,
        contiguous_checkpointing=False,
        num_checkpoints=args.num_layers,
        checkpoint_in_cpu=False,
        synchronize=False,
        profile=False,
    )
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(args.seed)


class ParallelTransformerLayer(nn.Module):
    """Pre-LN causal self-attention + MLP; dropout under the model-parallel RNG tracker."""

    def __init__(self, args):
        super().__init__()
        h = args.hidden_size
        self.heads = args.num_attention_heads
        self.input_layernorm = nn.LayerNorm(h)
        self.query_key_value = nn.Linear(h, 3 * h)
        self.dense = nn.Linear(h, h)
        self.post_attention_layernorm = nn.LayerNorm(h)
        self.dense_h_to_4h = nn.Linear(h, 4 * h)
        self.dense_4h_to_h = nn.Linear(4 * h, h)
        self.dropout = args.hidden_dropout

    def forward(self, x):
        b, s, h = x.shape
        qkv = self.query_key_value(self.input_layernorm(x))
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2)
                   for t in qkv.chunk(3, dim=-1))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = self.dense(attn.transpose(1, 2).reshape(b, s, h))
        with deepspeed.checkpointing.get_cuda_rng_tracker().fork():
            out = F.dropout(out, self.dropout, self.training)
        x = x + out
        return x + self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(self.post_attention_layernorm(x))))


class GPTModel(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.checkpoint_activations = args.checkpoint_activations
        self.word_embeddings = nn.Embedding(args.padded_vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.seq_length, args.hidden_size)
        self.layers = nn.ModuleList(ParallelTransformerLayer(args)
                                    for _ in range(args.num_layers))
        self.final_layernorm = nn.LayerNorm(args.hidden_size)
        for emb in (self.word_embeddings, self.position_embeddings):  # init_method_normal
            nn.init.normal_(emb.weight, mean=0.0, std=0.02)

    def forward(self, tokens, labels):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word_embeddings(tokens) + self.position_embeddings(pos)
        for layer in self.layers:
            if self.checkpoint_activations:  # transformer.py: _checkpointed_forward
                x = deepspeed.checkpointing.checkpoint(layer, x)
            else:
                x = layer(x)
        logits = F.linear(self.final_layernorm(x), self.word_embeddings.weight)  # tied
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def get_params_for_weight_decay_optimization(module, weight_decay):
    """megatron/optimizer/__init__.py: no decay for biases and LayerNorm."""
    decay, no_decay = [], []
    for m in module.modules():
        for name, p in m.named_parameters(recurse=False):
            (no_decay if isinstance(m, nn.LayerNorm) or name == "bias" else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def get_batch(iteration, args):
    """The same global batch on every rank; each data-parallel rank takes its slice."""
    g = torch.Generator().manual_seed(10_000 + iteration)
    n = args.micro_batch_size * args.world_size
    text = torch.randint(0, args.padded_vocab_size, (n, args.seq_length + 1), generator=g)
    text[:, 1::2] = (text[:, 0::2][:, :text[:, 1::2].shape[1]] + 1) % args.padded_vocab_size
    mine = text[args.rank * args.micro_batch_size:(args.rank + 1) * args.micro_batch_size]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def save_checkpoint(iteration, model, args):
    """megatron/checkpointing.py: save_checkpoint (the DeepSpeed branch)."""
    state_dict = {
        "iteration": iteration,
        "args": argparse.Namespace(**{k: v for k, v in vars(args).items()
                                      if k != "deepspeed_config_dict"}),
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": deepspeed.checkpointing.get_cuda_rng_tracker().get_states(),
    }
    model.save_checkpoint(args.save, tag=f"iter_{iteration:07d}", client_state=state_dict)
    if args.rank == 0:
        print(f"saved checkpoint at iteration {iteration:7d} to {args.save}", flush=True)


def load_checkpoint(model, args):
    """megatron/checkpointing.py: load_checkpoint; returns the iteration to resume from."""
    _, state_dict = model.load_checkpoint(args.load, args.load_tag)
    if state_dict is None:
        raise RuntimeError(f"no checkpoint in {args.load}")
    random.setstate(state_dict["random_rng_state"])
    np.random.set_state(state_dict["np_rng_state"])
    torch.set_rng_state(state_dict["torch_rng_state"])
    deepspeed.checkpointing.get_cuda_rng_tracker().set_states(state_dict["rng_tracker_states"])
    assert state_dict["args"].num_layers == args.num_layers
    if args.rank == 0:
        print(f"loaded checkpoint at iteration {state_dict['iteration']}", flush=True)
    return state_dict["iteration"]


def main():
    args = get_args()
    initialize_megatron(args)
    args.deepspeed_config_dict = _create_ds_config_dict(args)
    model = GPTModel(args)
    param_groups = get_params_for_weight_decay_optimization(model, args.weight_decay)
    # training.py: setup_model_and_optimizer (the DeepSpeed branch)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=param_groups, args=args, config=args.deepspeed_config_dict)
    iteration = load_checkpoint(model, args) if args.load else 0
    model.train()
    while iteration < args.train_iters:
        tokens, labels = get_batch(iteration, args)
        loss = model(tokens, labels)
        model.backward(loss)
        model.step()
        iteration += 1
        reduced = loss.detach().clone()
        torch.distributed.all_reduce(reduced)
        if args.rank == 0:
            print(f"iteration {iteration:7d} | lm loss {reduced.item() / args.world_size:.6E} | "
                  f"learning rate {model.get_lr()[0]:.3E}", flush=True)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(iteration, model, args)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
