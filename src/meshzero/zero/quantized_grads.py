"""ZeRO++ qgZ: the gradient reduce-scatter in two hops, the one across nodes quantized.

The data-parallel ranks are ``n`` nodes of ``k`` ranks, dp rank ``r = node * k + j``; rank r
owns shard r (S elements) of a group's flat gradient ``full`` (n*k*S,). Per group:

1. inside the node, at full precision (the communication dtype): ``full`` viewed (n, k, S)
   is reordered to (k, n, S) and reduce-scattered over the node's k ranks, so local rank j
   gets the node's partial sum of the n shards ``m * k + j`` (one per node), (n, S);
2. across nodes: each of those n chunks is block-quantized (comm/quantize.py, int4 in
   blocks of 32 with an fp32 scale each) and all-to-all'ed over the n ranks with the same
   local index j, so rank r receives every node's partial sum of its own shard;
3. they are dequantized and summed in fp32 into the shard.

Every chunk is quantized, the rank's own node's included, so what a rank gets does not
depend on which node it sits on, and one node (or one rank) quantizes too. Bytes per rank
and group: ``(k-1)/k * n*k*S * b`` inside the node (b: bytes per element of the
communication dtype) and ``(n-1) * packed(S)`` across nodes, ``packed(S) = 4 * ceil(S /
32) + ceil(S / 2)``, against ``(nk-1)/(nk) * nkS * b`` for the flat reduce-scatter, all of
which crosses nodes when the group spans them.

Blocks of 32: with 256 the demo GPT's loss after 300 steps was 5.6 % above uncompressed
training, with 64 2.1 %, with 32 0.7 % (int8 in blocks of 256: 1.5 %), measured by
benchmarks/compression.py --steps 300 (benchmarks/RESULTS.md): a small gradient element in a
block with a large one rounds to zero every step, so a coarse block starves it.

DeepSpeed's ``all_to_all_quant_reduce`` (runtime/comm/coalesced_collectives.py) quantizes
the hop inside the node too (int4, then a quantized partial reduction) and is used at stage
3 only; here the node's hop stays at full precision (intra-node links are fast) and stages
1, 2 and 3 use it (they share the reduce-scatter; stage 0 all-reduces, and is refused).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshzero.comm import Communicator, Handle
from meshzero.comm.quantize import dequantize_rows, packed_bytes, quantize

QGZ_BLOCK = 32  # 0.625 bytes an element: 0.5 of codes, 4 / 32 of scale (docs/compression.md)
QGZ_BITS = 4


def cross_node_bytes(shard_numel: int, num_nodes: int) -> int:
    """Bytes one rank sends across nodes for one group's qgZ reduction."""
    return (num_nodes - 1) * packed_bytes(shard_numel, QGZ_BLOCK, QGZ_BITS)


class TwoHops:
    """The in-flight reduction of one group: the node's hop, then the cross-node hop,
    issued when the first is seen complete (a poll or the wait), in the reducer's order."""

    def __init__(self, first: Handle, second: Callable[[], Handle]):
        self.first = first
        self.start_second = second
        self.second: Handle | None = None

    def completed(self) -> bool:
        if self.second is None:
            if not self.first.completed():
                return False
            self.first.wait()
            self.second = self.start_second()
        return self.second.completed()

    def wait(self) -> None:
        if self.second is None:
            self.first.wait()
            self.second = self.start_second()
        self.second.wait()


class HierarchicalReduceScatter:
    """What the GradientReducer calls as its ``reduce_scatter``: the module docstring's
    two hops over ``node`` (the k ranks of this node) and ``cross`` (the n ranks at this
    rank's place in every node)."""

    def __init__(self, node: Communicator, cross: Communicator):
        self.node = node
        self.cross = cross
        self.size = node.size * cross.size

    def reduces_by_all_to_all(self, full: torch.Tensor) -> bool:
        return False  # no workspace from the caller: the hops size their own buffers

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor,
                       workspace: torch.Tensor | None = None) -> TwoHops:
        n, k, numel = self.cross.size, self.node.size, shard.numel()
        reordered = full.view(n, k, numel).transpose(0, 1).contiguous().view(-1)
        partial = torch.empty(n * numel, dtype=full.dtype, device=full.device)
        first = self.node.reduce_scatter(partial, reordered)

        def second() -> Handle:
            rows = partial.view(n, numel)
            packed = torch.stack([quantize(rows[m], QGZ_BLOCK, QGZ_BITS) for m in range(n)])
            received = torch.empty_like(packed)

            def total() -> None:
                values = torch.empty(n, numel, dtype=torch.float32, device=shard.device)
                dequantize_rows(received, numel, QGZ_BLOCK, QGZ_BITS, values)
                shard.copy_(values.sum(0))

            return self.cross.all_to_all(received.view(-1), packed.view(-1),
                                         op="quantized_all_to_all", then=total)

        return TwoHops(first, second)
