"""Ulysses sequence parallelism: each rank of an sp group holds 1/sp of every sequence.

Outside attention every op is per token, so it runs on the local chunk as it is. Around
the attention core an all-to-all swaps the sequence shard for a head shard: rank r then
holds the whole sequence for heads ``[r H/sp, (r+1) H/sp)`` and attends over all positions;
a second all-to-all swaps back. Both are autograd functions whose backward is the reverse
all-to-all, the exact adjoint.

    q, k, v (B, H, T/sp, D) --seq->heads--> (B, H/sp, T, D) --attention--> (B, H/sp, T, D)
        --heads->seq--> (B, H, T/sp, D)

Grouped-query attention: kv heads split like the query heads when sp divides them; fewer
kv heads than sp are replicated up to sp (sp must be a multiple), so rank r's query heads
still meet their own kv head. How the attention is reached without changing model code:
``F.scaled_dot_product_attention`` calls inside the forward (all of them, or only inside the
modules a plan names) are routed here by a ``TorchFunctionMode``; Hugging Face models use
the attention function ``meshzero_ulysses`` (``sequence_hf.py``); or call :meth:`sdpa`.

Data (:meth:`SequenceParallel.run`): every rank of an sp group may pass the same full
micro-batch; the rank keeps its chunk ``[r T/sp, (r+1) T/sp)`` of every (B, T, ...) input and
gets ``position_ids`` of those positions. Inputs that come with ``position_ids`` are taken as
already sharded. The loss (:meth:`loss`, :meth:`token_mean`) is the full-sequence mean,
token-weighted across the group (a Hugging Face loss divided by a given
``num_items_in_batch``: the sum over the group); its backward is the adjoint of the sum it
takes, so with ZeRO averaging gradients over dp x sp the update is that of the full
sequences.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from meshzero.comm.stats import OnComm, failure_named, ring_bytes, tensor_bytes
from meshzero.parallel.sequence_hf import active

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # labels that count no token (Hugging Face's and cross_entropy's default)


class _AllToAll(torch.autograd.Function):
    """Split dim ``scatter`` into sp pieces, send piece j to rank j, concatenate what arrives
    along dim ``gather``; backward: the same with the two dims swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter: int, gather: int,  # type: ignore[override]
                sp: SequenceParallel) -> torch.Tensor:
        ctx.dims, ctx.sp = (scatter, gather), sp
        return sp.exchange(x, scatter, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        scatter, gather = ctx.dims
        return ctx.sp.exchange(grad, gather, scatter), None, None, None


class _GroupSum(torch.autograd.Function):
    """``sum_r x_r`` over the sp group, on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:  # type: ignore[override]
        ctx.sp = sp
        return sp.all_reduce(x.detach().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.sp.all_reduce(grad.detach().clone()), None


class _TokenMean(torch.autograd.Function):
    """``sum_r count_r * mean_r / sum_r count_r`` over the sp group, on every rank."""

    @staticmethod
    def forward(ctx, mean: torch.Tensor, count: torch.Tensor,  # type: ignore[override]
                sp: SequenceParallel) -> torch.Tensor:
        count = count.to(torch.float64)
        # a rank with no counted token may hold a NaN mean (0 / 0): it weighs nothing
        part = torch.where(count > 0, mean.detach().to(torch.float64) * count, 0.0)
        sums = sp.all_reduce(torch.stack([part, count]))
        ctx.sp, ctx.weight = sp, (count / sums[1]).to(mean.dtype)
        return (sums[0] / sums[1]).to(mean.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        # every rank holds the same output: the adjoint of the all-reduce sums their grads
        total = ctx.sp.all_reduce(grad.detach().clone())
        return total * ctx.weight, None, None


@dataclass
class SequenceParallel:
    """This rank's sp group and what Ulysses needs of it; the engine's ``sequence_parallel``."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    comm_dtype: torch.dtype | None = None  # seq_parallel_communication_data_type
    on_comm: OnComm | None = None  # counts the all-to-all (and the loss's all-reduce) bytes
    # route every F.scaled_dot_product_attention of the forward (False: a plan's modules
    # route it, or a Hugging Face model's attention function calls Ulysses itself)
    routes_sdpa: bool = True
    full_length: int | None = field(default=None, init=False)  # T of the last micro-batch
    local_tokens: int = field(default=0, init=False)  # B * T/sp of the last micro-batch
    _inside: bool = field(default=False, init=False, repr=False)
    _checked: bool = field(default=False, init=False, repr=False)  # same batch on every rank
    _calls: list[str] = field(default_factory=list, init=False, repr=False)  # modules running

    # -- communication -----------------------------------------------------------------------
    def exchange(self, x: torch.Tensor, scatter: int, gather: int) -> torch.Tensor:
        """The all-to-all itself (no autograd): ``x`` split along ``scatter``, gathered along
        ``gather``, sent in ``comm_dtype`` when one is set."""
        wire = x if self.comm_dtype is None else x.to(self.comm_dtype)
        send = torch.stack(wire.chunk(self.size, dim=scatter)).contiguous()  # (sp, ...)
        recv = torch.empty_like(send)
        with failure_named("all_to_all", "sp"):
            dist.all_to_all_single(recv, send, group=self.group)
        if self.on_comm is not None:  # this rank keeps its own piece: B (sp-1)/sp sent
            self.on_comm("all_to_all", ring_bytes("all_to_all", tensor_bytes(send), self.size))
        return torch.cat(recv.unbind(0), dim=gather).to(x.dtype)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (same shape on all), concatenated along dim 0 in rank order."""
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                          device=t.device)
        with failure_named("all_gather", "sp"):
            dist.all_gather_into_tensor(out, t.contiguous(), group=self.group)
        if self.on_comm is not None:
            self.on_comm("all_gather", ring_bytes("all_gather", tensor_bytes(out), self.size))
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        with failure_named("all_reduce", "sp"):
            dist.all_reduce(t, group=self.group)
        if self.on_comm is not None:
            self.on_comm("all_reduce", ring_bytes("all_reduce", tensor_bytes(t), self.size))
        return t

    # -- attention ---------------------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                  where: str = "attention") -> torch.Tensor:
        """``attend`` over the full sequence on this rank's heads: q (B, H, T/sp, D), k and v
        (B, Hkv, T/sp, D) -> (B, H, T/sp, D). ``attend`` gets (B, H/sp, T, D) queries and
        (B, max(Hkv, sp)/sp, T, D) keys and values. ``where`` names the module in errors."""
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads % self.size:
            raise ValueError(f"{where}: {heads} attention heads are not divisible by "
                             f"sequence_parallel_size {self.size}; valid: a size dividing "
                             f"{heads}")
        if kv_heads % self.size:
            if self.size % kv_heads:
                raise ValueError(f"{where}: {kv_heads} key/value heads can be neither split "
                                 f"over nor replicated to sequence_parallel_size {self.size}; "
                                 f"valid: a size that divides {kv_heads} or is a multiple of it")
            # (B, Hkv, c, D) -> (B, sp, c, D): rank r then holds kv head r * Hkv / sp
            k, v = (t.repeat_interleave(self.size // kv_heads, dim=1) for t in (k, v))
        q, k, v = (_AllToAll.apply(t, 1, 2, self) for t in (q, k, v))
        out = attend(q, k, v)  # (B, H/sp, T, D)
        return _AllToAll.apply(out, 2, 1, self)

    def sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
             where: str = "scaled_dot_product_attention") -> torch.Tensor:
        """``F.scaled_dot_product_attention`` over the whole sequence, on sequence shards:
        a drop-in for it inside the model (no ``attn_mask``: causal or full attention)."""
        if attn_mask is not None:
            raise ValueError(f"{where}: an attn_mask under sequence_parallel_size "
                             f"{self.size} is not supported (each rank holds a sequence "
                             "shard); use is_causal, and labels -100 on padding")

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa or q.shape[1] != k.shape[1])

        return self.attention(query, key, value, attend, where)

    @contextlib.contextmanager
    def routing(self, where: str | None = None) -> Iterator[None]:
        """Inside: every ``F.scaled_dot_product_attention`` call goes through :meth:`sdpa`
        (errors name ``where``, else the innermost module :meth:`name_modules` saw run)."""
        with _RouteSDPA(self, where):
            yield

    def name_modules(self, model: nn.Module) -> list[Any]:
        """Hooks that keep the qualified names of ``model``'s running modules, so that an
        attention shape sp cannot split is an error naming its module; returns them."""
        calls = self._calls

        def leave(*_: Any) -> None:  # a hook's return value would replace the output
            calls.pop()

        hooks = []
        for name, sub in model.named_modules():
            def enter(*_: Any, name: str = name or type(model).__name__) -> None:
                calls.append(name)

            hooks += [sub.register_forward_pre_hook(enter),
                      sub.register_forward_hook(leave, always_call=True)]
        return hooks

    # -- data --------------------------------------------------------------------------------
    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunk of a full-sequence tensor along ``dim``."""
        length = t.shape[dim]
        if length % self.size:
            raise ValueError(f"sequence length {length} is not divisible by "
                             f"sequence_parallel_size {self.size}; pad the sequences to a "
                             f"multiple of {self.size} (labels -100 on the padding)")
        chunk = length // self.size
        return t.narrow(dim, self.rank * chunk, chunk).contiguous()

    def run(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """``module(*args, **kwargs)`` on this rank's sequence chunk, attention routed through
        Ulysses; a Hugging Face output's ``loss`` becomes the full-sequence mean."""
        args, kwargs, counted = self.shard_inputs(module, args, kwargs)
        with contextlib.ExitStack() as stack:
            stack.enter_context(active(self))  # Hugging Face models' attention function
            if self.routes_sdpa:
                stack.enter_context(self.routing())
            out = module(*args, **kwargs)
        loss = out.get("loss") if isinstance(out, dict) else None  # ModelOutput is a dict
        if isinstance(loss, torch.Tensor) and kwargs.get("num_items_in_batch") is not None:
            # the model divided its sum by the caller's token count: the sums add up
            out["loss"] = _GroupSum.apply(loss, self)
        elif isinstance(loss, torch.Tensor) and counted is not None:
            out["loss"] = self.token_mean(loss, counted)
        return out

    def shard_inputs(self, module: nn.Module, args: tuple, kwargs: dict
                     ) -> tuple[tuple, dict, torch.Tensor | None]:
        """(args, kwargs, number of counted labels or None) for this rank's chunk."""
        if kwargs.get("position_ids") is not None:  # the caller sharded the inputs
            first = _first_sequence(args, kwargs)
            self.full_length = None if first is None else first.shape[1] * self.size
            self.local_tokens = 0 if first is None else first.shape[0] * first.shape[1]
            return args, kwargs, None
        first = _first_sequence(args, kwargs)
        if first is None:
            raise ValueError("sequence parallelism found no (batch, sequence) tensor in the "
                             "forward's inputs to split")
        batch, length = first.shape[0], first.shape[1]
        if not self._checked and dist.is_initialized():
            self._check_same_batch(first)
        kwargs = dict(kwargs)
        if _causal_mask_suffices(kwargs.get("attention_mask")):
            kwargs["attention_mask"] = None
        counted = None
        params = inspect.signature(module.forward).parameters
        takes_shift = "shift_labels" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if isinstance(kwargs.get("labels"), torch.Tensor) and takes_shift:
            # Hugging Face shifts labels inside its loss; shift before cutting, so the last
            # position of a chunk predicts the first token of the next
            shifted = F.pad(kwargs["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
            kwargs["shift_labels"] = shifted
        cut = lambda t: (self.shard(t) if isinstance(t, torch.Tensor) and t.dim() >= 2  # noqa: E731
                         and t.shape[1] == length else t)
        args = tuple(cut(a) for a in args)
        kwargs = {k: cut(v) for k, v in kwargs.items()}
        if "shift_labels" in kwargs:
            counted = (kwargs["shift_labels"] != IGNORE_INDEX).sum()
        chunk = length // self.size
        if "position_ids" not in params:
            raise ValueError(f"{type(module).__name__}.forward takes no position_ids: under "
                             f"sequence_parallel_size {self.size} rank {self.rank} holds "
                             f"positions {self.rank * chunk}..{(self.rank + 1) * chunk - 1}; "
                             "add a position_ids argument, or shard the inputs yourself and "
                             "pass position_ids")
        start = self.rank * chunk
        kwargs["position_ids"] = torch.arange(start, start + chunk,
                                              device=first.device).expand(batch, chunk)
        self.full_length, self.local_tokens = length, batch * chunk
        return args, kwargs, counted

    def _check_same_batch(self, first: torch.Tensor) -> None:
        """Once: every rank of the group passed the same micro-batch (a loader sharded over
        every rank instead of the dp ranks would mix sequences silently)."""
        mine = torch.tensor([[first.shape[0], first.shape[1], first.double().sum().item()]],
                            dtype=torch.float64, device=first.device)
        seen = self.all_gather(mine)
        if not bool((seen == mine).all()):
            raise ValueError("the ranks of a sequence-parallel group passed different "
                             "micro-batches ((batch, length, sum) per rank: "
                             f"{seen.tolist()}); give every rank of an sp group the same data: "
                             "shard the loader over engine.topology.dp_size ranks by "
                             "engine.topology.dp_rank, or pass pre-sharded inputs with "
                             "position_ids")
        self._checked = True

    # -- loss --------------------------------------------------------------------------------
    def token_mean(self, mean: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
        """The mean over the whole sequences, from this rank's ``mean`` over its ``count``
        tokens: the same value on every rank of the group."""
        count = torch.as_tensor(count, device=mean.device)
        return _TokenMean.apply(mean, count, self)

    def loss(self, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], output: Any,
             target: torch.Tensor) -> torch.Tensor:
        """``loss_fn(output, target)`` as the full-sequence token mean. ``output`` is this
        rank's chunk; ``target`` (B, T, ...) is cut to it when it is the full sequence (the
        length the last forward was given), else taken as the chunk. Integer targets equal to
        -100 count no token."""
        if self.full_length is not None and target.shape[1] == self.full_length:
            target = self.shard(target)
        count = ((target != IGNORE_INDEX).sum() if not target.is_floating_point()
                 else torch.tensor(target.numel()))
        return self.token_mean(loss_fn(output, target), count)


class _RouteSDPA(TorchFunctionMode):
    """Sends ``F.scaled_dot_product_attention`` to :meth:`SequenceParallel.sdpa`."""

    def __init__(self, sp: SequenceParallel, where: str | None):
        super().__init__()
        self.sp, self.where = sp, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.sp._inside:
            return func(*args, **kwargs)
        where = self.where or (self.sp._calls[-1] if self.sp._calls
                               else "scaled_dot_product_attention")
        self.sp._inside = True  # an outer mode (a plan inside the engine's) routes once
        try:
            return self.sp.sdpa(*args, **kwargs, where=where)
        finally:
            self.sp._inside = False


def route_attention_modules(model: nn.Module, sp: SequenceParallel,
                            patterns: tuple[str, ...]) -> list[Any]:
    """A plan: route SDPA through Ulysses only inside the modules whose qualified names
    match one of ``patterns`` (``fnmatch``, e.g. ``blocks.*.attn``); returns the hooks."""
    import fnmatch

    hooks: list[Any] = []
    for name, sub in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            mode = _RouteSDPA(sp, name)

            def enter(*_: Any, mode: _RouteSDPA = mode) -> None:
                mode.__enter__()

            def leave(*_: Any, mode: _RouteSDPA = mode) -> None:
                mode.__exit__(None, None, None)

            hooks += [sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave)]
    if not hooks:
        raise ValueError(f"sequence parallelism: no module matches the attention patterns "
                         f"{list(patterns)}")
    sp.routes_sdpa = False
    return hooks


_HEAD_ATTRS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEAD_ATTRS = ("num_key_value_heads", "n_kv_head", "num_kv_heads")


def check_heads(model: nn.Module, size: int) -> None:
    """At initialize: every head count the model declares (a transformers config's, or a
    module's ``n_head`` / ``num_heads`` ...) splits over ``size`` sp ranks; kv heads may
    instead divide ``size`` (then they are replicated). The forward checks the tensors."""
    for name, sub in model.named_modules():
        holders = [(name or type(model).__name__, sub)]
        if name == "" and getattr(sub, "config", None) is not None:
            holders.append((f"{type(model).__name__}.config", sub.config))
        for where, holder in holders:
            for attr in _HEAD_ATTRS:
                heads = getattr(holder, attr, None)
                if isinstance(heads, int) and not isinstance(heads, bool) and heads % size:
                    raise ValueError(f"{where}.{attr} = {heads} attention heads are not "
                                     f"divisible by sequence_parallel_size {size}; valid: "
                                     f"a size dividing {heads}")
            for attr in _KV_HEAD_ATTRS:
                kv = getattr(holder, attr, None)
                if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0 and \
                        kv % size and size % kv:
                    raise ValueError(f"{where}.{attr} = {kv} key/value heads can be neither "
                                     f"split over nor replicated to sequence_parallel_size "
                                     f"{size}; valid: a size that divides {kv} or is a "
                                     "multiple of it")


def _first_sequence(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The first (B, T, ...) tensor: a positional one, else input_ids, else any keyword."""
    for value in (*args, kwargs.get("input_ids"), *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value
    return None


def _causal_mask_suffices(mask: Any) -> bool:
    """Whether a (B, T) padding mask can be dropped: ones, then only zeros (padding at the
    end, which no earlier token attends to under a causal mask; its labels must be -100)."""
    if not isinstance(mask, torch.Tensor):
        return False
    if mask.dim() != 2 or bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError("an attention_mask with padding other than at the end under "
                         "sequence parallelism is not supported: attention runs causal over "
                         "whole sequences; pad at the end with labels -100")
    return True
