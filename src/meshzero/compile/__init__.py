"""torch.compile under ZeRO: what is compiled, and what stays eager around it.

**What is compiled**: each ZeRO unit's own ``forward`` (torchtitan's per-TransformerBlock
granularity), for every unit that holds no other unit: the repeated blocks, or the root when
it is the only unit. ``torch.compile`` is applied to the *function* ``type(unit).forward``, once
per function, and called with the unit as its first argument: with dynamo's
``inline_inbuilt_nn_modules`` the unit's parameters are graph inputs, not guarded by identity,
so N identical blocks share one compiled graph (one cache entry per class and input shape).

**What stays eager**, in ``nn.Module.__call__``'s hooks around the compiled forward: stage 3's
gather (with prefetch and the unit-order check) and release, the output hook that gathers again
before backward, the reduce-scatters (gradient hooks, outside any graph), the profiler's marks
and the engine's bookkeeping (phases, accumulation, step counters). ``nn.Module.compile`` is
not used: it would put those hooks inside the compiled region.

**Stage 3's shard <-> full swap**: a released parameter keeps its tensor, shape and stride
(its flat buffer's storage is resized to 0, zero/flat_buffer.py), and a compiled forward runs
only between its unit's gather and release, so dynamo sees the full parameter every time: no
guard on it changes, no recompile. Inside the traced region, ShardedParameter's
``__torch_function__`` skips its gather-on-use (``torch.compiler.is_compiling()``) and the
saved-tensor hooks that regather views in backward are ``torch.compiler.disable``d (autograd
calls them from the compiled graph; dynamo would otherwise compile each as a frame). Because a
compiled forward cannot gather, stage 3's first step (which records the gather order) runs
every unit eagerly and checks that its forward reads no other unit's released parameters; one
that does stays eager, with a WARNING.

**Counted**: the wrapper reads dynamo's own counters (frames, graph breaks, guard failures,
compile time) before and after each unit call, so what compiled is attributed to the unit
(``engine.compile_report()``); a unit that compiles again after the step it first compiled in
logs a WARNING naming the unit and dynamo's reason.

**Not compiled**: the engine's forward, embeddings and head in a root that holds blocks, the
loss, backward's hooks and the optimizer step. Tensor parallelism, Ulysses and pipeline
parallelism run communication inside units (or their own schedule) and are refused at
``initialize`` (config/compile.py). The flops profiler's counting and timed steps run units
eagerly (its dispatch mode and module marks are eager tools).
"""

from meshzero.compile.methods import CompileMethods
from meshzero.compile.units import UnitCompiler

__all__ = ["CompileMethods", "UnitCompiler"]
