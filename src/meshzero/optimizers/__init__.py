"""Optimizer arithmetic torch.optim does not have, with DeepSpeed's semantics.

``optim.py`` builds the optimizer (over ZeRO's fragments); this package holds the algorithms
it may build when torch's own cannot compute what the config asks:

    adam.py  Adam / AdamW as DeepSpeed's fused and CPU kernels compute them, with
             ``bias_correction`` switchable (torch's always corrects)
    lamb.py  LAMB (DeepSpeed's ``"Lamb"``): a per-parameter trust ratio from whole-parameter
             norms, summed over the fragments a parameter is cut into under ZeRO
    onebit.py 1-bit Adam (DeepSpeed's ``"OneBitAdam"``): the momentum all-reduced in one
             bit per element with error feedback after a warm-up (stage 0)
    zeroone.py 0/1 Adam (DeepSpeed's ``"ZeroOneAdam"``): rarer variance updates, 1-bit
             gradients, then local steps synchronised in 1 bit (stage 0)
    onebit_lamb.py  1-bit LAMB (DeepSpeed's ``"OneBitLamb"``): LAMB, then 1-bit momentum
             with the trust ratio frozen and adjusted by a factor (stage 0)
"""

from meshzero.optimizers.adam import DeepSpeedAdam, adam_step
from meshzero.optimizers.lamb import FragmentNorms, Lamb
from meshzero.optimizers.onebit import OneBitAdam
from meshzero.optimizers.onebit_lamb import OneBitLamb
from meshzero.optimizers.zeroone import ZeroOneAdam

__all__ = ["DeepSpeedAdam", "FragmentNorms", "Lamb", "OneBitAdam", "OneBitLamb", "ZeroOneAdam",
           "adam_step"]
