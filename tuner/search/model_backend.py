"""The fabric-model backends: `ModelBackend` (a preset's prediction) and `NodeModelBackend` (this node's model).

Every number they give is modelled (`moetune.tuner.fabric_model.predict.predict` on a preset, or any predictor
callable: tests inject synthetic objectives); the preset helpers read what a preset states for the search.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from moetune.runtime.knobs import KnobError, Knobs
from moetune.runtime.profile_record import NODE_MODEL_BACKEND, Provenance
from moetune.tuner.search.backends import (
    MEGAKERNEL,
    BenchmarkBackend,
    Measurement,
    ReportFn,
    TuneWorkload,
    jsonable,
    one_rank_exchange,
)

_log = logging.getLogger("moetune.tuner.search.model_backend")

if TYPE_CHECKING:
    from moetune.tuner.fabric_model.presets import Preset


def _preset_name(preset: Preset) -> str:
    return preset.name


def preset_gpus_per_node(preset: Preset) -> int:
    return preset.gpus_per_node


def preset_family(preset: Preset) -> str:
    if not preset.family:
        raise ValueError(f"preset {preset.name!r} names no transport family")
    return preset.family


def preset_link_rates(preset: Preset) -> dict[str, float]:
    """The rates a preset states, for the analytic priors: link_gbps (NVLink egress, GB/s) and nic_gbit
    (the NIC's rate in Gbit/s; the preset gives GB/s); a key is absent where the preset has no such link."""
    out: dict[str, float] = {}
    link = preset.params.get("nvlink", {}).get("egress_gbps")
    if isinstance(link, (int, float)) and link > 0:
        out["link_gbps"] = float(link)
    nic = preset.params.get("nic", {}).get("gbps")
    if isinstance(nic, (int, float)) and nic > 0:
        out["nic_gbit"] = float(nic) * 8
    return out


class ModelBackend(BenchmarkBackend):
    """The fabric model on a preset (or a predictor callable for tests). Deterministic: spread 0. Its numbers are
    a preset's prediction; `NodeModelBackend` is this node's calibrated model."""

    provenance: ClassVar[Provenance] = "preset"

    def __init__(self, preset: Any = None, *, predictor: Callable[[Knobs, TuneWorkload], Any] | None = None,
                 routing: str | None = None, tile: int | None = None, warn_forced: bool = True):
        """`warn_forced=False`: a caller that tells the user of a forced fit itself (`moetune tune`'s FORCED MODEL
        banner) is not given the same warning a second time as a log line; `forced_fit` is set either way."""
        if preset is None and predictor is None:
            raise ValueError("ModelBackend needs a preset (name, path or Preset) or a predictor")
        if predictor is None:
            # The fabric model loads only when a preset is modelled (imported here, not at module level).
            from moetune.tuner.fabric_model.calibration_record import forced_fit_warning
            from moetune.tuner.fabric_model.presets import load_preset

            self.preset = load_preset(preset) if isinstance(preset, str) else preset
            # a fit the calibration checks refused (`model calibrate --force`): usable when asked for, never quietly
            self.forced_fit = forced_fit_warning(self.preset)
            if self.forced_fit and warn_forced:
                _log.warning("preset %s is a forced fit the calibration checks refused: %s",
                             getattr(self.preset, "path", None) or _preset_name(self.preset), self.forced_fit)
        else:
            self.preset = preset
            self.forced_fit = ""
        self.predictor = predictor
        self.tile = tile
        self.routing = routing
        self.name = f"model:{_preset_name(self.preset)}" if self.preset is not None else "model:custom"

    def as_node_model(self, fingerprint: str) -> NodeModelBackend:
        """This preset as the calibrated model of the node `fingerprint` (the caller checked that it is one:
        `node_model_refusal`), labelled `model:node:<fingerprint>`."""
        node = NodeModelBackend.__new__(NodeModelBackend)
        node.__dict__.update(self.__dict__)  # the loaded preset as it is (no second load, no second warning)
        node.name = NODE_MODEL_BACKEND + fingerprint
        return node

    def settings(self) -> dict[str, Any]:
        # the preset's content, not only its name: a recalibrated node model predicts other numbers
        from moetune.tuner.fabric_model.presets import preset_content

        preset = None if self.preset is None else preset_content(self.preset)
        return {"preset": preset, "routing": self.routing, "tile": self.tile}

    def pinned_knobs(self, transport: str) -> frozenset[str]:
        """Knobs the fabric model does not read on `transport` (its predictions cannot tell their values
        apart): the search keeps them at the policy default (SearchSpace(pinned=...)). None with a predictor."""
        if self.predictor is not None:
            return frozenset()
        from moetune.tuner.fabric_model.predict import KNOBS_READ

        return frozenset(Knobs.__struct_fields__) - KNOBS_READ[transport]

    def nvlink_apart(self, knobs: Knobs, workload: TuneWorkload) -> bool:
        """Whether the preset's PEs reach their node's peers over NVLink, a set of peers the model charges PUTs apart
        from the queue's (`phases.queued.nvlink_apart`): the search space's PUT grid asks the same charge. False with
        a predictor (nothing is known of its peers) or a transport that queues no PUTs."""
        if self.predictor is not None or knobs.transport not in ("proxy", "ibgda"):
            return False
        from moetune.tuner.fabric_model.params import params
        from moetune.tuner.fabric_model.phases.queued import nvlink_apart
        from moetune.tuner.fabric_model.records import Workload

        try:
            wl = Workload(model=workload.model, tokens_per_gpu=max(1, workload.tokens), nodes=workload.nodes,
                          gpus_per_node=workload.gpus_per_node)
            return nvlink_apart(params(self.preset), wl, knobs)
        except (ValueError, KnobError):  # a workload or preset the model refuses: `evaluate` says why, not this
            return False

    def refusal(self, *, ep_size: int, nodes: int, families: Sequence[str], gpu_count: int) -> str:
        from moetune.tuner.fabric_model.records import MAX_PES

        if ep_size > MAX_PES:  # refused before any study, as `model predict` refuses it (Workload)
            return (f"EP size {ep_size}: beyond what the fabric model predicts (at most {MAX_PES} ranks); give a "
                    "smaller --ep-size or --nodes")
        # a prediction stands for what it predicts, but at EP 1 that is no exchange (a ~14 µs "profile" of nothing)
        return one_rank_exchange(ep_size, families, done='a prediction of {families} would store a "modelled" profile',
                                 fix="Tune a transport family at EP size 2 or more (--ep-size 2; the default is the "
                                     "preset's GPUs per node × --nodes); the one-GPU MoE layer is measured with "
                                     "--backend local --family megakernel")

    def group_problem(self, family: str, *, ep_size: int, nodes: int) -> str:
        # the model's bound (fabric_model.params.group_problem), the one its phases refuse each trial with
        if self.predictor is not None or self.preset is None or family == MEGAKERNEL:
            return ""
        from moetune.tuner.fabric_model.params import group_problem, params
        from moetune.tuner.search.policy import transport_of_family

        return group_problem(params(self.preset), transport_of_family(family), ep_size, nodes) or ""

    def supports(self, family: str) -> bool:
        if family == MEGAKERNEL:  # the fabric model predicts exchanges, not a kernel's tiles
            return False
        if self.preset is None:
            return True
        from moetune.tuner.search.policy import transport_of_family

        fams = self.preset.transports
        try:
            return family == preset_family(self.preset) or (transport_of_family(family) in fams
                                                              and transport_of_family(family) != "proxy")
        except (ValueError, KnobError):
            return False

    def _predict(self, knobs: Knobs, workload: TuneWorkload) -> Any:
        if self.predictor is not None:
            return self.predictor(knobs, workload)
        kw: dict[str, Any] = {"routing": self.routing or workload.routing}
        if self.tile is not None:
            kw["tile"] = self.tile
        from moetune.tuner.fabric_model.predict import predict
        from moetune.tuner.fabric_model.records import Workload

        wl = Workload(model=workload.model, tokens_per_gpu=workload.tokens, nodes=workload.nodes,
                      gpus_per_node=workload.gpus_per_node, **kw)
        return predict(self.preset, wl, knobs)

    def evaluate(self, knobs: Knobs, workload: TuneWorkload, *, report: ReportFn | None = None) -> Measurement:
        try:
            pred = self._predict(knobs, workload)
        except KnobError as e:
            return Measurement.failed(f"unsafe or impossible setting: {e}", infeasible=True)
        except Exception as e:  # broad: a trial's failure is recorded, the study goes on
            return Measurement.failed(f"model error: {type(e).__name__}: {e}")
        if isinstance(pred, (int, float)):
            lat, details = float(pred), {}
        else:
            lat = float(pred.latency_us)
            details = {k: getattr(pred, k) for k in ("dispatch_us", "combine_us", "fences", "proxy_stalls",
                                                    "nic_stalls", "bytes_on_wire", "transfers") if hasattr(pred, k)}
        details["modelled"] = True
        if not math.isfinite(lat) or lat <= 0:
            return Measurement.failed(f"model returned a non-positive latency {lat}")
        return Measurement(lat, 0.0, [lat], True, details=jsonable(details))


class NodeModelBackend(ModelBackend):
    """The fabric model on this node's calibrated preset (`ModelBackend.as_node_model`): this node's model."""

    provenance: ClassVar[Provenance] = "node_model"


def space_peer_sets(backend: BenchmarkBackend, knobs: Knobs, workload: TuneWorkload) -> dict[str, Any]:
    """SearchSpace's `gpus_per_node` and `nvlink_apart` for `workload` on `backend`: the peer sets the fabric model
    charges PUTs apart (`ModelBackend.nvlink_apart`; one set on any other backend, as the runtime's proxy sends them).
    The one statement `tune` and bench/search_efficiency.py build their spaces with, so both search the same grid."""
    apart = isinstance(backend, ModelBackend) and backend.nvlink_apart(knobs, workload)
    return {"gpus_per_node": workload.gpus_per_node, "nvlink_apart": apart}
