"""The daemon's Prometheus families about profiles counted them without telling measured from modelled: a node
serving only a preset's predictions looked, on a dashboard, like one serving measurements. `moetune_profiles_served`
and the gauges of profiles held (current, stale, not served) carry a `provenance` label with the profile record's
values (PROVENANCES) and no others, read here through the registry /metrics serves (`generate_latest`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
import daemon_fakes as F

from moetune.runtime import wire
from moetune.runtime.knobs import default_knobs
from moetune.runtime.profile_record import PROVENANCES, ProfileKey, ProfileRecord
from moetune.runtime.shapes import MODELS
from moetune.tuner.daemon import handlers
from moetune.tuner.daemon.index import ProfileIndex
from moetune.tuner.daemon.metrics import DaemonMetrics, metrics_registry

pytestmark = pytest.mark.timeout(120)
QWEN = MODELS["qwen3-30b"]


def _rec(facts: F.FakeFacts, ep_size: int, backend: str, provenance: str, status: str = "current") -> ProfileRecord:
    key = ProfileKey(fingerprint=facts.fingerprint, software=facts.software_hash, transport_family="nvlink",
                     ep_size=ep_size, nodes=1, hidden=QWEN.hidden, intermediate=QWEN.intermediate,
                     experts=QWEN.experts, topk=QWEN.topk, dtype=QWEN.dtype, token_bucket=64)
    return ProfileRecord(key=key, knobs=default_knobs("nvlink"), latency_us=10.0, spread_us=0.1, backend=backend,
                         provenance=provenance, status=status)  # type: ignore[arg-type]


def _samples(metrics: DaemonMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics_registry(metrics)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_profiles_served_and_held_are_labelled_by_provenance(tmp_path: Path) -> None:
    d = F.in_process_daemon(tmp_path)
    try:
        d.facts = facts = F.FakeFacts({"gpu_model": "H200"})
        measured = _rec(facts, 2, "local:nccl", "measured")
        modelled = _rec(facts, 4, "model:nvlink-h200x2", "preset")
        stale = _rec(facts, 8, "model:node:" + facts.fingerprint, "node_model", status="stale")
        d.index = ProfileIndex([measured, modelled], version=1, facts=facts, stale=[stale])

        def get(ep_size: int) -> None:
            ok, _ = handlers.get_profile(d, wire.GetProfile(v=wire.PROTOCOL_VERSION, id=1, ep_size=ep_size, tokens=64,
                                                            model="qwen3-30b"))
            assert ok

        get(4)
        get(4)  # the second from the reply cache: counted as what it serves too
        get(2)
        got = _samples(d.metrics)
        served = {p: got[("moetune_profiles_served_total", (("provenance", p),))] for p in PROVENANCES}
        assert served == {"measured": 1.0, "node_model": 0.0, "preset": 2.0}, got
        # no unlabelled sample is left beside the labelled ones
        assert ("moetune_profiles_served_total", ()) not in got
        current = {p: got[("moetune_profiles_current", (("provenance", p),))] for p in PROVENANCES}
        assert current == {"measured": 1.0, "node_model": 0.0, "preset": 1.0}, got
        held_stale = {p: got[("moetune_profiles_stale", (("provenance", p),))] for p in PROVENANCES}
        assert held_stale == {"measured": 0.0, "node_model": 1.0, "preset": 0.0}, got
        assert all(got[("moetune_profiles_not_served", (("provenance", p),))] == 0.0 for p in PROVENANCES), got
        # bounded: only the record's values ever appear as the label
        labels = {dict(k[1]).get("provenance") for k in got if k[0].startswith("moetune_profiles_")}
        assert labels == set(PROVENANCES), labels
    finally:
        d.store.close()


def test_a_provenance_outside_the_record_s_set_makes_no_label() -> None:
    m = DaemonMetrics()
    with pytest.raises(ValueError, match="provenance must be one of measured, node_model, preset"):
        m.profile_served("modelled")
    m.provenance_gauges["profiles_current"] = lambda: {"measured": 3, "bogus": 7}
    got = _samples(m)
    assert got[("moetune_profiles_current", (("provenance", "measured"),))] == 3.0
    assert not any(dict(k[1]).get("provenance") == "bogus" for k in got), got
