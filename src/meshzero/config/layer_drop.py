"""`progressive_layer_drop` (arXiv:2010.13369): the keep-probability schedule the engine
passes to the model's forward; the model drops its layers itself."""

from meshzero.config.scalars import Bool, NonNegFloat, Ratio, Section


class LayerDropConfig(Section):
    """DeepSpeed's ``progressive_layer_drop``: with ``enabled``, every training forward gets
    ``progressive_layer_drop=True`` and ``pld_theta=theta(t)`` as keyword arguments, where
    ``theta(t) = (1 - theta) exp(-gamma t) + theta`` after optimizer step t (1.0 before the
    first), as DeepSpeed's ``ProgressiveLayerDrop`` (runtime/progressive_layer_drop.py)."""

    enabled: Bool = False
    theta: Ratio = 1.0
    gamma: NonNegFloat = 0.001
