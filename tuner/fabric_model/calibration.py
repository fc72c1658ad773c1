"""Calibrate a fabric preset against measured microbenchmarks (JSON lines), report the fit error.

Each measured row is turned into the model call that describes the same experiment:

* `{"probe": "nccl_a2a" | "nccl_a2a_fp8payload", "fabric": "nvlink" | "host_staged", "model", "S",
  "world", "ms"}`: one NCCL all_to_all_single dispatch (k copies per token) → `predict(...,
  phase="dispatch", layout="nccl_k_copies")` with transport `collective` (fp8 payload: compression
  fp8_e4m3; the runtime's own collective sends each token once per rank, which `predict` models by
  default: these rows describe the bare NCCL experiment, not the runtime's layout); `host_staged`
  rows ran with NCCL_P2P_DISABLE=1 → `Workload(p2p=False)`.
* `{"probe": "proxy_ce", "size", "mode", "transfers", "qps", "abi", "us"}`: the proxy probe
  (bench/results/2026-11-30_h200x2_proxy_probe.jsonl) →
  `predict_transfers` with the matching signalling / fence mode (12 emulated PEs). `qps` changed meaning at
  library ABI 19 (csrc/mt_common.cu), so a row with `qps` says the ABI it was measured at (`abi`): up to 18 the
  streams were shared by every peer (the preset's nic.shared_qps), since 19 each peer has `qps` of its own
  (qps_per_pe, nic.shared_qps 0). A `qps` without `abi`, or an `abi` newer than this moetune's library, is
  refused naming the row. The committed probe (a Python proxy of 2026-11-30, 4 streams for all 12 PEs) is given
  `abi` 18: the meaning its `qps` has.
* `{"kind": "transfers", "nodes", "transfers", "size", "knobs": {...}, "us", "put_only": false}`: a
  generic signalled-transfer microbenchmark (message-size sweep, fence cost, signal efficiency vs
  concurrency) → `predict_transfers` (`put_only: true` compares with its put-only time).

Rows the model cannot describe are reported as skipped, with the reason. The fit is a coordinate
search over the chosen parameters in log space (no scipy), minimising (per group of rows) a norm close
to the worst relative error plus a quarter of the mean squared one (so no single row is sacrificed).

A fit is checked before anyone may use it (`FitReport.problems`; `usable` is False when there are any):
only the parameters the rows constrain are fitted (the others keep the preset's sourced values, listed in
`kept`; so does one the fit moved to where the rows no longer see it, and the rest are fitted again), each fitted group needs more distinct rows than fitted parameters, every fitted value must be
positive and within the physical bounds known (PCIe 5.0, the NIC port's line rate from discovery), and
the error must be a finite number within MAX_ROW_ERR per row and MAX_MEAN_ERR on average. `calibrated_preset`
labels a kept parameter whose source said "calibrated:" as "kept:" (these rows did not fit it).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetune.runtime.csrc_build import ABI_VERSION
from moetune.runtime.knobs import Knobs
from moetune.runtime.shapes import get_model
from moetune.tuner.fabric_model.predict import predict, predict_transfers
from moetune.tuner.fabric_model.presets import Preset, load_preset, read_text_file
from moetune.tuner.fabric_model.records import Workload
from moetune.tuner.progress import Progress

# Parameters fitted by default, per preset family of measurement.
# "a+b" ties parameters (fitted as one value).
COLLECTIVE_PARAMS = ("collective.alpha_us", "collective.sync_us", "collective.intra_gbps", "collective.host_alpha_us",
                     "pcie.d2h_gbps", "pcie.h2d_gbps")
PROXY_PARAMS = ("proxy.put_us", "proxy.signal_us", "proxy.fence_us", "nic.msg_overhead_us",
                "nic.signal_overhead_us", "nic.rtt_us", "nic.gbps+nic.qp_gbps")

# Physical ceilings a fit may not cross (PCIe 5.0 x16 is 63 GB/s raw per direction; an efficiency is a fraction of
# its peak, as the preset loader requires).
PHYSICAL_MAX = {"pcie.d2h_gbps": 63.0, "pcie.h2d_gbps": 63.0, "gpu.gemm_efficiency": 1.0,
                "collective.nic_efficiency": 1.0}
# Parameters bounded by the NIC port's line rate (GB/s) when the caller knows it (discovery's facts)
NIC_RATE_PARAMS = ("nic.gbps", "nic.qp_gbps")

# Identifiability. Sensitivity = d ln(predicted) / d ln(parameter) per distinct row. A parameter whose
# sensitivities have a norm below MIN_SENSITIVITY (doubling it moves no row by more than ~1.4%) is not seen
# by the rows; one whose sensitivities lie within MIN_INDEPENDENCE (relative) of a mix of the already
# chosen parameters' cannot be told apart from them (e.g. two latencies added to every row). Either way the
# fit could put it anywhere, so it keeps the preset's (sourced) value instead of a meaningless fitted one.
MIN_SENSITIVITY = 0.02
MIN_INDEPENDENCE = 0.05
# A usable fit: no row off by more than 30%, 15% on average (the committed nvlink-h200x2 calibration: max
# 19.6%, mean 6.0%); the model's own checks are stated per row at 20-25%.
MAX_ROW_ERR = 0.30
MAX_MEAN_ERR = 0.15
WORST_SHOWN = 3  # rows named in a poor-fit problem
# progress steps of a fit's random search (40 trials per parameter): about as long each as a refinement round
SEARCH_STEPS = 10

_PROBE_MODES = {
    "coupled_drain": ("coupled", "proxy_drain"),
    "decoupled_drain": ("decoupled", "proxy_drain"),
    "coupled_ordered": ("coupled", "nic_ordered"),
    "decoupled_ordered": ("decoupled", "nic_ordered"),
}


@dataclass
class Point:
    label: str
    measured_us: float
    evaluate: Callable[[Preset], float]
    group: str
    predicted_us: float = 0.0
    world: int | None = None  # the ranks the row measured together, where the row says (its "world")
    tokens: int | None = None  # the tokens per GPU the row measured, where the row says (its "S")

    @property
    def rel_err(self) -> float:
        return (self.predicted_us - self.measured_us) / self.measured_us


@dataclass
class FitReport:
    preset: Preset
    points: list[Point]
    skipped: list[tuple[str, str]]
    params_before: dict[str, float]
    params_after: dict[str, float]
    fitted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # parameter -> why the rows do not constrain it
    problems: list[str] = field(default_factory=list)  # why the fit cannot be trusted; empty: usable
    # the variables every row fitted says it was measured under (`measurement_env` of tuner/measure/micro.py rows:
    # NCCL_NVLS_ENABLE=0 ...); None where a row says nothing of it (a file of another tool, an older bring-up)
    measurement_env: dict[str, str] | None = None

    @property
    def usable(self) -> bool:
        return not self.problems

    def worst(self, n: int = WORST_SHOWN) -> list[Point]:
        return _worst(self.points, n)

    def summary(self) -> dict[str, Any]:
        errs = [abs(p.rel_err) for p in self.points]
        by_group: dict[str, list[float]] = {}
        for p in self.points:
            by_group.setdefault(p.group, []).append(abs(p.rel_err))
        return {
            "points": len(self.points),
            "skipped": len(self.skipped),
            "mean_abs_rel_err": sum(errs) / len(errs) if errs else float("nan"),
            "max_abs_rel_err": max(errs) if errs else float("nan"),
            "by_group": {g: {"points": len(v), "mean_abs_rel_err": sum(v) / len(v), "max_abs_rel_err": max(v)}
                         for g, v in by_group.items()},
        }

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data: a number that is not finite (a NaN error) is None, as JSON has no NaN."""
        return finite_or_none({
            "modelled": True,
            "preset": self.preset.name,
            "fitted": self.fitted,
            "params_before": {k: self.params_before[k] for k in self.fitted},
            "params_after": {k: self.params_after[k] for k in self.fitted},
            "kept": dict(self.kept),
            "usable": self.usable,
            "problems": list(self.problems),
            "summary": self.summary(),
            "points": [{"label": p.label, "group": p.group, "measured_us": p.measured_us,
                        "predicted_us": p.predicted_us, "rel_err": p.rel_err} for p in self.points],
            "skipped": [{"row": r, "reason": why} for r, why in self.skipped],
        })


def finite_or_none(value: Any) -> Any:
    """`value` with every non-finite float in it (nested in dicts and lists) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


# The fields each probe's row must carry, and what each must be: "int" a positive integer, "num" a positive
# finite number, "ms" one whose value in µs (x 1000, as the fit reads it) is finite too, "str" a string, "dict" a
# JSON object, "fabric" one of FABRICS. Optional fields are checked where present.
_POS_INT, _POS_NUM, _POS_MS, _STR, _DICT, _BOOL, _FABRIC = "int", "num", "ms", "str", "dict", "bool", "fabric"
# The fabrics a collective row may name (tuner/measure/micro.py, bench/tools/gpu_model_baseline.py): nvlink, host_staged
# and, on a node without GPUs, collective (gloo between host processes: micro.py's CPU rows, modelled as the direct
# collective, p2p); anything else (a typo such as "host-staged") would silently be modelled as NVLink p2p: refused.
FABRICS = ("nvlink", "host_staged", "collective")
_COLLECTIVE_FIELDS = {"model": _STR, "fabric": _FABRIC, "S": _POS_INT, "ms": _POS_MS}
ROW_FIELDS: dict[str, dict[str, str]] = {
    "nccl_a2a": _COLLECTIVE_FIELDS,
    "nccl_a2a_fp8payload": _COLLECTIVE_FIELDS,
    "collective_a2a": _COLLECTIVE_FIELDS,
    "proxy_ce": {"mode": _STR, "size": _POS_INT, "transfers": _POS_INT, "us": _POS_NUM},
    "transfers": {"knobs": _DICT, "nodes": _POS_INT, "transfers": _POS_INT, "size": _POS_INT, "us": _POS_NUM},
}
ROW_OPTIONAL: dict[str, dict[str, str]] = {
    "nccl_a2a": {"world": _POS_INT},
    "nccl_a2a_fp8payload": {"world": _POS_INT},
    "collective_a2a": {"world": _POS_INT},
    "proxy_ce": {"pes": _POS_INT, "qps": _POS_INT, "abi": _POS_INT},
    "transfers": {"put_only": _BOOL},
}
# The library ABI from which the proxy engine's `qps` counts streams per peer (npeers x qps streams); up to the ABI
# before it, `qps` streams in all, shared by every peer (csrc/mt_common.cu, the ABI 19 note)
QPS_PER_PEER_ABI = 19
MAX_QPS_PER_PEER = 64  # csrc/proxy_engine.h MT_MAX_QPS (the knob qps_per_pe's bound)


def _qps_problem(row: dict[str, Any]) -> str | None:
    """Why a proxy_ce row's `qps` has no meaning the model knows (its `abi` missing or newer than this library's),
    or None."""
    if "qps" not in row:
        return None  # the preset's streams, whatever the ABI
    if "abi" not in row:
        return (f"field 'qps' without field 'abi': qps counts the streams shared by every peer up to library ABI "
                f"{QPS_PER_PEER_ABI - 1} and the streams of each peer since ABI {QPS_PER_PEER_ABI}; add the ABI the "
                f"row was measured at (`mt_abi_version`)")
    abi = int(row["abi"])
    if abi > ABI_VERSION:
        return (f"field 'abi' is {abi}, newer than this moetune's library (ABI {ABI_VERSION}): what its 'qps' means is "
                "not known here")
    if abi >= QPS_PER_PEER_ABI and int(row["qps"]) > MAX_QPS_PER_PEER:
        return f"field 'qps' is {row['qps']} per peer, more than the engine takes ({MAX_QPS_PER_PEER}, MT_MAX_QPS)"
    return None


def _field_problem(name: str, value: Any, want: str) -> str | None:
    """Why `value` is not what field `name` must hold, or None."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if number and isinstance(value, int):
        try:  # JSON integers are unbounded: one too large for a float is no finite number here
            float(value)
        except OverflowError:
            value = math.inf
    if want == _POS_INT:
        # JSON writers may give 4096.0 for an integer; accept integral floats
        if not number or not math.isfinite(value) or value != int(value) or value <= 0:
            return f"field {name!r} must be a positive integer, got {value!r}"
    elif want in (_POS_NUM, _POS_MS):
        # measured times are divided by (relative error): 0, negative or NaN would break the fit
        if not number or not math.isfinite(value) or value <= 0:
            return f"field {name!r} must be a positive number, got {value!r}"
        # 1e308 ms is finite, its µs are not: the row's error would be NaN and pass every check
        if want == _POS_MS and not math.isfinite(value * 1e3):
            return f"field {name!r} is {value!r} ms, too large to be a time (not a finite number of µs)"
    elif want == _FABRIC:
        if value not in FABRICS:
            return f"field {name!r} must be one of {', '.join(FABRICS)}, got {value!r}"
    elif want == _STR:
        if not isinstance(value, str):
            return f"field {name!r} must be a string, got {value!r}"
    elif want == _DICT:
        if not isinstance(value, dict):
            return f"field {name!r} must be a JSON object, got {value!r}"
    elif want == _BOOL and not isinstance(value, bool):
        return f"field {name!r} must be true or false, got {value!r}"
    return None


def row_probe(row: dict[str, Any]) -> Any:
    """The probe a row is from (`probe`, or `kind` for generic transfer rows)."""
    return row.get("probe") or row.get("kind")


def row_problem(row: dict[str, Any]) -> str | None:
    """Why a row of a probe the model knows is malformed (a missing field, a wrong type, a
    non-positive number), or None. Rows of unknown probes are not checked (they are skipped)."""
    probe = row_probe(row)
    if not isinstance(probe, str) or probe not in ROW_FIELDS:
        return None
    for name, want in ROW_FIELDS[probe].items():
        if name not in row:
            return f"missing field {name!r}"
        why = _field_problem(name, row[name], want)
        if why:
            return why
    for name, want in ROW_OPTIONAL.get(probe, {}).items():
        if name in row:
            why = _field_problem(name, row[name], want)
            if why:
                return why
    if probe == "proxy_ce":
        return _qps_problem(row)
    return None


def _read_text(path: Path) -> str:
    return read_text_file(path, "measurement file", "a JSON lines file", ValueError)


def read_rows(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """The JSON-object rows of measurement files (JSON lines). A ValueError names the file and row (line
    number) where a file cannot be read, a line is not a JSON object, or a row of a known probe is malformed."""
    return [row for _, row in read_located(paths)]


def read_located(paths: Iterable[str | Path]) -> list[tuple[str, dict[str, Any]]]:
    """`read_rows`, each row with where it was read ("FILE:LINE"), so a skipped row can be named by its line."""
    rows: list[tuple[str, dict[str, Any]]] = []
    for path in paths:
        path = Path(path)
        for n, line in enumerate(_read_text(path).splitlines(), 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            except ValueError as e:  # an integer of more digits than Python converts
                raise ValueError(f"{path}:{n}: not JSON that can be read ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object")
            why = row_problem(row)
            if why:
                raise ValueError(f"{path} row {n} (probe {row_probe(row)}): {why}")
            rows.append((f"{path}:{n}", row))
    return rows


class NoPoints(ValueError):
    """No row the model can describe: `rows` rows given, `skipped` the (1-based row number, reason) of each."""

    def __init__(self, rows: int, skipped: list[tuple[int, str]]) -> None:
        self.rows, self.skipped = rows, skipped
        super().__init__("no measurement rows the model can describe" + (
            ": no rows given" if not rows else f": every one of the {rows} row(s) was skipped ("
            + "; ".join(f"row {n}: {why}" for n, why in skipped[:3]) + (", ..." if len(skipped) > 3 else "") + ")"))


def rows_to_points(rows: list[dict[str, Any]]) -> tuple[list[Point], list[tuple[str, str]]]:
    points, skipped, _ = _to_points(rows)
    return points, skipped


def _to_points(rows: list[dict[str, Any]]) -> tuple[list[Point], list[tuple[str, str]], list[int]]:
    """rows_to_points, and the (1-based) number of each skipped row."""
    points: list[Point] = []
    skipped: list[tuple[str, str]] = []
    at: list[int] = []
    for n, row in enumerate(rows, 1):
        got = _row_point(n, row)
        if isinstance(got, Point):
            points.append(got)
        else:
            skipped.append(got)
            at.append(n)
    return points, skipped, at


def _row_point(n: int, row: dict[str, Any]) -> Point | tuple[str, str]:
    """The Point describing row `n`, or (label, why it is skipped); a ValueError where the row is malformed."""
    if not isinstance(row, dict):
        raise ValueError(f"row {n}: expected a JSON object, got {type(row).__name__}")
    probe = row_probe(row)
    # callers that skip read_rows (lists built in code) get the same checks, by row index
    why = row_problem(row)
    if why:
        raise ValueError(f"row {n} (probe {probe}): {why}")
    label = json.dumps(row, sort_keys=True)[:160]
    if probe in ("nccl_a2a", "nccl_a2a_fp8payload", "collective_a2a"):
        try:
            model = get_model(row["model"])
            fabric = row["fabric"]
            w = Workload(model, int(row["S"]), 1, int(row.get("world", 2)), p2p=fabric != "host_staged")
            knobs = Knobs(transport="collective", fence_mode="none",
                          compression="fp8_e4m3" if probe.endswith("fp8payload") else "none")
        except (KeyError, ValueError) as e:
            return (label, f"cannot describe: {e}")
        if w.pes < 2:  # predict gives gpu.launch_us for it whatever was measured: no call to fit
            return (label, "world 1: an all-to-all of one rank exchanges nothing, so the model has no call to "
                           "describe (it models exchanges between 2 or more ranks)")
        name = f"{probe} {fabric} {row['model']} S={row['S']}"
        if "world" not in row:  # modelled at 2 ranks: the fit's table says so (no [calibration] world is recorded)
            name += " (world 2 assumed: the row names none)"
        return Point(name, float(row["ms"]) * 1e3,
                     lambda pr, w=w, k=knobs: predict(pr, w, k, phase="dispatch",
                                                     layout="nccl_k_copies").dispatch_us,
                     group=f"collective/{fabric}", world=int(row["world"]) if "world" in row else None,
                     tokens=int(row["S"]))
    elif probe == "proxy_ce":
        mode = row.get("mode")
        size, transfers = int(row["size"]), int(row["transfers"])
        dests = int(row.get("pes", 12))
        # the copy-engine streams the probe ran on (its QPs): up to ABI 18 shared by every emulated peer (the
        # preset's nic.shared_qps), since ABI 19 `qps` per peer (qps_per_pe, no shared streams: nic.shared_qps 0,
        # peer_hash as the probe maps them); a row that names none is modelled on the preset's
        qps = int(row["qps"]) if "qps" in row else None
        per_peer = qps is not None and int(row["abi"]) >= QPS_PER_PEER_ABI
        shared, qps_per_pe = (0, qps) if per_peer else (qps, 1)
        name = f"proxy_ce {mode} {size} B x{transfers}"
        if mode == "put_only":
            knobs = Knobs(transport="proxy", signalling="decoupled", fence_mode="nic_ordered", qps_per_pe=qps_per_pe)
            def fn(pr, k=knobs, s=size, t=transfers, d=dests, q=shared):
                return (predict_transfers(_on_streams(pr, q), 1, t, s, k, destinations=d).put_only_us)
        elif mode in _PROBE_MODES:
            sig, fm = _PROBE_MODES[mode]
            knobs = Knobs(transport="proxy", signalling=sig, fence_mode=fm, qps_per_pe=qps_per_pe)
            def fn(pr, k=knobs, s=size, t=transfers, d=dests, q=shared):
                return (predict_transfers(_on_streams(pr, q), 1, t, s, k, destinations=d).time_us)
        else:
            return (label, f"unknown proxy_ce mode {mode!r} (known: put_only, {', '.join(_PROBE_MODES)})")
        return Point(name, float(row["us"]), fn, group="proxy_probe")
    elif probe == "transfers":
        try:
            knobs = Knobs.from_dict(row["knobs"])
            nodes, transfers, size = int(row["nodes"]), int(row["transfers"]), int(row["size"])
        except (KeyError, ValueError) as e:
            return (label, f"cannot describe: {e}")
        field_name = "put_only_us" if row.get("put_only") else "time_us"
        return Point(f"transfers {knobs.signalling}/{knobs.fence_mode} {size} B x{transfers}",
                     float(row["us"]),
                     lambda pr, k=knobs, n=nodes, t=transfers, s=size, f=field_name:
                     getattr(predict_transfers(pr, n, t, s, k), f),
                     group="transfers")
    elif probe == "peer_copy":
        return (label, "peer_copy rows time a fixed ~2.37 ms for every size up to 64 MB "
                       "(host-side timing overhead), so they carry no bandwidth information")
    elif probe is None:
        return (label, "no 'probe' field: a row names what it measured (\"probe\": "
                       f"{', '.join(k for k in ROW_FIELDS if k != 'transfers')}; or \"kind\": transfers)")
    else:
        return (label, f"unknown probe {probe!r} (known: {', '.join(ROW_FIELDS)})")


def _on_streams(preset: Preset, qps: int | None) -> Preset:
    """`preset` with the proxy probe's `qps` shared streams as its nic.shared_qps (0: none shared, each peer its own;
    unchanged where the row names none or they agree; a preset without [nic] is refused by `predict_transfers` as
    before)."""
    nic = preset.params.get("nic", {})
    if qps is None or "shared_qps" not in nic or nic["shared_qps"] == qps:
        return preset
    return preset.with_params({"nic.shared_qps": qps})


def _objective(points: list[Point], preset: Preset) -> float:
    """Per group of points: the L16 norm of the relative errors (close to the worst point: the checks
    are stated per row) plus a quarter of the mean squared error; summed over groups
    (groups depend on disjoint parameters, so one group's outlier does not bend another's fit)."""
    groups: dict[str, list[float]] = {}
    for p in points:
        v = p.evaluate(preset)
        if not (v > 0 and math.isfinite(v)):
            return float("inf")
        groups.setdefault(p.group, []).append((v / p.measured_us - 1.0) ** 2)
    # an L16 norm: close to the worst point, but it still pushes down the runner-up errors
    return sum((sum(e**8 for e in se) / len(se)) ** 0.125 + 0.25 * sum(se) / len(se) for se in groups.values())


def _expand(vals: dict[str, float]) -> dict[str, float]:
    """{"a+b": v} -> {"a": v, "b": v} (tied parameters)."""
    return {k: v for spec, v in vals.items() for k in spec.split("+")}


def _sensitivities(preset: Preset, points: list[Point], specs: list[str]) -> tuple[list[float], dict[str, list[float]]]:
    """(prediction per point, {spec: d ln(prediction) / d ln(spec) per point}) at `preset` (a 10% step)."""
    base = [p.evaluate(preset) for p in points]
    now = preset.numeric()
    cols: dict[str, list[float]] = {}
    for spec in specs:
        v = now[spec.split("+")[0]]
        pr = preset.with_params({k: v * 1.1 for k in spec.split("+")})
        cols[spec] = [math.log(p.evaluate(pr) / b) / math.log(1.1) if b > 0 else 0.0 for p, b in zip(points, base, strict=True)]
    return base, cols


def _distinct(base: list[float], cols: dict[str, list[float]]) -> list[int]:
    """Indices of the distinct experiments: rows the model describes alike (same prediction and sensitivities,
    e.g. a repeated measurement) count once, as they add no independent constraint."""
    seen: dict[tuple[str, ...], int] = {}
    for i, b in enumerate(base):
        seen.setdefault(tuple(f"{x:.6g}" for x in [b, *(c[i] for c in cols.values())]), i)
    return sorted(seen.values())


def _worst(points: list[Point], n: int = WORST_SHOWN) -> list[Point]:
    """The `n` points with the largest relative error."""
    return sorted(points, key=lambda p: -abs(p.rel_err))[:n]


def _norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def _select(cols: dict[str, list[float]], order: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the parameters the rows constrain, {the others: why}): a Gram-Schmidt with pivoting over the
    sensitivity columns, taking at each step the parameter with the largest part the chosen ones do not
    already explain, while that part is at least MIN_INDEPENDENCE of its column."""
    dropped = {s: f"the rows barely move it (sensitivity {_norm(cols[s]):.3f} < {MIN_SENSITIVITY})"
               for s in order if _norm(cols[s]) < MIN_SENSITIVITY}
    remaining = [s for s in order if s not in dropped]
    chosen: list[str] = []
    basis: list[list[float]] = []
    while remaining:
        resid = {}
        for s in remaining:
            r = list(cols[s])
            for q in basis:
                d = sum(a * b for a, b in zip(r, q, strict=True))
                r = [a - d * b for a, b in zip(r, q, strict=True)]
            resid[s] = r
        ok = [s for s in remaining if _norm(resid[s]) >= MIN_INDEPENDENCE * _norm(cols[s])]
        if not ok:
            for s in remaining:
                dropped[s] = f"the rows cannot tell it apart from {', '.join(chosen)}"
            break
        best = max(ok, key=lambda s: _norm(resid[s]))  # ties: the first in `order`
        n = _norm(resid[best])
        basis.append([x / n for x in resid[best]])
        chosen.append(best)
        remaining.remove(best)
    return [s for s in order if s in chosen], dropped


def _identify(preset: Preset, points: list[Point], specs: list[str]) -> tuple[list[int], list[str], dict[str, str]]:
    """(the distinct rows among `points`, the parameters of `specs` they constrain at `preset`, {the others: why})."""
    base, cols = _sensitivities(preset, points, specs)
    idx = _distinct(base, cols)
    chosen, dropped = _select({s: [c[i] for i in idx] for s, c in cols.items()}, specs)
    return idx, chosen, dropped


def _clusters(preset: Preset, points: list[Point], params: list[str]) -> tuple[list[tuple[set[str], list[str]]], list[str]]:
    """Groups of points fitted together with the parameters that move them (groups whose parameters
    overlap are merged), and the parameters that move no point."""
    base = {id(p): p.evaluate(preset) for p in points}
    now = preset.numeric()
    affects: dict[str, set[str]] = {}
    for spec in params:
        pr = preset.with_params({k: now[spec.split("+")[0]] * 1.1 for k in spec.split("+")})
        affects[spec] = {p.group for p in points if abs(p.evaluate(pr) - base[id(p)]) > 1e-9 * base[id(p)]}
    clusters: list[tuple[set[str], list[str]]] = []
    for spec in params:
        gs = set(affects[spec])
        if not gs:
            continue
        merged = [c for c in clusters if c[0] & gs]
        for c in merged:
            clusters.remove(c)
            gs |= c[0]
        clusters.append((gs, [spec] + [x for c in merged for x in c[1]]))
    return clusters, [s for s in params if not affects[s]]


def _default_params(preset: Preset, points: list[Point]) -> list[str]:
    available = preset.numeric()
    groups = {p.group for p in points}
    params: list[str] = []
    if any(g.startswith("collective") for g in groups):
        params += [k for k in COLLECTIVE_PARAMS if all(x in available for x in k.split("+"))]
    if groups & {"proxy_probe", "transfers"}:
        params += [k for k in PROXY_PARAMS if all(x in available for x in k.split("+"))]
    return params


def _prepare(preset: Preset | str, rows: list[dict[str, Any]], params: Iterable[str] | None
             ) -> tuple[Preset, list[Point], list[tuple[str, str]], list[str]]:
    preset = load_preset(preset) if isinstance(preset, str) else preset
    points, skipped, at = _to_points(rows)
    if not points:
        raise NoPoints(len(rows), [(n, why) for n, (_, why) in zip(at, skipped, strict=True)])
    available = preset.numeric()
    params = _default_params(preset, points) if params is None else list(params)
    seen: set[str] = set()
    for spec in params:
        for k in spec.split("+"):
            if k not in available:
                raise ValueError(f"preset {preset.name!r} has no numeric parameter {k!r}")
            if k in seen:  # two identical columns: the fit took them for parameters the rows cannot tell apart and
                # kept the preset's value, so `--params a,a` refused a fit `--params a` makes
                raise ValueError(f"parameter {k!r} is named more than once in the parameters to fit "
                                 f"({', '.join(params)}): name each once")
            seen.add(k)
    for p in points:
        try:
            p.evaluate(preset)
        except ValueError as e:  # KnobError too: name the measurement the preset cannot model
            raise ValueError(f"measurement {p.label!r} cannot be modelled on preset {preset.name!r}: {e}") from None
    return preset, points, skipped, params


def _plan(preset: Preset, points: list[Point], params: list[str]) -> tuple[list[tuple[set[str], list[str]]], dict[str, str], list[str]]:
    """(clusters with only the parameters their rows constrain, {kept parameter: why}, problems of too few rows)."""
    clusters, unmoved = _clusters(preset, points, params)
    kept = {s: "no measured row depends on it" for s in unmoved}
    problems: list[str] = []
    out: list[tuple[set[str], list[str]]] = []
    for groups, specs in clusters:
        idx, chosen, dropped = _identify(preset, [p for p in points if p.group in groups], specs)
        kept.update(dropped)
        # As many rows as parameters fit any data exactly, so their error would check nothing: one row more
        # than fitted parameters at least (per group of rows sharing parameters).
        if len(idx) <= len(chosen):
            problems.append(f"too few measured rows: {len(idx)} distinct row(s) of {', '.join(sorted(groups))} for "
                            f"{len(chosen)} fitted parameter(s) ({', '.join(chosen)}); a fit needs more rows than "
                            f"parameters (the {len(specs)} parameter(s) these rows move: {', '.join(specs)})")
        if chosen:
            out.append((groups, chosen))
    return out, kept, problems


def _arbitrary(preset: Preset, points: list[Point], clusters: list[tuple[set[str], list[str]]]) -> dict[str, str]:
    """{fitted parameter: why} for those that `preset`'s values put where the rows no longer see them (or see them
    only through others): there their value is arbitrary."""
    out: dict[str, str] = {}
    for groups, specs in clusters:
        out.update(_identify(preset, [p for p in points if p.group in groups], specs)[2])
    return out


def _check(preset: Preset, points: list[Point], clusters: list[tuple[set[str], list[str]]],
           nic_line_rate_gbs: float | None, arbitrary: dict[str, str]) -> list[str]:
    """Problems of the fitted `preset` (predictions already in `points`): bounds, identifiability at the fitted
    values, the fit error."""
    problems: list[str] = []
    values = preset.numeric()
    for _groups, specs in clusters:
        for k in _expand({s: 0.0 for s in specs}):
            v = values[k]
            if not (math.isfinite(v) and v > 0):
                problems.append(f"{k} fitted to {v:.4g}: a latency or bandwidth must be positive")
            elif k in PHYSICAL_MAX and v > PHYSICAL_MAX[k] * (1 + 1e-9):
                unit = "" if k.endswith("_efficiency") else " GB/s"
                problems.append(f"{k} fitted to {v:.4g}{unit}, above the physical ceiling {PHYSICAL_MAX[k]:g}{unit}")
            elif k in NIC_RATE_PARAMS and nic_line_rate_gbs is not None and v > nic_line_rate_gbs * (1 + 1e-9):
                problems.append(f"{k} fitted to {v:.4g} GB/s, above the NIC port's line rate {nic_line_rate_gbs:g} GB/s "
                                f"({8 * nic_line_rate_gbs:g} Gb/s): the rows or the model are wrong")
    for s, why in arbitrary.items():  # `_arbitrary` at these values (calibrate's fit leaves none)
        problems.append(f"{s} at its fitted value {values[s.split('+')[0]]:.4g}: {why}, so its value is arbitrary")
    errs = [abs(p.rel_err) for p in points]
    mean = sum(errs) / len(errs)
    bad = [p for p in points if not math.isfinite(p.rel_err)]
    if bad:  # NaN compares False with every limit below: refused here, never taken for a good fit
        problems.append(f"the fit error is not a finite number for {len(bad)} row(s): " + "; ".join(
            f"{p.label} measured {p.measured_us:.4g} us, modelled {p.predicted_us:.4g} us" for p in bad[:WORST_SHOWN]))
    elif max(errs) > MAX_ROW_ERR or mean > MAX_MEAN_ERR:
        worst = _worst(points)
        problems.append(f"poor fit: max |error| {max(errs):.1%} (limit {MAX_ROW_ERR:.0%}), mean {mean:.1%} (limit "
                        f"{MAX_MEAN_ERR:.0%}); worst rows: " + "; ".join(
                            f"{p.label} measured {p.measured_us:.4g} us, modelled {p.predicted_us:.4g} us "
                            f"({p.rel_err:+.1%})" for p in worst))
    return problems


def check_preset(
    preset: Preset | str,
    rows: list[dict[str, Any]],
    *,
    params: Iterable[str] | None = None,
    nic_line_rate_gbs: float | None = None,
) -> FitReport:
    """The checks `calibrate` applies to its fit, applied to `preset` as it is (no fitting): whether these
    rows would let it stand as a calibration of `params` (default: by data kind)."""
    preset, points, skipped, params = _prepare(preset, rows, params)
    clusters, kept, problems = _plan(preset, points, params)
    for p in points:
        p.predicted_us = p.evaluate(preset)
    problems += _check(preset, points, clusters, nic_line_rate_gbs, _arbitrary(preset, points, clusters))
    values = preset.numeric()
    return FitReport(preset=preset, points=points, skipped=skipped, params_before=dict(values),
                     params_after=dict(values), fitted=list(_expand({s: 0.0 for _g, c in clusters for s in c})),
                     kept=kept, problems=problems)


def calibrate(
    preset: Preset | str,
    rows: list[dict[str, Any]],
    *,
    params: Iterable[str] | None = None,
    rounds: int = 30,
    nic_line_rate_gbs: float | None = None,
    progress: Progress | None = None,
) -> FitReport:
    """Fit the preset's parameters to the rows; returns the report (with the fitted preset). Parameters the
    rows do not constrain keep the preset's values (`kept`); `problems` says why the fit cannot be trusted
    (too few rows, a value outside its physical bounds, `nic_line_rate_gbs` included, a poor fit). `progress`:
    a task per group of rows fitted together, counted in search rounds (the fit is nearly all of the time)."""
    preset, points, skipped, params = _prepare(preset, rows, params)
    before = dict(preset.numeric())
    # A parameter the rows constrain at the preset's value may be fitted to where they no longer see it (a host
    # latency fitted small beside a bandwidth): its value there is arbitrary. It then keeps the preset's sourced
    # value, as one the rows never constrained does, and the others are fitted again without it; the fit error
    # checks whether the preset's value still describes the rows. Each pass fits fewer parameters, so this ends.
    let_go: dict[str, str] = {}
    while True:
        clusters, kept, problems = _plan(preset, points, params)
        # a second pass fits again without the parameters let go: its tasks say so (the same groups again)
        values = _fit(preset, points, clusters, rounds, progress,
                      f" again without {', '.join(sorted(let_go))}" if let_go else "")
        fitted = preset.with_params(values, source=None)
        arbitrary = _arbitrary(fitted, points, clusters)
        if not arbitrary:
            break
        for spec, why in arbitrary.items():
            let_go[spec] = (f"fitted to {values[spec.split('+')[0]]:.4g}, where {why}: the preset's value kept "
                            f"and the others fitted again")
        params = [spec for spec in params if spec not in arbitrary]
    kept.update(let_go)
    for p in points:
        p.predicted_us = p.evaluate(fitted)
    problems += _check(fitted, points, clusters, nic_line_rate_gbs, arbitrary)
    return FitReport(preset=fitted, points=points, skipped=skipped, params_before=before,
                     params_after=fitted.numeric(), fitted=list(values), kept=kept, problems=problems,
                     measurement_env=common_measurement_env(rows))


def common_measurement_env(rows: Iterable[dict[str, Any]]) -> dict[str, str] | None:
    """The variables (name=value) every one of `rows` records in its `measurement_env`; None when a row records
    none (unknown: never taken for "nothing set")."""
    common: dict[str, str] | None = None
    for row in rows:
        env = row.get("measurement_env")
        if not isinstance(env, dict):
            return None
        pairs = {str(k): str(v) for k, v in env.items()}
        common = pairs if common is None else {k: v for k, v in common.items() if pairs.get(k) == v}
    return common


def _fit(preset: Preset, points: list[Point], clusters: list[tuple[set[str], list[str]]], rounds: int,
         progress: Progress | None = None, again: str = "") -> dict[str, float]:
    """The fitted values of the clusters' parameters (expanded: tied parameters each named), from the preset's.
    `progress`: one task per cluster of SEARCH_STEPS + `rounds` steps (the random search in SEARCH_STEPS parts, then
    each refinement round: steps of about the same time; a fit that converges early completes its task)."""
    available = preset.numeric()
    fitted_specs = [s for _g, specs in clusters for s in specs]
    init = {spec: available[spec.split("+")[0]] for spec in fitted_specs}
    cur = dict(init)

    def clamp(spec: str, v: float) -> float:
        # stay within a factor 20 of the starting (physically sourced) value
        hi = min([init[spec] * 20.0] + [PHYSICAL_MAX[k] for k in spec.split("+") if k in PHYSICAL_MAX])
        return min(max(v, init[spec] / 20.0), hi)

    rng = random.Random(1234)
    for groups, specs in clusters:
        pts = [p for p in points if p.group in groups]
        task = None
        if progress is not None:
            task = progress.add(f"fit {', '.join(sorted(groups))}{again} ({len(specs)} parameter(s), {len(pts)} "
                                "row(s))", SEARCH_STEPS + rounds)

        def obj(vals: dict[str, float], pts=pts) -> float:
            return _objective(pts, preset.with_params(_expand(vals)))

        best = obj(cur)
        # seeded random search in log space (factor 4 around the start), then coordinate refinement
        part = 40 * len(specs) // SEARCH_STEPS
        for i in range(40 * len(specs)):
            trial = dict(cur)
            for spec in specs:
                trial[spec] = clamp(spec, init[spec] * math.exp(rng.uniform(-1.4, 1.4)))
            val = obj(trial)
            if val < best:
                best, cur = val, trial
            if progress is not None and (i + 1) % part == 0:
                progress.update(task, (i + 1) // part)
        step = math.log(1.5)
        for done in range(SEARCH_STEPS + 1, SEARCH_STEPS + rounds + 1):
            improved = False
            for spec in specs:
                for direction in (1.0, -1.0):
                    trial = dict(cur)
                    trial[spec] = clamp(spec, cur[spec] * math.exp(direction * step))
                    val = obj(trial)
                    if val < best - 1e-12:
                        best, cur, improved = val, trial, True
                        break
            for _ in range(3 * len(specs)):
                trial = {k: (clamp(k, v * math.exp(step * rng.gauss(0.0, 0.7))) if k in specs else v)
                         for k, v in cur.items()}
                val = obj(trial)
                if val < best - 1e-12:
                    best, cur, improved = val, trial, True
            if progress is not None:
                progress.update(task, done)
            if not improved:
                step *= 0.5
                if step < 2e-3:
                    break
        if progress is not None:  # converged before the last round: the task is complete
            progress.update(task, SEARCH_STEPS + rounds)
    return _expand(cur)


def kept_source(old: str, data_names: list[str], date: str) -> str:
    """The source of a parameter that calibration on `data_names` kept (its rows do not constrain it), whose source
    was `old` (an earlier fit's "calibrated: ..."): says so, with `old` as its value's origin."""
    return (f"kept: not constrained by {', '.join(data_names)} ({date}), so `moetune model calibrate` did not fit "
            f"it; its value's source before: {old}")


def calibrated_preset(report: FitReport, data_names: list[str], date: str, *, fingerprint: str | None = None) -> Preset:
    """The fitted preset with its sources pointing at the data and the fit error recorded (and, for a fit
    with problems, the warning: callers write such a fit only when told to). `fingerprint`: the node whose
    measurements were fitted; only a preset recording it may stand as that node's model (`--node-model`, the
    daemon's model re-tune). None: not known (recorded as nothing, never as a guess)."""
    s = report.summary()
    src = f"calibrated: fitted by `moetune model calibrate` on {', '.join(data_names)} ({date})"
    changes = {k: report.params_after[k] for k in report.fitted}
    before_src = dict(report.preset.sources)
    calib = {
        "data": data_names,
        "date": date,
        "points": s["points"],
        "mean_abs_rel_err": round(s["mean_abs_rel_err"], 4),
        "max_abs_rel_err": round(s["max_abs_rel_err"], 4),
    }
    worlds = [p.world for p in report.points if p.world]
    if worlds:  # the scale measured, where rows say it (never the default a row without "world" is modelled at)
        calib["world"] = max(worlds)
    tokens = [p.tokens for p in report.points if p.tokens]
    if tokens:  # the tokens per GPU measured, where rows say it: predictions outside are noted as extrapolated
        calib["tokens"] = [min(tokens), max(tokens)]
    if fingerprint:
        calib["fingerprint"] = fingerprint
    if report.measurement_env:  # the NCCL settings its measurements ran under (NVLS off), as NAME=VALUE
        calib["measurement_env"] = [f"{k}={v}" for k, v in sorted(report.measurement_env.items())]
    if report.kept:
        calib["kept"] = sorted(report.kept)  # not constrained by the data: the preset's sourced values
    if report.problems:
        # written anyway (`--force`): whoever loads it sees why it was refused
        calib["warning"] = "UNTRUSTED FIT, written with --force: " + " | ".join(report.problems)
        src += " [untrusted fit, see [calibration] warning]"
    out = report.preset.with_params(changes, source=src, calibration=calib)
    sources = dict(out.sources)
    for k in report.fitted:
        old = before_src.get(k, "")
        if old and not old.startswith("calibrated:"):
            sources[k] = f"{src}; started from: {old}"
    # A kept parameter was not fitted to these rows: an old "calibrated:" label would claim it was. Its other
    # sources ("assumed:", a datasheet, an earlier "kept:") still say truly where the value is from and stay.
    for spec in report.kept:
        for k in spec.split("+"):
            old = before_src.get(k, "")
            if old.startswith("calibrated:"):
                sources[k] = kept_source(old, data_names, date)
    return Preset(name=out.name, family=out.family, transports=out.transports, gpus_per_node=out.gpus_per_node,
                  description=out.description, params=out.params, sources=sources, path=None,
                  calibration=out.calibration, max_nodes=out.max_nodes)
