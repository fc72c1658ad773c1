"""The scenario drivers, one module per family; importing this package registers every one in `registry.DRIVERS`."""

# every driver module registers itself (`@driver(name)`) when imported: imported here, so that whatever reads the
# registry (a scenario file's `driver` checked at load, a run) finds all of them
from moetune.tuner.measure.scenarios.drivers import (  # noqa: F401
    daemon,
    ep,
    fabric,
    line_per_case,
    moe,
    proxy,
    search,
)
