"""Activation memory and FLOPs of one micro-step, counted without memory or compute.

The model's parameters are swapped for fake tensors (``FakeTensorMode``: shapes, dtypes and
devices, no storage) in the compute dtype, and one forward and backward run on fake inputs.
A ``TorchDispatchMode`` sees every op: it adds the bytes of each new storage an op returns
and subtracts them when the storage dies (a weak reference), so the peak of live bytes is
what the real run would allocate. Parameter gradients are dropped as soon as they are
accumulated, as the engine's hooks do (it adds them into its flat buffers, counted apart).
A 70 B-parameter model costs seconds: no kernel runs.

With ``checkpointing``, every unit but the root runs under ``torch.utils.checkpoint``
(non-reentrant), so its recomputation in backward is counted too.

With Ulysses sequence parallelism (``sp`` > 1) one rank's micro-step runs on seq_len / sp
tokens, and every ``F.scaled_dot_product_attention`` sees what the all-to-all gives it:
(B, H/sp, seq_len, D), the whole sequence for 1/sp of the heads (kv heads copied up to sp
when fewer), and the attention output is turned back into the local chunk's shape.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from meshzero.estimate.depth import Counts, DepthProbe, Mark, extrapolate_depth
from meshzero.estimate.model import ModelSpec
from meshzero.profiling.flops import FORMULAS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ActivationProfile:
    """One micro-step of ``micro_batch`` samples on one rank."""

    micro_batch: int
    seq_len: int | None
    peak_bytes: int  # live bytes allocated by forward + backward at their peak
    flops: int  # forward + backward (+ recomputation) FLOPs, as torch.utils.flop_counter
    forward_order: tuple[int, ...]  # unit indices in the order their forwards started
    seconds: float  # what counting took
    depth: str | None = None  # how a deep stack was counted (None: the whole model ran)


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created while active (pre-existing storages excluded)."""

    def __init__(self, preexisting: set[int]):
        super().__init__()
        self.preexisting = preexisting
        self.live = 0
        self.peak = 0
        self.flops = 0
        self._refs: dict[int, weakref.ref] = {}
        self.marks: list[tuple[Mark, int]] = []  # (label, peak of the segment it ends)
        self._segment_peak = 0

    def mark(self, label: Mark) -> None:
        """End the current segment (its peak is recorded under ``label``), start the next."""
        self.marks.append((label, self._segment_peak))
        self._segment_peak = self.live

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.preexisting or key in self._refs:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._segment_peak = max(self._segment_peak, self.live)

        def died(_ref, key=key, nbytes=nbytes) -> None:
            self.live -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, died)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


class _UlyssesShapes(TorchFunctionMode):
    """SDPA on the shapes sequence parallelism gives it: (B, H, T/sp, D) -> (B, H/sp, T, D),
    the same elements (what the all-to-all sends and receives), and back."""

    def __init__(self, sp: int):
        super().__init__()
        self.sp = sp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        batch, heads, chunk, dim = q.shape
        sp = self.sp
        if k.shape[1] < sp:  # fewer kv heads than sp: each rank gets a copy of one
            k, v = (t.repeat_interleave(sp // t.shape[1], dim=1) for t in (k, v))
        q, k, v = (t.reshape(t.shape[0], t.shape[1] // sp, chunk * sp, t.shape[3])
                   for t in (q, k, v))
        kwargs["enable_gqa"] = kwargs.get("enable_gqa", False) or q.shape[1] != k.shape[1]
        out = func(q, k, v, *args[3:], **kwargs)
        return out.reshape(batch, heads, chunk, dim)


def profile_activations(spec: ModelSpec, *, micro_batch: int, seq_len: int | None,
                        precision: str, checkpointing: bool,
                        unit_paths: list[str], sp: int = 1) -> ActivationProfile:
    """Run one fake forward/backward of ``spec.model`` and count what it allocates.

    A deep stack of identical blocks is run at 2, 3 and 4 blocks; when the counts grow by
    exactly the same bytes and FLOPs per block, they are extended to the full depth (see
    depth.py), else the whole model runs."""
    if not spec.runnable:
        raise ValueError("activations need a model to run; a bare parameter count has none")
    if sp > 1 and (seq_len is None or seq_len % sp):
        raise ValueError(f"sequence_parallel_size {sp} needs a sequence length divisible by "
                         f"it, got {seq_len}")
    start = time.perf_counter()
    model = spec.model
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    restore = _swap_to_fake(model, mode, DTYPES[precision])
    order: list[int] = []
    handles = []
    try:
        for index, path in enumerate(unit_paths):
            module = model.get_submodule(path)
            handles.append(module.register_forward_pre_hook(
                lambda _m, _a, index=index: order.append(index)))
            if checkpointing and path:
                module.forward = functools.partial(checkpoint, module.forward,
                                                   use_reentrant=False, preserve_rng_state=False)
        with mode:
            for p in model.parameters():
                if p.requires_grad:  # the engine adds each grad into its flat buffer, then drops it
                    handles.append(p.register_post_accumulate_grad_hook(_drop_grad))

            def count(probe: DepthProbe | None = None) -> Counts:
                order.clear()
                counter = _count(spec, micro_batch, seq_len, DTYPES[precision], probe, sp)
                return Counts(counter.peak, counter.flops, tuple(order), counter.marks)

            peak, flops, forward_order, depth = extrapolate_depth(model, unit_paths, count)
    finally:
        for h in handles:
            h.remove()
        for path in unit_paths:
            model.get_submodule(path).__dict__.pop("forward", None)
        restore()
    return ActivationProfile(micro_batch, seq_len, peak, flops, forward_order,
                             time.perf_counter() - start, depth)


def _count(spec: ModelSpec, micro_batch: int, seq_len: int | None, dtype: torch.dtype,
           probe: DepthProbe | None, sp: int = 1) -> _LiveBytes:
    """The counter after one forward/backward, inside the fake mode; ``probe`` marks the
    segments of a cut stack; ``sp``: one rank's chunk of seq_len under Ulysses."""
    model = spec.model
    args, kwargs = _inputs(spec, micro_batch, None if seq_len is None else seq_len // sp,
                           dtype)
    preexisting = {t.untyped_storage()._cdata for t in
                   [*model.parameters(), *model.buffers(), *tree_flatten((args, kwargs))[0]]
                   if isinstance(t, torch.Tensor)}
    counter = _LiveBytes(preexisting)
    if probe is not None:
        probe.counter = counter
    try:
        with counter, (_UlyssesShapes(sp) if sp > 1 else contextlib.nullcontext()):
            loss = _loss(spec, model(*args, **kwargs), args, kwargs)
            counter.mark("post")
            loss.backward()
            counter.mark("end")
            del loss
    except RuntimeError as exc:
        raise ValueError(f"counting activations of {spec.name} failed: {exc}. A model "
                         "whose forward reads tensor values (.item(), data-dependent "
                         "shapes) cannot run on fake tensors") from None
    return counter


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def _swap_to_fake(model: nn.Module, mode: FakeTensorMode, dtype: torch.dtype):
    """Replace every parameter and buffer by a fake CPU tensor (floating ones in ``dtype``, as
    the engine casts them); shared parameters stay shared. Returns a function that undoes it."""
    saved: list[tuple[dict, str, Any]] = []
    fakes: dict[int, Any] = {}

    def fake_of(t: torch.Tensor, parameter: bool) -> Any:
        if id(t) not in fakes:
            with mode:
                new = torch.empty(t.shape, device="cpu",
                                  dtype=dtype if t.is_floating_point() else t.dtype)
            fakes[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if parameter else new
        return fakes[id(t)]

    for module in model.modules():
        for table, parameter in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                if t is not None:
                    saved.append((table, name, t))
                    table[name] = fake_of(t, parameter)

    def restore() -> None:
        for table, name, t in saved:
            table[name] = t

    return restore


def _first_leaf_with_params(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            return module
    return None


def _inputs(spec: ModelSpec, micro_batch: int, seq_len: int | None, dtype: torch.dtype
            ) -> tuple[tuple, dict]:
    """Fake forward arguments: the user's ``inputs`` function, token ids for a model that
    starts with an embedding (and labels for a Hugging Face model), features for one that
    starts with a Linear."""
    if spec.inputs is not None:
        got = spec.inputs(micro_batch, seq_len)
        if isinstance(got, dict):
            return (), got
        return (got if isinstance(got, tuple) else (got,)), {}
    first = _first_leaf_with_params(spec.input_model or spec.model)
    if isinstance(first, nn.Embedding):
        if seq_len is None:
            raise ValueError(f"{spec.name} takes token ids: give a sequence length (--seq-len)")
        ids = torch.randint(0, first.num_embeddings, (micro_batch, seq_len))
        if spec.kind == "hf":  # no KV cache in training (HF turns it off for checkpointing)
            return (), {"input_ids": ids, "labels": ids, "use_cache": False}
        return (ids,), {}
    if isinstance(first, nn.Linear):
        shape = (micro_batch, first.in_features) if seq_len is None else (
            micro_batch, seq_len, first.in_features)
        return (torch.randn(shape, dtype=dtype),), {}
    raise ValueError(f"cannot tell what {spec.name} takes as input (its first module with "
                     f"parameters is a {type(first).__name__}); pass inputs=fn(micro_batch, "
                     "seq_len) (API) or --inputs pkg.mod:fn")


def _loss(spec: ModelSpec, out: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """The model's own loss (Hugging Face ``labels``), next-token cross-entropy in fp32 for
    token models (as the demo's loss_fn), else the mean square of the output."""
    if getattr(out, "loss", None) is not None:
        return out.loss
    out = getattr(out, "logits", out)
    if isinstance(out, tuple | list):
        out = out[0]
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise ValueError(f"{spec.name} returned {type(out).__name__}; the estimate needs a "
                         "floating tensor (or an output with .loss or .logits)")
    ids = args[0] if args else None
    if ids is not None and not ids.is_floating_point() and out.dim() == ids.dim() + 1:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), ids.reshape(-1))
    return out.float().square().mean()
