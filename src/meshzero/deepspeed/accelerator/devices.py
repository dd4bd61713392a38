"""DeepSpeed's accelerators (its top-level ``accelerator/`` package: cuda_accelerator.py,
cpu_accelerator.py) for CUDA and the CPU, each method one line over torch.

CPU memory is what DeepSpeed's CPU accelerator reports: the process's resident set size
(read from ``/proc/self/statm``) as "allocated" and "reserved", its peak since the last
reset, and the host's total and available memory (``/proc/meminfo``; ``os.sysconf``
elsewhere). No dependency beyond torch.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch


def _rss() -> int:
    """This process's resident set size in bytes (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _meminfo(key: str) -> int:
    """``MemTotal`` / ``MemAvailable`` of /proc/meminfo in bytes (os.sysconf without it)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = "SC_PHYS_PAGES" if key == "MemTotal" else "SC_AVPHYS_PAGES"
    return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")


class CUDA_Accelerator:  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's `deepspeed.accelerator.cuda_accelerator.CUDA_Accelerator`: torch.cuda."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_synchronized_device(self) -> bool:
        """DeepSpeed's `accelerator.is_synchronized_device`: False (CUDA runs asynchronously)."""
        return False

    def use_host_timers(self) -> bool:
        """DeepSpeed's `accelerator.use_host_timers`: whether the device is synchronized."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """DeepSpeed's `accelerator.resolves_data_dependency`: as is_synchronized_device."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """DeepSpeed's `accelerator.handles_memory_backpressure`: as is_synchronized_device."""
        return self.is_synchronized_device()

    def device_name(self, device_index: int | None = None) -> str:
        """DeepSpeed's `accelerator.device_name`: ``cuda`` or ``cuda:i``."""
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        """DeepSpeed's `accelerator.device`: torch.device('cuda', i)."""
        return torch.device("cuda") if device_index is None else torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        """DeepSpeed's `accelerator.set_device`: torch.cuda.set_device."""
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """DeepSpeed's `accelerator.current_device`: torch.cuda.current_device."""
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        """DeepSpeed's `accelerator.current_device_name`: ``cuda:<current device>``."""
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        """DeepSpeed's `accelerator.device_count`: torch.cuda.device_count."""
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        """DeepSpeed's `accelerator.synchronize`: torch.cuda.synchronize."""
        torch.cuda.synchronize(device_index)

    # -- RNG ---------------------------------------------------------------------------------
    def random(self) -> Any:
        """DeepSpeed's `accelerator.random`: torch.random."""
        return torch.random

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """DeepSpeed's `accelerator.get_rng_state`: torch.cuda.get_rng_state."""
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """DeepSpeed's `accelerator.set_rng_state`: torch.cuda.set_rng_state."""
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def manual_seed(self, seed: int) -> None:
        """DeepSpeed's `accelerator.manual_seed`: torch.cuda.manual_seed."""
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """DeepSpeed's `accelerator.manual_seed_all`: torch.cuda.manual_seed_all."""
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        """DeepSpeed's `accelerator.initial_seed`: torch.cuda.initial_seed."""
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int) -> Any:
        """DeepSpeed's `accelerator.default_generator`: torch.cuda.default_generators[i]."""
        return torch.cuda.default_generators[device_index]

    # -- streams and events ----------------------------------------------------------------
    @property
    def Stream(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        """DeepSpeed's `accelerator.Stream`: torch.cuda.Stream."""
        return torch.cuda.Stream

    def stream(self, stream: Any) -> Any:
        """DeepSpeed's `accelerator.stream`: torch.cuda.stream(stream)."""
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        """DeepSpeed's `accelerator.current_stream`: torch.cuda.current_stream."""
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        """DeepSpeed's `accelerator.default_stream`: torch.cuda.default_stream."""
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        """DeepSpeed's `accelerator.Event`: torch.cuda.Event."""
        return torch.cuda.Event

    # -- memory ------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """DeepSpeed's `accelerator.empty_cache`: torch.cuda.empty_cache."""
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.memory_allocated`: torch.cuda.memory_allocated."""
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.max_memory_allocated`: torch.cuda.max_memory_allocated."""
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """DeepSpeed's `accelerator.reset_max_memory_allocated`: torch.cuda's peak reset."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.memory_cached`: torch.cuda.memory_reserved."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.max_memory_cached`: torch.cuda.max_memory_reserved."""
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """DeepSpeed's `accelerator.reset_max_memory_cached`: torch.cuda's peak reset."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """DeepSpeed's `accelerator.memory_stats`: torch.cuda.memory_stats."""
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """DeepSpeed's `accelerator.reset_peak_memory_stats`: torch.cuda's."""
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.memory_reserved`: torch.cuda.memory_reserved."""
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.max_memory_reserved`: torch.cuda.max_memory_reserved."""
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.total_memory`: the device's total memory."""
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.available_memory`: torch.cuda.mem_get_info's free bytes."""
        return torch.cuda.mem_get_info(device_index)[0]

    # -- data types and the rest -------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        """DeepSpeed's `accelerator.is_bf16_supported`: torch.cuda.is_bf16_supported."""
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """DeepSpeed's `accelerator.is_fp16_supported`: True (every CUDA device torch runs)."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        """DeepSpeed's `accelerator.supported_dtypes`: fp32, fp16, and bf16 where supported."""
        dtypes = [torch.float, torch.half]
        return dtypes + [torch.bfloat16] if self.is_bf16_supported() else dtypes

    def is_available(self) -> bool:
        """DeepSpeed's `accelerator.is_available`: torch.cuda.is_available."""
        return torch.cuda.is_available()

    def communication_backend_name(self) -> str:
        """DeepSpeed's `accelerator.communication_backend_name`: nccl (gloo on the CPU)."""
        return self._communication_backend_name

    def is_triton_supported(self) -> bool:
        """DeepSpeed's `accelerator.is_triton_supported`: False (meshzero builds no kernels)."""
        return False

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> Any:
        """DeepSpeed's `accelerator.range_push`: torch.cuda.nvtx.range_push."""
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> Any:
        """DeepSpeed's `accelerator.range_pop`: torch.cuda.nvtx.range_pop."""
        return torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Any) -> Any:
        """DeepSpeed's `accelerator.lazy_call`: calls ``callback`` now."""
        return callback()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """DeepSpeed's `accelerator.pin_memory`: tensor.pin_memory()."""
        return tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """DeepSpeed's `accelerator.is_pinned`: tensor.is_pinned()."""
        return tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """DeepSpeed's `accelerator.on_accelerator`: whether ``tensor`` is on this device type."""
        return tensor.device.type == self._name

    def create_op_builder(self, op_name: str) -> Any:
        """DeepSpeed's `accelerator.create_op_builder`: raises (meshzero builds no ops)."""
        raise NotImplementedError(
            f"create_op_builder({op_name!r}): meshzero builds no DeepSpeed ops; its "
            "optimizers are meshzero.deepspeed.ops.adam.FusedAdam / DeepSpeedCPUAdam over torch")

    def get_op_builder(self, class_name: str) -> Any:
        """DeepSpeed's `accelerator.get_op_builder`: raises (meshzero builds no ops)."""
        return self.create_op_builder(class_name)


    # DeepSpeed's typed-tensor constructors: torch.tensor on this accelerator in one dtype
    # (Megatron-DeepSpeed builds its index and mask tensors with LongTensor / ByteTensor)
    def _typed(self, dtype: torch.dtype) -> Any:
        return functools.partial(torch.tensor, dtype=dtype, device=self.current_device_name())

    @property
    def BFloat16Tensor(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        """DeepSpeed's `accelerator.BFloat16Tensor`: torch.tensor(dtype=bfloat16) here."""
        return self._typed(torch.bfloat16)

    @property
    def ByteTensor(self) -> Any:  # noqa: N802
        """DeepSpeed's `accelerator.ByteTensor`: torch.tensor(dtype=uint8) here."""
        return self._typed(torch.uint8)

    @property
    def DoubleTensor(self) -> Any:  # noqa: N802
        """DeepSpeed's `accelerator.DoubleTensor`: torch.tensor(dtype=float64) here."""
        return self._typed(torch.double)

    @property
    def FloatTensor(self) -> Any:  # noqa: N802
        """DeepSpeed's `accelerator.FloatTensor`: torch.tensor(dtype=float32) here."""
        return self._typed(torch.float)

    @property
    def HalfTensor(self) -> Any:  # noqa: N802
        """DeepSpeed's `accelerator.HalfTensor`: torch.tensor(dtype=float16) here."""
        return self._typed(torch.half)

    @property
    def IntTensor(self) -> Any:  # noqa: N802
        """DeepSpeed's `accelerator.IntTensor`: torch.tensor(dtype=int32) here."""
        return self._typed(torch.int)

    @property
    def LongTensor(self) -> Any:  # noqa: N802
        """DeepSpeed's `accelerator.LongTensor`: torch.tensor(dtype=int64) here."""
        return self._typed(torch.long)


class CPU_Accelerator(CUDA_Accelerator):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's `deepspeed.accelerator.cpu_accelerator.CPU_Accelerator`: the CPU, gloo."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self.max_mem = _rss()  # the peak RSS seen since the last reset

    def is_synchronized_device(self) -> bool:
        """DeepSpeed's `accelerator.is_synchronized_device`: True (the CPU is synchronous)."""
        return True

    def device_name(self, device_index: int | None = None) -> str:
        """DeepSpeed's `accelerator.device_name`: ``cpu``."""
        return "cpu"

    def device(self, device_index: int | None = None) -> Any:
        """DeepSpeed's `accelerator.device`: None, as DeepSpeed's CPU accelerator."""
        return None

    def set_device(self, device_index: int) -> None:
        """DeepSpeed's `accelerator.set_device`: nothing to set on the CPU."""

    def current_device(self) -> int:
        """DeepSpeed's `accelerator.current_device`: $LOCAL_RANK (0 without torchrun)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        """DeepSpeed's `accelerator.current_device_name`: ``cpu``."""
        return "cpu"

    def device_count(self) -> int:
        """DeepSpeed's `accelerator.device_count`: $LOCAL_SIZE or $LOCAL_WORLD_SIZE, else 1."""
        return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)

    def synchronize(self, device_index: int | None = None) -> None:
        """DeepSpeed's `accelerator.synchronize`: nothing to wait for on the CPU."""

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """DeepSpeed's `accelerator.get_rng_state`: torch.get_rng_state."""
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """DeepSpeed's `accelerator.set_rng_state`: torch.set_rng_state."""
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> None:
        """DeepSpeed's `accelerator.manual_seed`: torch.manual_seed."""
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """DeepSpeed's `accelerator.manual_seed_all`: torch.manual_seed."""
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        """DeepSpeed's `accelerator.initial_seed`: torch.initial_seed."""
        return torch.initial_seed()

    def default_generator(self, device_index: int) -> Any:
        """DeepSpeed's `accelerator.default_generator`: torch.default_generator."""
        return torch.default_generator

    @property
    def Stream(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        """DeepSpeed's `accelerator.Stream`: None (the CPU has no streams)."""
        return None

    def stream(self, stream: Any) -> Any:
        """DeepSpeed's `accelerator.stream`: a context that does nothing."""
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        """DeepSpeed's `accelerator.current_stream`: None."""
        return None

    def default_stream(self, device_index: int | None = None) -> Any:
        """DeepSpeed's `accelerator.default_stream`: None."""
        return None

    @property
    def Event(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        """DeepSpeed's `accelerator.Event`: None (the CPU has no events)."""
        return None

    def empty_cache(self) -> None:
        """DeepSpeed's `accelerator.empty_cache`: nothing cached on the CPU."""

    def _peak(self) -> int:
        self.max_mem = max(self.max_mem, _rss())
        return self.max_mem

    def memory_allocated(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.memory_allocated`: the process's resident set size."""
        self._peak()
        return _rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.max_memory_allocated`: the peak RSS seen since the reset."""
        return self._peak()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """DeepSpeed's `accelerator.reset_peak_memory_stats`: the peak restarts at the RSS now."""
        self.max_mem = _rss()

    reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats
    memory_reserved = memory_cached = memory_allocated
    max_memory_reserved = max_memory_cached = max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """DeepSpeed's `accelerator.memory_stats`: the RSS now and its peak."""
        return {"allocated_bytes.all.current": self.memory_allocated(),
                "allocated_bytes.all.peak": self.max_mem}

    def total_memory(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.total_memory`: the host's memory (/proc/meminfo MemTotal)."""
        return _meminfo("MemTotal")

    def available_memory(self, device_index: int | None = None) -> int:
        """DeepSpeed's `accelerator.available_memory`: MemAvailable of /proc/meminfo."""
        return _meminfo("MemAvailable")

    def is_bf16_supported(self) -> bool:
        """DeepSpeed's `accelerator.is_bf16_supported`: True (torch computes bf16 on CPU)."""
        return True

    def is_fp16_supported(self) -> bool:
        """DeepSpeed's `accelerator.is_fp16_supported`: torch's mkldnn fp16 check."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        """DeepSpeed's `accelerator.supported_dtypes`: fp32, bf16, and fp16 where supported."""
        return [torch.float, torch.bfloat16] + ([torch.half] if self.is_fp16_supported() else [])

    def is_available(self) -> bool:
        """DeepSpeed's `accelerator.is_available`: True."""
        return True

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> Any:
        """DeepSpeed's `accelerator.range_push`: nothing on the CPU."""
        return None

    def range_pop(self, domain: Any = None) -> Any:
        """DeepSpeed's `accelerator.range_pop`: nothing on the CPU."""
        return None

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """DeepSpeed's `accelerator.pin_memory`: ``tensor`` (no device to pin for)."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """DeepSpeed's `accelerator.is_pinned`: tensor.is_pinned()."""
        return tensor.is_pinned()
