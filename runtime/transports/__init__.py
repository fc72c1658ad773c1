"""The EP transports: how packed token rows move between the ranks of an EP group.

`base` declares the interface (`EPTransport`, its capabilities, `Availability`); `registry` maps a knob value
(`transport=...`) to its class, loaded by module path; `collective`, `host_staged`, `nvlink` and `proxy` are the
implementations (`_onesided` their shared one-sided plumbing). The public names load lazily from their modules,
so importing one submodule does not import the rest (and `import moetune.runtime.transports` alone loads no torch).
"""

from moetune.runtime._lazy import lazy_getattr

_LAZY = {
    "CAPABILITIES": ".base",
    "Availability": ".base",
    "EPTransport": ".base",
    "available_transports": ".registry",
    "get_transport": ".registry",
    "register_transport": ".registry",
    "registered_transports": ".registry",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "CAPABILITIES",
    "Availability",
    "EPTransport",
    "available_transports",
    "get_transport",
    "register_transport",
    "registered_transports",
]
