"""The planner's time model: bytes a rank sends per optimizer step and offload seconds
(see meshzero.estimate.plan's docstring for the formulas and their assumptions)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from meshzero.comm.compressed import compressed_bytes
from meshzero.comm.quantize import packed_bytes
from meshzero.comm.stats import ring_bytes
from meshzero.config.optimizer import ONE_BIT_OPTIMIZERS
from meshzero.estimate.settings import Cluster, Settings
from meshzero.estimate.states import reuse_kept
from meshzero.zero.quantized_grads import cross_node_bytes
from meshzero.zero.sharded_params import QWZ_BLOCK

if TYPE_CHECKING:
    from meshzero.estimate.plan import Assumptions


def communication_bytes(layout, s: Settings) -> float:
    """Bytes one rank sends per optimizer step under the ring algorithms (meshzero.comm's count).
    Stage 3 gathers a sharded group in every forward and again in every backward, unless its
    unit is kept gathered into backward (zero/gather_plan.py): then once per micro-step."""
    n = layout.num_shards
    ring = (n - 1) / n
    total = 0.0
    kept = reuse_kept(layout, s)
    for g in layout.groups():
        sharded = s.stage == 3 and not g.persistent
        per_micro = 1 if g.unit in kept else 2
        gathers = per_micro * s.grad_accum if sharded else (
            1 if s.stage >= 1 and s.trains(g) else 0)
        total += gathers * g.padded_numel * s.compute_bytes
        if s.trains(g):
            if s.stage == 0:
                total += 2 * g.padded_numel * s.comm_bytes
            else:
                reduces = s.grad_accum if s.stage >= 2 else 1
                total += reduces * g.padded_numel * s.comm_bytes
    return total * ring


def communication_split(layout, s: Settings, ranks_per_node: int) -> tuple[int, int]:
    """(inside-node, across-node) bytes one data-parallel rank sends per optimizer step,
    op by op as meshzero.comm counts them (an op over a group with ranks on two nodes counts
    whole across-node), ``ranks_per_node`` data-parallel ranks to a node. Models ZeRO++:
    qwZ's gathers move ``(n-1) * packed(S)`` bytes (int8 in blocks of 2048 with an fp32
    scale each, comm/quantize.py); hpZ's backward gathers go over its block, inside a node
    when it fits; qgZ reduces inside the node at full precision and sends int4 across
    (zero/quantized_grads.py). A 1-bit optimizer's steps after its warm-up: see
    :func:`one_bit_bytes`."""
    zc = s.config.zero_optimization
    n = layout.num_shards
    k = min(ranks_per_node, n)  # qgZ: ranks of a node; n // k nodes
    hpz = zc.zero_hpz_partition_size
    spans = {"dp": n > ranks_per_node, "hpz": hpz > ranks_per_node, "node": False,
             "cross": n // k > 1}
    out = {True: 0, False: 0}
    one_bit = one_bit_bytes(layout, s, n)
    if one_bit is not None:
        out[spans["dp"]] += one_bit
    kept = reuse_kept(layout, s)
    for g in layout.groups():
        pb = g.padded_numel * s.compute_bytes
        if s.stage == 3 and not g.persistent:
            quantized = zc.zero_quantized_weights or (
                zc.zero_quantized_nontrainable_weights and not g.requires_grad)
            fwd = ((n - 1) * packed_bytes(g.shard_numel, QWZ_BLOCK, 8) if quantized
                   else ring_bytes("all_gather", pb, n))
            out[spans["dp"]] += s.grad_accum * fwd
            if g.unit not in kept:  # gathered again for backward
                bwd = ring_bytes("all_gather", pb, hpz) if hpz > 1 else fwd
                out[spans["hpz" if hpz > 1 else "dp"]] += s.grad_accum * bwd
        elif s.stage >= 1 and s.trains(g):  # the updated shards, after the step
            out[spans["dp"]] += ring_bytes("all_gather", pb, n)
        if not s.trains(g) or one_bit is not None:  # 1-bit: no gradient reduction
            continue
        gb = g.padded_numel * s.comm_bytes
        reduces = s.grad_accum if s.stage >= 2 else 1
        if s.stage == 0:
            out[spans["dp"]] += ring_bytes("all_reduce", gb, n)
        elif zc.zero_quantized_gradients:
            out[spans["node"]] += reduces * ring_bytes("reduce_scatter", gb, k)
            out[spans["cross"]] += reduces * cross_node_bytes(g.shard_numel, n // k)
        else:
            out[spans["dp"]] += reduces * ring_bytes("reduce_scatter", gb, n)
    return out[False], out[True]


def one_bit_bytes(layout, s: Settings, n: int) -> int | None:
    """Bytes one rank sends in a step of a 1-bit optimizer (``OneBitAdam``, ``ZeroOneAdam``,
    ``OneBitLamb``; ZeRO stage 0) once it compresses, in place of stage 0's all-reduce, as
    ``comm_report`` counts them; None for any other optimizer.

    The vectors compressed (optimizers/onebit.py): each trained parameter's momentum in
    fp32, one per param group under bf16/fp16 (the estimate sees one group: every trained
    parameter), one for all of them with 1-bit LAMB; each costs
    comm/compressed.py's ``compressed_bytes``, plus the 4-byte all-reduce that keeps the
    ranks' inf/nan skip alike (``nonfinite_check``). These are 1-bit Adam's and 1-bit LAMB's
    steps after ``freeze_step`` (before it, stage 0's all-reduce) and 0/1 Adam's
    synchronising steps (its local steps between them send nothing)."""
    optimizer = s.config.optimizer
    if optimizer is None or optimizer.type not in ONE_BIT_OPTIMIZERS:
        return None
    trained = [slot.numel for g in layout.groups() if s.trains(g) for slot in g.slots
               if slot.numel > 0]
    if n == 1 or not trained:
        return 0
    if optimizer.type == "OneBitLamb" or s.precision != "fp32":
        trained = [sum(trained)]
    return sum(compressed_bytes(numel, n) for numel in trained) + ring_bytes("all_reduce", 4, n)


def offload_seconds(layout, s: Settings, c: Cluster, a: Assumptions) -> float:
    owned = sum(g.shard_numel for g in layout.groups() if s.trains(g))
    kept = reuse_kept(layout, s)
    # shards moved to the device per micro-step: one per gather (zero/gather_plan.py)
    moved = sum(g.shard_numel * (1 if g.unit in kept else 2) for g in layout.groups()
                if s.stage == 3 and not g.persistent)
    sharded = sum(g.shard_numel for g in layout.groups()
                  if s.stage == 3 and not g.persistent)
    per_rank_nvme = a.nvme_bw / c.gpus_per_node
    out = 0.0
    if s.offload_optimizer != "none":
        # gradient shard to the host, updated shard back in the compute dtype, host step
        out += owned * (4 + s.compute_bytes) / a.pcie_bw
        out += owned / (a.cpu_adam_rate / c.gpus_per_node)
    if s.offload_optimizer == "nvme":  # read and write master + states per step
        out += 2 * owned * (4 + s.state_bytes_per_element) / per_rank_nvme
    if s.offload_param != "none":  # shards to the device for forward and backward
        out += s.grad_accum * moved * s.compute_bytes / a.pcie_bw
    if s.offload_param == "nvme":
        out += (s.grad_accum * moved + sharded) * s.compute_bytes / per_rank_nvme
    return out


def num_layers(model: nn.Module) -> int:
    """Layers of the model's longest ModuleList / Sequential of modules with parameters."""
    return max((sum(1 for k in m.children() if any(True for _ in k.parameters()))
                for m in model.modules() if isinstance(m, nn.ModuleList | nn.Sequential)),
               default=1) or 1


def model_width(model: nn.Module) -> int:
    """The hidden size activations between layers have: the first Embedding's dimension, else
    the first Linear's input features."""
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.embedding_dim
        if isinstance(m, nn.Linear):
            return m.in_features
    raise ValueError("cannot tell the model's hidden size (no Embedding or Linear)")


def model_parallel_seconds(s: Settings, c: Cluster, a: Assumptions, model: nn.Module,
                           num_layers: int) -> tuple[float, float]:
    """(tp, pp) communication seconds per optimizer step of one rank.

    tp (Megatron): 4 all-reduces of a (micro batch, seq, hidden) activation per layer per
    micro-batch, forward and backward, in the compute dtype, ring factor 2 (tp-1)/tp, over
    the intra-node bandwidth while the tp group fits in a node (rank order puts tp
    innermost); not overlapped with compute. pp: each micro-batch sends one activation
    forward and its gradient back per stage boundary, over the inter-node bandwidth when the
    pipeline spans nodes. The pipeline bubble is in the compute term (plan docstring)."""
    if s.model_parallel == 1:
        return 0.0, 0.0
    act = s.micro_batch * (s.seq_len or 1) * model_width(model) * s.compute_bytes
    tp_s = pp_s = 0.0
    if s.tp > 1:
        bw = a.intra_node_bw if s.tp <= c.gpus_per_node else a.inter_node_bw
        per_layer = 4 * act * 2 * (s.tp - 1) / s.tp
        tp_s = s.grad_accum * num_layers / s.pp * per_layer / bw
    if s.pp > 1:
        bw = a.inter_node_bw if c.nodes > 1 else a.intra_node_bw
        pp_s = s.grad_accum * 2 * act / bw
    return tp_s, pp_s
