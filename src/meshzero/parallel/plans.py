"""Tensor-parallel plans: the format, and the plans shipped for the demo GPT, Hugging Face
GPT-2 and Llama-style models. :func:`meshzero.parallel.apply_tensor_parallel` applies one.

Plan format (markdown, for the README):

### Tensor-parallel plans

A plan is a dict from module-name patterns to what to do with the modules they match.
Patterns are `fnmatch` globs over the qualified names of `model.named_modules()` (`*` also
crosses dots: `blocks.*.attn.qkv`). Every pattern must match at least one module, and no
module may match two patterns: either is a `ValueError`, never a silent no-op.

Values (styles):

- `"colwise"` (`nn.Linear` or Hugging Face `Conv1D`): a `ColumnParallelLinear`, output
  features split over the tp ranks; its output stays split.
- `"colwise_gather"`: the same, output all-gathered (an LM head before the loss).
- `"rowwise"` (`nn.Linear` or `Conv1D`): a `RowParallelLinear`, input features split, partial
  outputs all-reduced, the bias added once after the reduction.
- `"vocab"` (`nn.Embedding`): a `VocabParallelEmbedding`, vocabulary rows split, lookups
  all-reduced.
- `"sequence_parallel"` (any module, e.g. a norm): with sequence parallelism it runs on T/N
  positions, so its (replicated) parameters' gradients are summed over the tp group.
- `"sequence_scatter"` (any module returning one tensor): with sequence parallelism its
  output is split along the sequence: the entry into the sequence-parallel region.
- `"sequence_gather"` (any module returning one tensor): with sequence parallelism its output
  is all-gathered along the sequence (the exit); its gradients are summed as above.

A value may also be a dict with any of these keys:

- `"style"`: one of the values above;
- `"fused": n` (colwise): the output is n equal fused parts (q, k, v), each split by rank;
- `"sequence_parallel": False`: this layer's input and output stay whole even when
  sequence parallelism is on (e.g. an embedding whose output is added to position embeddings
  before the sequence is split);
- `"divide_attrs": ["n_head"]`: integer attributes of the module divided by the tp size
  (an attention's head count), a `ValueError` naming the module if one does not divide;
- `"hook": fn(name, module, ctx) -> nn.Module | None`: called with a `TensorParallelContext`
  before any layer is replaced; may return a replacement module that keeps the same child
  names (e.g. an attention that computes with its rank's heads).

Sizes that do not divide by tp (features, vocabulary, heads) are a `ValueError` naming the
module and both sizes, raised before the model is changed. Tied weights stay tied when both
users are sharded the same way (a vocab embedding and a colwise LM head); a tied weight left
unsharded on one side is an error. Without sequence parallelism the `sequence_*` entries do
nothing (but must still match); with it, the sequence length must divide by tp (so one-token
cached decoding needs a model applied without it).

Shipped plans (`meshzero.parallel.plans`): `GPT_PLAN` for the demo GPT
(`meshzero.demo.gpt.GPT`), `GPT2_PLAN` for Hugging Face `GPT2LMHeadModel` (`Conv1D` weights
are transposed into the parallel linears; the vocabulary must divide by tp: pad it with
`resize_token_embeddings`), `LLAMA_PLAN` for `LlamaForCausalLM`-style models (query and
key/value heads must divide by tp; no sequence parallelism).

```python
from meshzero.parallel import apply_tensor_parallel
from meshzero.parallel.plans import GPT2_PLAN
model = transformers.GPT2LMHeadModel(config)     # vocab_size must divide by tp
apply_tensor_parallel(model, GPT2_PLAN, tp_group, sequence_parallel=True)
```
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshzero.parallel.tensor_comms import OnComm

LAYER_STYLES = ("colwise", "colwise_gather", "rowwise", "vocab")
REGION_STYLES = ("sequence_parallel", "sequence_scatter", "sequence_gather")
_ENTRY_KEYS = ("style", "fused", "sequence_parallel", "divide_attrs", "hook")


@dataclass(frozen=True)
class TensorParallelContext:
    """What a plan hook may need: the tp group, its size and this rank's index in it."""

    tp_group: dist.ProcessGroup | None
    tp_size: int
    tp_rank: int
    sequence_parallel: bool
    on_comm: OnComm | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> TensorParallelContext:
        return self  # held by hooks of a model that may be deep-copied; a group cannot be


ModuleHook = Callable[[str, nn.Module, TensorParallelContext], "nn.Module | None"]


@dataclass(frozen=True)
class PlanEntry:
    """One plan value, normalised (see the module docstring)."""

    style: str | None = None
    fused: int = 1
    sequence_parallel: bool = True
    divide_attrs: tuple[str, ...] = ()
    hook: ModuleHook | None = None


def parse_plan(plan: Mapping[str, str | Mapping[str, Any]]) -> dict[str, PlanEntry]:
    """Check a plan's values and normalise them; ``ValueError`` naming the bad pattern."""
    styles = LAYER_STYLES + REGION_STYLES
    out: dict[str, PlanEntry] = {}
    for pattern, value in plan.items():
        where = f"tensor-parallel plan entry {pattern!r}"
        raw: Mapping[str, Any] = {"style": value} if isinstance(value, str) else value
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}: expected a style name or a dict, got {value!r}")
        unknown = sorted(set(raw) - set(_ENTRY_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {list(_ENTRY_KEYS)}")
        entry = PlanEntry(style=raw.get("style"), fused=raw.get("fused", 1),
                          sequence_parallel=raw.get("sequence_parallel", True),
                          divide_attrs=tuple(raw.get("divide_attrs", ())), hook=raw.get("hook"))
        if entry.style is not None and entry.style not in styles:
            raise ValueError(f"{where}: unknown style {entry.style!r}; valid styles: {styles}")
        if entry.style is None and not entry.divide_attrs and entry.hook is None:
            raise ValueError(f"{where}: gives neither a style, divide_attrs nor a hook")
        if not isinstance(entry.fused, int) or entry.fused < 1:
            raise ValueError(f"{where}: fused must be a positive int, got {entry.fused!r}")
        if entry.fused > 1 and entry.style != "colwise":
            raise ValueError(f"{where}: fused applies to style 'colwise' only")
        if entry.hook is not None and not callable(entry.hook):
            raise ValueError(f"{where}: hook must be callable, got {entry.hook!r}")
        out[pattern] = entry
    return out


def module_label(name: str) -> str:
    """How errors name a module."""
    return repr(name) if name else "the root module"


def match_plan(model: nn.Module, entries: dict[str, PlanEntry]) -> dict[str, PlanEntry]:
    """Module name -> its entry, in ``named_modules`` order; ``ValueError`` if a pattern
    matches nothing or a module matches two patterns."""
    names = [name for name, _ in model.named_modules()]
    owner: dict[str, str] = {}
    for pattern in entries:
        hits = [name for name in names if fnmatchcase(name, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
            hint = f"; closest names: {close}" if close else f"; names look like {names[1:4]}"
            raise ValueError(f"tensor-parallel plan pattern {pattern!r} matches no module of "
                             f"{type(model).__name__}{hint}")
        for name in hits:
            if name in owner:
                raise ValueError(f"module {module_label(name)} matches two tensor-parallel plan "
                                 f"patterns: {owner[name]!r} and {pattern!r}")
            owner[name] = pattern
    return {name: entries[owner[name]] for name in names if name in owner}


def linear_dims(module: nn.Module) -> tuple[int, int, bool] | None:
    """(in_features, out_features, weight stored transposed) of a linear-like module:
    ``nn.Linear``, or Hugging Face's ``Conv1D`` (weight (in, out), y = x W + b)."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return cast(int, module.nx), cast(int, module.nf), True  # Conv1D stores ints
    return None


def validate_entry(name: str, module: nn.Module, entry: PlanEntry, ctx: TensorParallelContext
              ) -> None:
    """Raise ValueError if ``entry`` cannot apply to ``module``; changes nothing."""
    label, tp = module_label(name), ctx.tp_size
    kind = type(module).__name__
    for attr in entry.divide_attrs:
        value = getattr(module, attr, None)
        if not isinstance(value, int):
            raise ValueError(f"{label}: divide_attrs names {attr!r}, which is not an int "
                             f"attribute of {kind}")
        if value % tp:
            raise ValueError(f"{label}: {attr} {value} is not divisible by the "
                             f"tensor-parallel size {tp}")
    if entry.style in ("colwise", "colwise_gather", "rowwise"):
        dims = linear_dims(module)
        if dims is None:
            raise ValueError(f"{label}: style {entry.style!r} needs an nn.Linear or a Conv1D, "
                             f"found {kind}")
        in_features, out_features, _ = dims
        if entry.style == "rowwise" and in_features % tp:
            raise ValueError(f"{label}: in_features {in_features} is not divisible by the "
                             f"tensor-parallel size {tp}")
        if entry.style != "rowwise" and out_features % (tp * entry.fused):
            parts = f" ({entry.fused} fused parts)" if entry.fused > 1 else ""
            raise ValueError(f"{label}: out_features {out_features}{parts} is not divisible "
                             f"by {entry.fused} x the tensor-parallel size {tp}")
    if entry.style == "vocab":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{label}: style 'vocab' needs an nn.Embedding, found {kind}")
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ValueError(f"{label}: max_norm, scale_grad_by_freq and sparse embeddings "
                             "are not supported by VocabParallelEmbedding")
        if module.num_embeddings % tp:
            raise ValueError(
                f"{label}: num_embeddings (vocabulary) {module.num_embeddings} is not divisible "
                f"by the tensor-parallel size {tp}; pad the vocabulary (Hugging Face: "
                f"model.resize_token_embeddings(n, pad_to_multiple_of={tp}))")


# --- the demo GPT (meshzero.demo.gpt) --------------------------------------------------------


class ParallelCausalSelfAttention(nn.Module):
    """The demo GPT's attention over this tp rank's heads: ``qkv`` column-parallel (q, k and
    v fused, each split by heads), ``proj`` row-parallel. The sequence length is read from
    the projection's output, so under sequence parallelism the input may be (B, T/N, C)."""

    def __init__(self, qkv: nn.Module, proj: nn.Module, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head  # this rank's heads
        self.qkv = qkv
        self.proj = proj

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        qkv = self.qkv(x)  # (B, T, 3 * H * D), H = this rank's heads, T whole
        B, T, three_hd = qkv.shape
        hd = three_hd // 3
        # (B, T, H * D) -> (B, H, T, D)
        return tuple(t.view(B, T, self.n_head, hd // self.n_head).transpose(1, 2)
                     for t in qkv.split(hd, dim=2))

    def _out(self, y: torch.Tensor) -> torch.Tensor:  # (B, H, T, D) -> proj (B, T, C)
        B, H, T, D = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(x)
        return self._out(F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def decode(self, x: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        """As ``CausalSelfAttention.decode``; the cache holds this rank's heads."""
        q, k, v = self._heads(x)
        causal = not cache and q.shape[2] > 1
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        return self._out(F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def parallel_gpt_attention(name: str, module: nn.Module, ctx: TensorParallelContext
                           ) -> nn.Module:
    """Plan hook: the demo GPT's attention computing with its rank's heads (``n_head`` is
    already divided by the plan's ``divide_attrs``)."""
    n_head = module.n_head
    assert isinstance(n_head, int)  # the demo's CausalSelfAttention stores its head count
    return ParallelCausalSelfAttention(module.get_submodule("qkv"), module.get_submodule("proj"),
                                       n_head)


GPT_PLAN: dict[str, str | dict[str, Any]] = {
    "tok_emb": "vocab",  # tied to head: both shard the same vocabulary rows
    "pos_emb": "sequence_scatter",  # (T, C) -> this rank's (T/N, C) under SP
    "blocks.*.ln_[12]": "sequence_parallel",
    "blocks.*.attn": {"divide_attrs": ["n_head"], "hook": parallel_gpt_attention},
    "blocks.*.attn.qkv": {"style": "colwise", "fused": 3},
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "ln_f": "sequence_parallel",
    "head": "colwise_gather",  # (B, T, vocab) logits on every rank, for the loss
}

# --- Hugging Face GPT-2 (GPT2LMHeadModel) ----------------------------------------------------

# Conv1D layers (weights stored (in, out)) become the parallel linears with the weight
# transposed; the attention splits c_attn's output by ``split_size`` and infers its heads, so
# only ``num_heads`` and ``split_size`` change. Under sequence parallelism the sequence is
# split after the embeddings' dropout (position ids are built from the whole sequence) and
# gathered again after ln_f (the model reshapes to the input's shape there).
GPT2_PLAN: dict[str, str | dict[str, Any]] = {
    "transformer.wte": {"style": "vocab", "sequence_parallel": False},
    "transformer.drop": "sequence_scatter",
    "transformer.h.*.ln_[12]": "sequence_parallel",
    "transformer.h.*.attn": {"divide_attrs": ["num_heads", "split_size"]},
    "transformer.h.*.attn.c_attn": {"style": "colwise", "fused": 3},
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
    "transformer.ln_f": "sequence_gather",
    "lm_head": {"style": "colwise_gather", "sequence_parallel": False},
}

# --- Llama-style (LlamaForCausalLM and its relatives: Mistral, Qwen2, ...) ------------------


def parallel_llama_attention(name: str, module: nn.Module, ctx: TensorParallelContext
                             ) -> None:
    """Plan hook: check that query and key/value heads divide by tp, and divide the head
    counts where the installed transformers keeps them on the module (recent versions infer
    heads from the projections' sizes)."""
    if ctx.sequence_parallel and ctx.tp_size > 1:
        raise ValueError(f"{name!r}: sequence parallelism is not supported by the Llama plan "
                         "(the attention reads the sequence length from its input)")
    config = module.config
    for what in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, what)
        if heads % ctx.tp_size:
            raise ValueError(f"{name!r}: {what} {heads} is not divisible by the "
                             f"tensor-parallel size {ctx.tp_size}")
    for attr in ("num_heads", "num_key_value_heads", "hidden_size"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            setattr(module, attr, value // ctx.tp_size)


LLAMA_PLAN: dict[str, str | dict[str, Any]] = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn": {"hook": parallel_llama_attention},
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather",
}

# the plans ``tensor_parallel.plan`` names
SHIPPED_PLANS: dict[str, dict[str, str | dict[str, Any]]] = {
    "gpt": GPT_PLAN, "hf_gpt2": GPT2_PLAN, "llama": LLAMA_PLAN,
}


def shipped_plan(plan: str | dict) -> dict:
    """``tensor_parallel.plan``: a shipped plan's name, or the plan itself."""
    if not isinstance(plan, str):
        return plan
    if plan not in SHIPPED_PLANS:
        raise ValueError(f"tensor_parallel.plan = {plan!r} is not a shipped plan; valid: "
                         f"{', '.join(SHIPPED_PLANS)}, or a {{module pattern: style}} mapping")
    return SHIPPED_PLANS[plan]
