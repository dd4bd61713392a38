"""A DeepSpeed-Chat step-3 script (RLHF actor + frozen reference) running on meshzero.

    python examples/deepspeed_chat_style.py
    torchrun --nproc-per-node 2 examples/deepspeed_chat_style.py --output_dir runs/chat

The shape of DeepSpeed-Chat's training/step3_rlhf_finetuning (rlhf_engine.py, ppo_trainer.py):
an actor engine with a FusedAdam optimizer and a torch scheduler, a reference engine built with
`deepspeed.initialize` and no optimizer at ZeRO stage 3, a custom init of the value head under
`deepspeed.zero.GatheredParameters(..., modifier_rank=0)`, a KL-penalised policy loss against
the reference's log-probs, and the ZeRO-3 save that gathers every parameter. Apart from the
import line this is a DeepSpeed script; the model is a tiny causal LM so it runs on a CPU.
"""

import meshzero.deepspeed as deepspeed  # noqa: I001 - the one changed line: import deepspeed

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, SEQ, PROMPT = 32, 32, 12, 4


class TinyCausalLM(nn.Module):
    """Embedding -> 2 MLP blocks over a causal running mean -> LM head; plus a value head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(),
                          nn.Linear(2 * DIM, DIM)) for _ in range(2))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.v_head = nn.Linear(DIM, 1, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        steps = torch.arange(1, h.shape[1] + 1, device=h.device).view(1, -1, 1)
        for block in self.blocks:
            h = h + block(h.cumsum(dim=1) / steps)  # each position sees only its past
        return self.lm_head(h), self.v_head(h).squeeze(-1)


def get_train_ds_config(micro_batch, stage=3):
    """dschat/utils/ds_utils.py: get_train_ds_config (the keys meshzero honours)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                              "offload_param": {"device": "none"},
                              "offload_optimizer": {"device": "none"}},
        "fp16": {"enabled": False},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }


def get_eval_ds_config(micro_batch, stage=3):
    """dschat/utils/ds_utils.py: get_eval_ds_config: no optimizer, sharded at stage 3."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                              "offload_param": {"device": "none"}},
        "fp16": {"enabled": False},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }


def print_rank_0(msg, rank):
    if rank <= 0:
        print(msg, flush=True)


def init_value_head(model, rank):
    """OpenRLHF / DeepSpeed-Chat critic init: rank 0 writes the head, DeepSpeed broadcasts."""
    with deepspeed.zero.GatheredParameters([model.v_head.weight], modifier_rank=0):
        if rank == 0:
            torch.manual_seed(7)
            model.v_head.weight.data.normal_(mean=0.0, std=1 / (DIM + 1))


def get_model_norm(model):
    """ppo_trainer.py: get_model_norm (gathers each partitioned parameter in turn)."""
    with torch.no_grad():
        total = 0.0
        for param in model.parameters():
            should_gather = hasattr(param, "ds_id")
            with deepspeed.zero.GatheredParameters(param, enabled=should_gather):
                total += float(param.float().norm())
    return total


def gather_log_probs(logits, labels):
    log_probs = F.log_softmax(logits, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def make_experience(step, micro_batch, rank, world, device):
    """Sequences (prompt + answer) and a reward per sequence; the same global batch on
    every rank, each rank takes its slice (generation is left out: it changes nothing here)."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, VOCAB, (micro_batch * world, SEQ), generator=g)
    reward = (seq[:, PROMPT:] % 2 == 0).float().mean(dim=1) * 2 - 1  # likes even tokens
    sl = slice(rank * micro_batch, (rank + 1) * micro_batch)
    return seq[sl].to(device), reward[sl].to(device)


def train_rlhf(actor_engine, ref_engine, args, device):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for step in range(args.steps):
        seq, reward = make_experience(step, args.per_device_train_batch_size, rank, world,
                                      device)
        with torch.no_grad():
            ref_logits, _ = ref_engine(seq)
            ref_all = F.log_softmax(ref_logits[:, :-1], dim=-1)
        logits, values = actor_engine(seq)
        log_probs = gather_log_probs(logits[:, :-1], seq[:, 1:])
        actor_all = F.log_softmax(logits[:, :-1], dim=-1)
        mask = torch.zeros_like(log_probs)
        mask[:, PROMPT - 1:] = 1.0  # only the answer tokens
        token_kl = (actor_all.exp() * (actor_all - ref_all)).sum(dim=-1)  # KL(actor || ref)
        kl = (token_kl * mask).sum(dim=1) / mask.sum(dim=1)
        advantages = reward - values[:, -1].detach()
        pg_loss = -(advantages.unsqueeze(1) * log_probs * mask).sum() / mask.sum()
        value_loss = F.mse_loss(values[:, -1], reward)
        loss = pg_loss + args.kl_ctl * kl.mean() + 0.5 * value_loss
        actor_engine.backward(loss)
        actor_engine.step()
        if actor_engine.optimizer.overflow:
            print_rank_0(f"step {step} skipped: overflow", rank)
        stats = torch.stack([loss.detach(), kl.mean().detach()])
        torch.distributed.all_reduce(stats)
        stats /= world
        print_rank_0(f"step {step} loss {stats[0].item():.6f} kl {stats[1].item():.6f}", rank)


def save_zero_three_model(model_ema, global_rank, save_dir):
    """dschat/utils/utils.py: save_zero_three_model."""
    zero_stage_3 = True
    os.makedirs(save_dir, exist_ok=True)
    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():
            if hasattr(v, "ds_id"):
                with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]),
                                                       enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict
    return output_model_file


def _z3_params_to_fetch(param_list):
    return [p for p in param_list if hasattr(p, "ds_id")]


def parse_args():
    parser = argparse.ArgumentParser(description="DeepSpeed-Chat step 3, tiny")
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--actor_learning_rate", type=float, default=1e-2)
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kl_ctl", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.local_rank == -1:
        device = torch.device(deepspeed.get_accelerator().device_name())
    else:
        deepspeed.get_accelerator().set_device(args.local_rank)
        device = torch.device(deepspeed.get_accelerator().device_name())
    deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()
    micro = args.per_device_train_batch_size

    # rlhf_engine.py: _init_actor
    torch.manual_seed(args.seed)
    actor_model = TinyCausalLM()
    optim = deepspeed.ops.adam.FusedAdam(actor_model.parameters(), lr=args.actor_learning_rate,
                                         betas=(0.9, 0.95))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / (args.num_warmup_steps + 1)))
    actor_engine, *_ = deepspeed.initialize(model=actor_model, optimizer=optim,
                                            lr_scheduler=lr_scheduler,
                                            config=get_train_ds_config(micro))
    # rlhf_engine.py: _init_ref (the same initial weights, no optimizer, ZeRO-3)
    torch.manual_seed(args.seed)
    ref_engine, *_ = deepspeed.initialize(model=TinyCausalLM(),
                                          config=get_eval_ds_config(micro))
    ref_engine.eval()
    for engine in (actor_engine, ref_engine):
        init_value_head(engine.module, args.global_rank)
        with deepspeed.zero.GatheredParameters([engine.module.v_head.weight]):
            head = engine.module.v_head.weight.detach().float()
            # one write per line: the ranks share the pipe
            sys.stdout.write(f"value head on rank {args.global_rank}: norm "
                             f"{float(head.norm()):.8f}\n")
            sys.stdout.flush()

    ref_norm = get_model_norm(ref_engine.module)
    print_rank_0(f"actor lr {actor_engine.get_lr()[0]:.6f} "
                 f"zero stage {actor_engine.zero_optimization_stage()}", args.global_rank)
    train_rlhf(actor_engine, ref_engine, args, device)
    ref_norm_end = get_model_norm(ref_engine.module)
    actor_norm = get_model_norm(actor_engine.module)
    print_rank_0(f"reference unchanged {math.isclose(ref_norm, ref_norm_end)} "
                 f"actor norm {actor_norm:.6f} ref norm {ref_norm_end:.6f}", args.global_rank)
    if args.output_dir is not None:
        path = save_zero_three_model(actor_engine, args.global_rank,
                                     os.path.join(args.output_dir, "actor"))
        print_rank_0(f"saved {path}", args.global_rank)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
