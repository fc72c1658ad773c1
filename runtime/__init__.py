"""moetune's MoE runtime: EP dispatch/combine, the MoE layer, transports and the profile client.

Stays light: torch, pyzmq and msgspec only; never imports the tuner, Optuna or SQLAlchemy.
"""

from .buffer import EPBuffer, Handle, RecvMeta
from .knobs import KnobError, Knobs, default_knobs
from .moe_layer import MoELayer, dense_reference
from .profile_record import ProfileKey, ProfileRecord, nearest_bucket
from .shapes import MODELS, ModelShape, get_model

__all__ = [
    "MODELS",
    "EPBuffer",
    "Handle",
    "KnobError",
    "Knobs",
    "MoELayer",
    "ModelShape",
    "ProfileKey",
    "ProfileRecord",
    "RecvMeta",
    "default_knobs",
    "dense_reference",
    "get_model",
    "nearest_bucket",
]
