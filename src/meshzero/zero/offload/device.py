"""The device tier (no optimizer offload): master, gradient shard and optimizer states are
tensors on the compute device and the optimizer steps them in place."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshzero.zero.offload.tier import Tier

if TYPE_CHECKING:
    from meshzero.zero.flat_buffer import FlatGroup


class DeviceTier(Tier):
    name = "device"
    grads_cross = False

    @property
    def optimizer_device(self) -> torch.device:
        return self.device

    def master_is_copy(self, compute_dtype: torch.dtype) -> bool:
        # in fp32 training (or bf16 with bf16 masters) the compute parameters are the master
        return compute_dtype != self.master_dtype

    def master(self, group: FlatGroup, init: torch.Tensor) -> torch.Tensor:
        if not group.master_is_copy:  # the compute params are the master: no copy
            return group.owned_params()
        return init.to(self.master_dtype, copy=True)

    def grad_shard(self, group: FlatGroup) -> torch.Tensor | None:
        lo, hi = group.owned
        if group.grad_full is not None:  # stages 0-1: a view of the persistent full buffer
            return group.grad_full[lo:hi]
        return torch.zeros(hi - lo, dtype=self.grad_dtype, device=self.device)

    def grad_stats(self, need_norm: bool, need_overflow: bool,
                   weighted: bool = False) -> tuple[float, float] | None:
        return None  # read from the gradient shards, on the device already

    def store_grad(self, group: FlatGroup, out: torch.Tensor, accumulate: bool) -> None:
        """On the device: nothing crosses (the shard was reduce-scattered in place, or is
        copied / added here)."""
        grad = group.grad
        assert grad is not None, "the device tier keeps every gradient shard"
        if out.data_ptr() == grad.data_ptr():  # reduce-scattered in place
            return
        if accumulate:
            grad.add_(out)
        else:
            grad.copy_(out)

    def write_params(self, group: FlatGroup, target: torch.Tensor) -> None:
        """Into the compute parameters on the device; with offload_param, converted on the
        device and across into the host shard (waited for: the next gather reads it)."""
        master = group.master
        assert master is not None  # called for groups whose master is in memory
        if self.options.param != "none" and group.sharded:
            self.transfers.to_host(target, master.to(target.dtype))
            self.transfers.wait()
        else:
            target.copy_(master)
