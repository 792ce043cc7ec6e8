"""The model zoo: CTR models as chains of layers with per-layer cost metadata.

Example::

    from heterps_ray.models import build_model
    spec = build_model(job.model)          # a ModelSpec
    stage = spec.build(2, 4, seed=job.seed)  # layers 2..3 as one torch module
"""

from heterps_ray.models.base import LayerChain, LayerSpec, ModelSpec, layer_seed, loss_fn
from heterps_ray.models.zoo import MODELS, NUM_DENSE, NUM_SLOTS, build_model

__all__ = [
    "MODELS",
    "NUM_DENSE",
    "NUM_SLOTS",
    "LayerChain",
    "LayerSpec",
    "ModelSpec",
    "build_model",
    "layer_seed",
    "loss_fn",
]
