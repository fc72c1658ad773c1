"""The queued transports (proxy, IBGDA) at decode sizes: a peer that gets no token is sent its count words only.

csrc/proxy_xchg.h `produce_exchange` writes every rank its count-matrix row (world words), then for each peer
`chunking(cnt)`: a count of 0 gives no PUT and no SIGNAL. The model took the expected rows per peer (S x P(token
needs the peer), a fraction below 1 at decode) and charged every peer at least one PUT and its signal. It now charges
PUTs to the expected number of peers that get a row, sum over peers of 1 - (1 - p)^S, rounded (the expected rows all
on them), and count words to every rank as before.

Hand-computed case: custom:1024,512,32,1 (32 experts, top-1), 2 nodes x 8 GPUs, uniform routing: each rank holds 2
experts, so a token needs a given rank with p = 2/32 = 1/16. Source PE 0 has 8 peers on the other node (the queue)
and 7 on its own (NVLink).
* S = 4: a remote peer gets a row with 1 - (15/16)^4 = 0.2275; 8 x that = 1.82 -> 2 PUTs (one signal each,
  decoupled per peer) carrying 8 x 4/16 = 2 rows; the engine's expected PUTs are 1.82, the model said 8.
* S = 1: 8 x 1/16 = 0.5 -> 1 PUT of the 0.5 expected rows (at least one where any row is expected).
* S = 256: 1 - (15/16)^256 ~ 1: all 8 peers, as before.
Combine is the same count (the most needed PE returns p = 1/16 of each owner's S tokens)."""

from __future__ import annotations

import pytest

from moetune.runtime.knobs import Knobs
from moetune.tuner.fabric_model.predict import predict
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.fabric_model.wire_rows import SIGNAL_BYTES, token_bytes

MODEL = "custom:1024,512,32,1"
CASES = [("ndr-ibrc-h100x8", Knobs(transport="proxy", fence_mode="proxy_drain")),
         ("ndr-ibgda-h100x8", Knobs(transport="ibgda", fence_mode="nic_ordered"))]


def _remote_puts(tokens: int) -> int:
    return max(1, round(8 * (1 - (15 / 16) ** tokens) + 1e-9))


@pytest.mark.parametrize(("preset", "knobs"), CASES)
@pytest.mark.parametrize(("tokens", "puts"), [(1, 1), (4, 2), (256, 8)])
def test_puts_go_only_to_the_peers_that_get_rows(preset: str, knobs: Knobs, tokens: int, puts: int) -> None:
    assert _remote_puts(tokens) == puts
    w = Workload(MODEL, tokens, 2, 8)
    for phase in ("dispatch", "combine"):
        pr = predict(preset, w, knobs, phase=phase)
        assert pr.transfers == puts, (phase, pr.transfers)


@pytest.mark.parametrize(("preset", "knobs"), CASES)
def test_the_rows_and_count_words_stay_on_the_wire(preset: str, knobs: Knobs) -> None:
    """S = 4 dispatch: bytes = count words (15 peers x (16 + 1) words) + the expected rows (8 remote x 4/16, 7 NVLink
    x 4/16) + one signal per peer that gets rows (2 remote PUTs; NVLink: 7 x 0.2275 = 1.59 -> 2 peers)."""
    w = Workload(MODEL, 4, 2, 8)
    tb = token_bytes(w.model, knobs, dispatch=True)
    pr = predict(preset, w, knobs, phase="dispatch")
    want = 15 * 17 * SIGNAL_BYTES + (8 + 7) * 4 / 16 * tb + (2 + 2) * SIGNAL_BYTES
    assert pr.bytes_on_wire == pytest.approx(want)
