"""``deepspeed.utils``: the names real code imports from it, each mapped onto meshzero."""

from __future__ import annotations

from typing import Any

from meshzero.deepspeed import lazy_attribute

# the function, not its submodule of the same name (an import of the submodule would set the
# package attribute to the module): bound here, as DeepSpeed's utils/__init__ does
from meshzero.deepspeed.utils.z3_leaf_module import z3_leaf_module as z3_leaf_module

_FRAGMENT = "meshzero.deepspeed.utils.tensor_fragment"
_LEAF = "meshzero.deepspeed.utils.z3_leaf_module"  # z3_leaf_module itself is imported above
_EXPORTS = {
    **dict.fromkeys([
        "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
        "safe_set_full_fp32_param", "safe_set_full_optimizer_state",
        "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
        "safe_set_local_fp32_param", "safe_set_local_optimizer_state"], _FRAGMENT),
    **dict.fromkeys(["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules"],
                    _LEAF),
    "clone_tensors_for_torch_save": "meshzero.deepspeed.checkpoint_utils",
    "logger": "meshzero.deepspeed.utils.logging",
    "log_dist": "meshzero.deepspeed.utils.logging",
    "RepeatingLoader": "meshzero.deepspeed.runtime.dataloader",
    "groups": "meshzero.deepspeed.utils.groups:",
    "zero_to_fp32": "meshzero.deepspeed.utils.zero_to_fp32:",
}

__all__ = sorted([*_EXPORTS, "z3_leaf_module"])


def __getattr__(name: str) -> Any:
    value = lazy_attribute(_EXPORTS, __name__, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
