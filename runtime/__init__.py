"""moetune's MoE runtime: EP dispatch/combine, the MoE layer, transports and the profile client.

Stays light: torch, pyzmq and msgspec only; never imports the tuner, Optuna or SQLAlchemy.
"""

from typing import TYPE_CHECKING

from moetune.runtime._lazy import lazy_getattr
from moetune.runtime.knobs import KnobError, Knobs, default_knobs
from moetune.runtime.profile_record import ProfileKey, ProfileRecord, nearest_bucket
from moetune.runtime.shapes import MODELS, ModelShape, get_model

if TYPE_CHECKING:
    from moetune.runtime.buffer.facade import EPBuffer, Handle, RecvMeta
    from moetune.runtime.megakernel.engine import MegakernelUnavailable
    from moetune.runtime.moe_layer import MoELayer, dense_reference
    from moetune.runtime.options import RuntimeOptions

# The torch-backed parts load on first use, so the daemon and the client (wire schemas, knobs, profile
# records) never pay for importing torch.
_LAZY = {"EPBuffer": ".buffer", "Handle": ".buffer", "RecvMeta": ".buffer", "MoELayer": ".moe_layer",
         "dense_reference": ".moe_layer", "RuntimeOptions": ".options",
         # what MoELayer(engine="megakernel") raises where the megakernel cannot run (README): caught by name
         "MegakernelUnavailable": ".megakernel.engine"}


__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = [
    "MODELS",
    "EPBuffer",
    "Handle",
    "KnobError",
    "Knobs",
    "MegakernelUnavailable",
    "MoELayer",
    "ModelShape",
    "ProfileKey",
    "ProfileRecord",
    "RecvMeta",
    "RuntimeOptions",
    "default_knobs",
    "dense_reference",
    "get_model",
    "nearest_bucket",
]
