"""Tiny models, deterministic data and an independent plain-torch reference.

Batch convention (DeepSpeed data parallelism), used by every equivalence test:
the global batch of G = micro * grad_accum * world_size samples is cut first into
world_size contiguous rank chunks of micro * grad_accum samples; inside its chunk,
rank r at micro step m takes the m-th contiguous micro-batch (``split_for_rank``).

The reference runs on one process: at world_size 1 the same rule cuts the global batch
into grad_accum contiguous micro-batches of G / grad_accum samples. Those micro-batches
are not the ones the ranks see, but every micro-batch on every rank has the same size,
so the mean of the per-micro-batch mean losses (each divided by grad_accum, gradients
averaged over ranks) is the mean over the whole global batch in both runs: the global
gradient is identical up to floating-point summation order.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

Batch = tuple[torch.Tensor, torch.Tensor]


class Block(nn.Module):
    """Pre-norm residual MLP block: x + W2 gelu(W1 LN(x))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    """Linear(in_dim, dim) -> num_blocks x Block -> Linear(dim, out).

    Defaults: 2733 parameters (odd). The root's own params (input + head) are 213 (odd);
    each Block is 3*dim + 2*dim*hidden + hidden = 840 parameters; pass an odd hidden
    (e.g. 23 -> 807) to make every block need padding too.
    """

    def __init__(
        self, dim: int = 16, hidden: int = 24, num_blocks: int = 3, out: int = 5, in_dim: int = 7
    ) -> None:
        super().__init__()
        self.input = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(num_blocks))
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in_dim) -> (B, out)
        h = self.input(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class TrickyModel(nn.Module):
    """Every case ZeRO bookkeeping gets wrong, in ~2 K parameters.

    - ``head.weight`` is tied to ``embed.weight`` (one tensor, listed once as embed.weight);
    - ``frozen`` has requires_grad=False;
    - ``unused`` is a Linear never called in forward (its grads stay None in plain torch);
    - ``blocks[0]`` runs twice per forward, the second time after the other blocks;
    - ``scale`` is a registered buffer used in forward;
    - blocks have 3*12 + 2*12*17 + 17 = 461 parameters (odd) each.
    """

    def __init__(
        self, vocab: int = 29, dim: int = 12, hidden: int = 17, num_blocks: int = 3
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=0.3)  # N(0, 1) logits would start too peaked
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(dim, 7)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(num_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.embed.weight  # tied: (vocab, dim) both ways
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) int -> (B, T, vocab)
        h = self.embed(tokens) * self.scale  # (B, T, dim)
        h = h + self.frozen(h)
        for block in self.blocks:
            h = block(h)
        h = self.blocks[0](h)  # module called twice, not back to back
        return self.head(self.norm(h))


MODEL_KINDS: dict[str, type[nn.Module]] = {"mlp": MLPStack, "tricky": TrickyModel}


def build_model(kind: str, seed: int = 0) -> nn.Module:
    """A fresh model of this kind, identical for the same seed on every process."""
    torch.manual_seed(seed)
    return MODEL_KINDS[kind]()


def mlp_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def tricky_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # (B, T, vocab), (B, T) -> mean cross-entropy over the B*T tokens
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


LOSS_FNS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mlp": mlp_loss,
    "tricky": tricky_loss,
}


def loss_fn_for(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return tricky_loss if isinstance(model, TrickyModel) else mlp_loss


def make_batches(
    model_kind: str,
    num_steps: int,
    global_batch: int,
    seed: int = 0,
    *,
    in_dim: int = 7,
    out: int = 5,
    vocab: int = 29,
    seq_len: int = 6,
) -> list[Batch]:
    """num_steps learnable (inputs, targets) global batches, same for the same arguments.

    mlp: x (G, in_dim) float, y = sin(x @ A) @ B + noise (G, out).
    tricky: tokens (G, seq_len) int64, target = (7 * token + 3) mod vocab (per token).
    """
    gen = torch.Generator().manual_seed(seed)
    if model_kind == "mlp":
        a = torch.randn(in_dim, 11, generator=gen) / in_dim**0.5
        b = torch.randn(11, out, generator=gen) / 11**0.5
        batches = []
        for _ in range(num_steps):
            x = torch.randn(global_batch, in_dim, generator=gen)
            y = torch.sin(x @ a) @ b + 0.01 * torch.randn(global_batch, out, generator=gen)
            batches.append((x, y))
        return batches
    if model_kind == "tricky":
        batches = []
        for _ in range(num_steps):
            tokens = torch.randint(0, vocab, (global_batch, seq_len), generator=gen)
            batches.append((tokens, (7 * tokens + 3) % vocab))
        return batches
    raise ValueError(f"unknown model_kind {model_kind!r}; expected one of {list(MODEL_KINDS)}")


def split_for_rank(
    batch: Batch, rank: int, world_size: int, grad_accum: int, micro_index: int
) -> Batch:
    """The micro-batch rank processes at micro step micro_index (see the module docstring)."""
    inputs, targets = batch
    size = inputs.shape[0]
    if size % (world_size * grad_accum):
        raise ValueError(
            f"global batch {size} is not divisible by world_size {world_size} "
            f"x grad_accum {grad_accum}"
        )
    if not (0 <= rank < world_size and 0 <= micro_index < grad_accum):
        raise ValueError(f"rank {rank} / micro_index {micro_index} out of range")
    micro = size // (world_size * grad_accum)
    start = rank * micro * grad_accum + micro_index * micro
    return inputs[start : start + micro], targets[start : start + micro]


@dataclass
class ReferenceResult:
    params: dict[str, torch.Tensor]  # named_parameters() after the last step (tied once)
    losses: list[float]  # global mean loss of each optimizer step, before its update
    grad_norms: list[float]  # global grad L2 norm of each step, before clipping


def reference_train(
    model_factory: Callable[[], nn.Module],
    batches: list[Batch],
    *,
    optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] = "AdamW",
    lr: float = 1e-2,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    momentum: float = 0.0,
    grad_accum: int = 1,
    clip: float = 0.0,
    dtype: torch.dtype = torch.float32,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    zero_unused_grads: bool = True,
) -> ReferenceResult:
    """Train model_factory() on one process with plain torch and return the result.

    Per step: grad_accum in-order micro-batches, loss / grad_accum, backward; optional
    clip_grad_norm_; optimizer.step() (foreach=False, fused=False); zero_grad.

    zero_unused_grads: trainable params that got no gradient (unused in forward) get a
    zero one before the step, as in ZeRO's flat grad buffers, so weight decay and the
    step count still apply to them; False keeps torch's skip-if-None behaviour.

    dtype other than float32: mixed precision as ZeRO does it: an fp32 master model is
    the truth; forward/backward run on a ``dtype`` copy refreshed from it each step
    (float inputs cast to dtype, loss in fp32); gradients accumulate in fp32.
    """
    master = model_factory()
    loss_fn = loss_fn or loss_fn_for(master)
    trainable = [p for p in master.parameters() if p.requires_grad]
    opt = _make_optimizer(
        optimizer,
        trainable,
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        momentum=momentum,
    )
    compute = master if dtype == torch.float32 else copy.deepcopy(master).to(dtype)
    losses: list[float] = []
    grad_norms: list[float] = []
    for batch in batches:
        if compute is not master:
            with torch.no_grad():
                for p_c, p_m in zip(compute.parameters(), master.parameters(), strict=True):
                    p_c.copy_(p_m)
        step_loss = 0.0
        for micro_index in range(grad_accum):
            x, y = split_for_rank(batch, 0, 1, grad_accum, micro_index)
            if x.is_floating_point():
                x = x.to(dtype)
            loss = loss_fn(compute(x).float(), y) / grad_accum
            loss.backward()
            step_loss += loss.item()
            if compute is not master:
                _accumulate_into_master(compute, master)
        if zero_unused_grads:
            for p in trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        grads = [p.grad for p in trainable if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        grad_norms.append(norm.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, clip, foreach=False)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
    params = {name: p.detach().clone() for name, p in master.named_parameters()}
    return ReferenceResult(params=params, losses=losses, grad_norms=grad_norms)


def _accumulate_into_master(compute: nn.Module, master: nn.Module) -> None:
    """Add one micro-batch's low-precision grads into the fp32 master grads."""
    for p_c, p_m in zip(compute.parameters(), master.parameters(), strict=True):
        if p_c.grad is not None:
            grad = p_c.grad.float()
            p_m.grad = grad if p_m.grad is None else p_m.grad.add_(grad)
            p_c.grad = None


def _make_optimizer(
    name: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    params: list[nn.Parameter],
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    momentum: float,
) -> torch.optim.Optimizer:
    plain = {"foreach": False, "fused": False}
    if callable(name):  # a test's own reference optimizer: params -> Optimizer
        return name(params)
    if name in ("AdamW", "Adam"):
        cls = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
        return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **plain)
    if name == "SGD":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **plain)
    raise ValueError(f"unknown optimizer {name!r}; expected AdamW, Adam or SGD")
