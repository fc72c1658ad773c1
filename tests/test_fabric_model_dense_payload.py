"""The collective transports' dense layout in the fabric model (all MODELLED): what the runtime sends.

runtime/buffer/_dense.py + facade.py (`post_dispatch` / `post_combine` / `finish_combine`): the dense dispatch is
one all-gather of the stage rows, every capacity slot (max_tokens; the tuner builds the buffer with max_tokens =
S) to every rank whatever the routing, in the same wire row as the packed layout; combine is one reduce-scatter of
one activation-dtype row per received row, i.e. S rows to every rank, summed inside the collective (no index_add
after it). host_staged's copy-engine reduce-scatter (runtime/transports/host_staged.py `reduce_scatter_async`)
receives the `world - 1` blocks and sums the `world` blocks afterwards. The packed layout instead sends a token
only to the ranks that need it, S x P(token needs r) rows: the model must not cost the dense payload as the
packed one (nor give the dense combine the packed layout's index_add)."""

from __future__ import annotations

import pytest

from moetune.runtime.buffer.layout_choice import picks_dense
from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.presets import load_preset
from moetune.tuner.fabric_model.records import Workload

QWEN = get_model("qwen3-30b")  # H 2048 bf16, 128 experts, top-8: wire row 4096 + 64 + 32 = 4192 B
ROW, OUT_ROW = 4192, 2048 * 2
H200 = "nvlink-h200x2"


@pytest.mark.parametrize("transport", ["collective", "host_staged"])
def test_dense_dispatch_sends_every_slot_to_every_rank(transport: str) -> None:
    """qwen3-30b at EP 2 runs dense (the runtime's rule): 4096 rows of 4192 B to the other rank (not the
    4096 x 0.997 rows a packed send would carry), and the own block is all 4096 rows."""
    assert picks_dense(QWEN.experts, QWEN.topk, 2, 4096, ROW)
    r = predict(H200, Workload(QWEN, 4096, 1, 2), Knobs(transport=transport), phase="dispatch")
    assert r.bytes_on_wire == pytest.approx(4096 * ROW, rel=1e-12)
    half_hbm = load_preset(H200).get("gpu.hbm_gbps") * 1e3 / 2
    assert r.phases["dispatch.self_copy"] == pytest.approx(4096 * ROW / half_hbm, rel=1e-12)


def test_dense_payload_does_not_follow_the_routing() -> None:
    """4 ranks of ndr-ibrc-h100x8 at S=64 (dense: 64 x 4192 B per peer is under 2 MB): 3 peers x 64 rows each way,
    under uniform and skewed routing alike; the packed layout sends fewer rows and they move with the routing."""
    k = Knobs(transport="collective")
    for routing in ("uniform", "zipf:1.2"):
        d = predict("ndr-ibrc-h100x8", Workload(QWEN, 64, 1, 4, routing=routing), k)
        assert d.bytes_on_wire == pytest.approx(3 * 64 * (ROW + OUT_ROW), rel=1e-12), routing
        p = predict("ndr-ibrc-h100x8", Workload(QWEN, 64, 1, 4, routing=routing, dense=False), k)
        assert p.bytes_on_wire < d.bytes_on_wire


def test_dense_combine_sums_inside_the_collective() -> None:
    """collective: the reduce-scatter sums (no reduce phase after it); host_staged's copy-engine path sums the 2
    blocks after the copies: every block read (2 x 4096 rows) and the 4096 tokens written at HBM speed, after a
    launch (4 us, 4800 GB/s). The packed layout keeps its index_add over the returned rows."""
    w = Workload(QWEN, 4096, 1, 2)
    coll = predict(H200, w, Knobs(transport="collective"), phase="combine")
    assert "combine.reduce" not in coll.phases
    assert coll.bytes_on_wire == pytest.approx(4096 * OUT_ROW, rel=1e-12)
    hs = predict(H200, w, Knobs(transport="host_staged"), phase="combine")
    assert hs.phases["combine.reduce"] == pytest.approx(4.0 + 4096 * (2 * OUT_ROW + OUT_ROW) / 4800e3, rel=1e-12)
    packed = predict(H200, Workload(QWEN, 4096, 1, 2, dense=False), Knobs(transport="collective"), phase="combine")
    assert "combine.reduce" in packed.phases


@pytest.mark.parametrize(("field", "value"), [("dense", "packed"), ("dense", "false"), ("dense", 1),
                                               ("p2p", "false"), ("p2p", 0), ("p2p", None)])
def test_a_layout_or_p2p_that_is_no_bool_is_refused(field: str, value: object) -> None:
    """`Workload(dense="packed")` (the CLI's word for the packed layout) is a true string: it ran the DENSE layout,
    the opposite of what was asked, with no error; `p2p="false"` kept peer-to-peer on. Refused, naming the field."""
    with pytest.raises(ValueError, match=field):
        Workload(QWEN, 4096, 1, 2, **{field: value})
    # the values the field takes
    Workload(QWEN, 4096, 1, 2, dense=None)
    Workload(QWEN, 4096, 1, 2, dense=False, p2p=False)


@pytest.mark.parametrize("routing", [1.2, None, ["zipf", 1.2]])
def test_a_routing_that_is_no_text_is_refused(routing: object) -> None:
    """`Workload(routing=1.2)` failed with AttributeError: 'float' object has no attribute 'strip' (from the routing
    parser); a ValueError names the field and the forms it takes."""
    with pytest.raises(ValueError, match=r"routing must be a string \(uniform or zipf:S"):
        Workload(QWEN, 4096, 1, 2, routing=routing)  # type: ignore[arg-type]
