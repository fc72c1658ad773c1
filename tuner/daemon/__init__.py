"""The node daemon: serving profiles over ZeroMQ, re-tune jobs, rediscovery, metrics.

The public names load lazily from their modules, so importing one submodule does not import the rest.
"""

from moetune.runtime._lazy import lazy_getattr

_LAZY = {
    "CACHE_LIMIT": ".index",
    "Daemon": ".server",
    "DaemonConfigError": ".errors",
    "JsonFormatter": ".logs",
    "ProfileIndex": ".index",
    "ShapeKey": ".index",
    "TuneSettings": ".server",
    "derive_pub_endpoint": ".endpoints",
    "load_curve_keys": ".auth",
    "log": ".server",
    "FabricWatch": ".watch",
    "HANDLERS": ".handlers",
    "RetuneImpossible": ".retune",
    "TUNE_BACKENDS": ".retune",
    "check_socket_path": ".runtime_dir",
    "load_client_keys": ".auth",
    "node_model_file": ".retune",
    "read_profiles": ".index",
    "main": ".server",
    "make_discover": ".watch",
    "now": ".server",
    "prepare_runtime_dir": ".runtime_dir",
    "run_daemon": ".server",
    "setup_logging": ".logs",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


__all__ = [
    "CACHE_LIMIT",
    "HANDLERS",
    "TUNE_BACKENDS",
    "Daemon",
    "DaemonConfigError",
    "FabricWatch",
    "JsonFormatter",
    "ProfileIndex",
    "RetuneImpossible",
    "ShapeKey",
    "TuneSettings",
    "check_socket_path",
    "derive_pub_endpoint",
    "load_client_keys",
    "load_curve_keys",
    "log",
    "main",
    "make_discover",
    "node_model_file",
    "now",
    "prepare_runtime_dir",
    "read_profiles",
    "run_daemon",
    "setup_logging",
]
