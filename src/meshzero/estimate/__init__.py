"""Memory estimates and config plans for meshzero training, counted without real memory.

    from meshzero.estimate import Cluster, estimate
    est = estimate("meshzero.demo.gpt:GPT", cluster=Cluster(nodes=1, gpus_per_node=4),
                   stage=3, precision="bf16", micro_batch=8)
    print(est)             # per-GPU table, per-node host memory, verdict
    est.model_states       # == engine.memory_report() of the rank holding the most

Model states come from the engine's own layout (zero/units.py) of the model built on the
meta device; activations and FLOPs from one forward/backward on fake tensors.
"""

from meshzero.estimate.activations import ActivationProfile, profile_activations
from meshzero.estimate.core import Estimate, Estimator, estimate
from meshzero.estimate.model import ModelSpec, load_model
from meshzero.estimate.settings import Cluster, Settings, settings_from_config
from meshzero.estimate.states import ModelStates

__all__ = ["ActivationProfile", "Cluster", "Estimate", "Estimator", "ModelSpec", "ModelStates",
           "Settings", "estimate", "load_model", "profile_activations", "settings_from_config"]
