"""Ulysses sequence parallelism: the top-level keys ``sequence_parallel_size`` (DeepSpeed
ALST's and Accelerate's ``sp_size``) and ``seq_parallel_communication_data_type`` (the
all-to-all's dtype on the wire), and what sp cannot be combined with yet."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from meshzero.config.schema import Config

SeqCommDtype = Literal["fp32", "fp16", "bf16"]


def sequence_problems(config: Config) -> list[str]:
    """The combinations with ``sequence_parallel_size > 1`` that are not built yet, each a
    line naming the keys (the sizes against the world are checked at start)."""
    sp = config.sequence_parallel_size
    if sp == 1:
        return []
    zc = config.zero_optimization
    key = f"sequence_parallel_size = {sp}"
    problems = []
    if config.tensor_parallel.size > 1:
        problems.append(f"{key} with tensor_parallel.size = {config.tensor_parallel.size} is "
                        "not supported yet; use one of them")
    if config.pipeline_parallel.size > 1:
        problems.append(f"{key} with pipeline_parallel.size = "
                        f"{config.pipeline_parallel.size} is not supported yet: the stages "
                        "would pass sequence shards; use one of them")
    if zc.mics_shard_size not in (-1, 0, 1):
        problems.append(f"{key} with zero_optimization.mics_shard_size = "
                        f"{zc.mics_shard_size} is not supported yet (ZeRO shards over "
                        "dp x sp); remove mics_shard_size")
    if zc.zero_hpz_partition_size > 1:
        problems.append(f"{key} with zero_optimization.zero_hpz_partition_size = "
                        f"{zc.zero_hpz_partition_size} is not supported yet; remove it")
    return problems
