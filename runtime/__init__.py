"""moetune's MoE runtime: EP dispatch/combine, the MoE layer, transports and the profile client.

Stays light: torch, pyzmq and msgspec only; never imports the tuner, Optuna or SQLAlchemy.
"""

from .knobs import KnobError, Knobs, default_knobs
from .profile_record import ProfileKey, ProfileRecord, nearest_bucket
from .shapes import MODELS, ModelShape, get_model

__all__ = [
    "MODELS",
    "KnobError",
    "Knobs",
    "ModelShape",
    "ProfileKey",
    "ProfileRecord",
    "default_knobs",
    "get_model",
    "nearest_bucket",
]
