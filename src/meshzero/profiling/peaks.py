"""The peak FLOP/s that MFU and HFU divide by: the config's ``flops_profiler.peak_flops``, or
a table of known devices matched on the device's name, or unknown (then MFU is unknown:
a CPU has no datasheet peak, and a guess would make MFU a made-up number).
"""

from __future__ import annotations

import re
import time

import torch

# Dense bf16 tensor-core peak FLOP/s of one device, from the vendors' datasheets (without
# sparsity; SXM/OAM parts unless the key names another form factor).
PEAK_FLOPS: dict[str, float] = {
    "B200": 2250e12, "GB200": 2500e12, "B100": 1750e12,
    "H200": 989e12, "H200 NVL": 835e12, "H100": 989e12, "H100 NVL": 835e12,
    "H100 PCIe": 756e12, "H800": 989e12, "GH200": 989e12, "H20": 148e12,
    "A100": 312e12, "A800": 312e12, "A30": 165e12, "A10": 125e12,
    "L40S": 362e12, "L40": 181e12, "L4": 121e12,
    "MI325X": 1307e12, "MI300X": 1307e12, "MI250X": 383e12,
}


def table_peak(name: str) -> tuple[float, str] | None:
    """(peak, table key) for a device name such as ``NVIDIA H100 80GB HBM3``; the longest key
    that occurs in the name as a whole word wins (``H100 PCIe`` before ``H100``; ``A10`` does
    not match ``A100`` or ``A10G``, nor ``H200`` ``GH200``). None when no key matches."""
    for key, pattern in _PATTERNS:
        if pattern.search(name):
            return PEAK_FLOPS[key], key
    return None


_PATTERNS = [(key, re.compile(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", re.I))
             for key in sorted(PEAK_FLOPS, key=len, reverse=True)]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def device_peak_flops(device: torch.device, user_value: float | None,
                      name: str | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one rank's device or None, where it comes from). ``name`` overrides
    the device's own (for tests and for reports written elsewhere)."""
    if user_value is not None:
        return user_value, "flops_profiler.peak_flops"
    name = device_name(device) if name is None else name
    found = table_peak(name)
    if found is not None:
        return found[0], f"dense bf16 datasheet peak of {found[1]} (device {name!r})"
    return None, (f"unknown: no peak for device {name!r}; set flops_profiler.peak_flops")


def measure_cpu_matmul_flops(seconds: float = 0.2, n: int = 512) -> float:
    """FLOP/s of fp32 matmuls on this process's threads, measured once (``ds_report``'s CPU
    row). Not a peak: MFU on CPU uses ``flops_profiler.peak_flops`` or is unknown."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        iters += 1
    return 2 * n**3 * iters / (time.perf_counter() - t0)
