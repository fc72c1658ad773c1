"""Which figure a stored latency is (its metric), read from the backend label the profile records.

A local measurement minimises either the whole layer (`layer_us`, the label `local:<comm>` it always had) or the
round trip of the exchange (`roundtrip_us`, labelled `local:<comm>:comm`). The two are different figures of the
same knobs, so the store never compares one with the other (`_rows.decide`). No sqlalchemy here: the search
backends name their label with it.
"""

from __future__ import annotations

COMM_METRIC = "comm"  # the round trip (`moetune profile`'s bring-up tune, LocalBackend(metric="comm"))
LAYER_METRIC = "layer"  # the whole layer (`moetune tune --backend local`)
MODELLED = "modelled"  # a prediction: compared only within its provenance (the store's rank rule comes first)


def metric_of_backend(backend: str) -> str:
    """The metric of a profile's number by its backend label. A label without a metric suffix is a layer number:
    the label `moetune tune` has always stored (a bring-up before the suffix stored round trips under it too; such
    a row reads as a layer number)."""
    if not backend.startswith("local:"):
        return MODELLED
    return COMM_METRIC if backend.endswith(f":{COMM_METRIC}") else LAYER_METRIC
