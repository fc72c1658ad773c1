"""`moetune profile`: the bring-up flow an engineer runs when a node comes up.

discovery → microbenchmarks of each transport present → calibration of this node's fabric model →
tuning of the planned shapes and token buckets → profiles stored → summary and report.

Each stage records its completion in a state file beside the database, named after the database and the
fabric fingerprint (`state_file_name`), so Ctrl-C and a rerun continue where it stopped (tuning itself resumes
through Optuna's RDB storage). A changed fingerprint starts over. `--restart` starts over on purpose: the state is
forgotten and the tuning opens new studies (a tag in their names), so nothing is resumed and nothing
that is not this flow's is deleted (earlier studies and stored profiles stay).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import tomllib
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from moetune.runtime.config import MAX_TRIALS
from moetune.runtime.profile_record import MEGAKERNEL_FAMILY, TOKEN_BUCKETS
from moetune.runtime.shapes import get_model
from moetune.tuner.measure import (
    COUNT_MAX,  # a plan's iters, repeats and compare_rounds: as `bench ep --iters`
)
from moetune.tuner.search.progress import NoProgress, Progress
from moetune.tuner.store.atomic_files import write_atomic

STAGES = ("discover", "microbench", "calibrate", "tune", "compare", "report")
MEASURING_STAGES = ("microbench", "tune", "compare")  # what they measure is this fingerprint's
# the key of a tuned_vs_default row's `extra` that names the comparison it records: {"run": the state's
# `compare_token`, "part": the bucket, "tuned": the tuned setting compared} (`Bringup._stored_comparisons`)
COMPARED_AS = "compared_as"


@dataclass
class Plan:
    """What to tune at bring-up. `--plan FILE` (TOML) sets these fields; unknown keys are errors."""

    models: list[str] = field(default_factory=lambda: ["qwen3-30b"])
    tokens: list[int] = field(default_factory=lambda: [128, 1024, 4096])
    # bring-up measures this node: "auto" and "local" (the same: nccl on GPUs, gloo on CPU) are what plan files have
    # named; "model" is refused (a MODELLED tune is `moetune tune --backend model`, never a node's bring-up)
    backend: str = "auto"
    trials: int = 16
    repeats: int = 3
    iters: int = 20  # timed iterations inside each repeat, and of each microbenchmark size
    compare_rounds: int = 2  # interleaved rounds of the tuned-vs-default comparison
    trial_timeout_s: float = 120.0
    # message sizes (bytes) of the microbenchmarks; empty: the default sweep (micro.DEFAULT_SIZES, 1 KiB to 16 MiB)
    microbench_sizes: list[int] = field(default_factory=list)
    # EP sizes to tune, each <= the node's GPUs. Empty (the default): one EP group of every GPU of the node, the
    # group a job on the whole node runs (the largest size up to the GPU count over which every planned model's
    # experts divide; 2 gloo ranks on a node without GPUs). Smaller groups are tuned only when listed: each size is
    # a whole set of studies, and --quick stays quick.
    ep_sizes: list[int] = field(default_factory=list)
    world: int = 0  # one EP size, as plan files of earlier versions name it (same as ep_sizes = [world]); 0: not set

    @classmethod
    def quick(cls) -> Plan:
        # 2 compare rounds: with one repeat, one round gives each setting one sample, too few to call a gain
        # its short microbenchmark sweep is a plan key like the others (a --plan file on --quick may set another)
        from moetune.tuner.measure.micro import QUICK_SIZES

        return cls(models=["qwen3-30b"], tokens=[128, 1024], trials=4, repeats=1, iters=10, compare_rounds=2,
                   trial_timeout_s=60.0, microbench_sizes=list(QUICK_SIZES))

    @classmethod
    def from_file(cls, path: Path, base: Plan) -> Plan:
        where = f"plan file {path}"
        if path.is_dir():
            raise ValueError(f"{where}: is a directory, not a TOML plan file")
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{where} does not exist") from None
        except UnicodeDecodeError:
            raise ValueError(f"{where}: not a UTF-8 text file, so not a TOML plan") from None
        except OSError as e:
            raise ValueError(f"{where}: cannot read it ({e.strerror or e})") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{where}: not valid TOML: {e}") from None
        data = raw.get("plan", raw)
        beside = sorted(set(raw) - {"plan"}) if "plan" in raw else []
        if beside:  # read only the [plan] table, they were ignored without a word
            raise ValueError(f"{where}: key(s) {beside} beside the [plan] table: a file with a [plan] table is read "
                             "from that table only (move them into it)")
        if not isinstance(data, dict):
            raise ValueError(f"{where}: [plan] must be a table of the plan's keys, got {type(data).__name__}")
        known = {f for f in asdict(base)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        merged = {**asdict(base), **data}
        for key, value in merged.items():
            want = type(asdict(base)[key])
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                merged[key] = float(value)
            elif not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
                raise ValueError(f"{where}: key {key!r} must be {want.__name__}, got {type(value).__name__}")
        if "world" in data and not (isinstance(data["world"], int) and not isinstance(data["world"], bool)
                                    and data["world"] >= 2):
            raise ValueError(f"{where}: world must be an integer >= 2 (an EP exchange needs 2 GPUs; a one-GPU node "
                             f"tunes the megakernel), got {data['world']!r}")
        plan = cls(**merged)
        plan.validate(where)
        return plan

    def validate(self, where: str = "plan") -> None:
        """ValueError naming `where` (the plan file or the options) and the field, for any value the flow cannot
        run: every numeric field a positive number of the right type, lists of the right element type."""
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)  # TOML true is not a count

        if not isinstance(self.models, list) or not self.models:
            raise ValueError(f"{where}: no models to tune")
        for m in self.models:
            if not isinstance(m, str):
                raise ValueError(f"{where}: models must be model names (strings), got {m!r}")
            try:
                get_model(m)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        for name in ("tokens", "microbench_sizes"):
            v = getattr(self, name)
            if not isinstance(v, list) or (name == "tokens" and not v) or not all(is_int(t) and t > 0 for t in v):
                raise ValueError(f"{where}: {name} must be a{' non-empty' if name == 'tokens' else ''} list of "
                                 f"positive integers, got {v!r}")
        over = [t for t in self.tokens if t > TOKEN_BUCKETS[-1]]
        if over:  # each count is tuned at its nearest bucket: above the largest, that is the largest, not the count
            raise ValueError(f"{where}: tokens {over} above the largest token bucket ({TOKEN_BUCKETS[-1]} tokens per "
                             f"rank; buckets {', '.join(map(str, TOKEN_BUCKETS))}): a count is tuned at its "
                             "nearest bucket, so it would be tuned as S=" + str(TOKEN_BUCKETS[-1]))
        for name in ("trials", "repeats", "iters", "compare_rounds"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{where}: {name} must be an integer >= 1, got {v!r}")
            if name != "trials" and v > COUNT_MAX:  # a count of timed runs: 10**22 ran the first microbenchmark forever
                raise ValueError(f"{where}: {name} must be an integer from 1 to {COUNT_MAX} (as `bench ep --iters`), "
                                 f"got {v!r}")
            if name == "trials" and v > MAX_TRIALS:  # 10**20 trials: a study that never ends
                raise ValueError(f"{where}: trials must be an integer from 1 to {MAX_TRIALS}, got {v!r}")
        if not is_int(self.world) or self.world < 0 or self.world == 1:  # 0: not set
            # as ep_sizes = [1]: one rank exchanges nothing (it stored "measured" collective profiles at EP 1)
            raise ValueError(f"{where}: world must be an integer >= 2 (an EP exchange needs 2 GPUs; a one-GPU node "
                             f"tunes the megakernel), got {self.world!r}")
        e = self.ep_sizes
        if not isinstance(e, list) or not all(is_int(n) and n >= 2 for n in e):
            raise ValueError(f"{where}: ep_sizes must be a list of integers >= 2 (an EP exchange needs 2 GPUs; a "
                             f"one-GPU node tunes the megakernel), got {e!r}")
        if e and self.world and e != [self.world]:
            raise ValueError(f"{where}: give ep_sizes or world (one EP size), not both: ep_sizes {e}, world {self.world}")
        t = self.trial_timeout_s
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"{where}: trial_timeout_s must be a number of seconds > 0, got {t!r}")
        if self.backend == "model":
            raise ValueError(f"{where}: backend = \"model\": a bring-up measures this node; a MODELLED tune is "
                             "`moetune tune --backend model` (leave backend out, or give auto or local)")
        if self.backend not in ("auto", "local"):
            raise ValueError(f"{where}: backend must be auto or local (both measure this node), got {self.backend!r}")


def state_file_name(db_path: str | Path, fingerprint: str) -> str:
    """The bring-up state file's name for the profile database `db_path` on the node `fingerprint`, named as
    `study.studies_file_name` names the studies file: `NAME-bringup-<fingerprint>.json` for `NAME.db`, another name
    keeping its whole name (`x.sqlite.bringup-<fingerprint>.json`). One per database: two databases of one folder
    shared `bringup-<fingerprint>.json` (`LEGACY_STATE`), so a bring-up into the second found every stage done by
    the first, and measured and stored nothing."""
    p = Path(db_path)
    return (f"{p.stem}-" if p.suffix == ".db" else f"{p.name}.") + f"bringup-{fingerprint}.json"


LEGACY_STATE = "bringup-{}.json"  # the state file of every database of a folder, before `state_file_name`


class BringupState:
    """Completed stages and their results (an unfinished stage's finished parts, the buckets compared), persisted
    atomically after each."""

    def __init__(self, path: Path, fingerprint: str, plan: Plan, *, persist: bool = True, db: str = ""):
        self.path = path
        # db: the name of the profile database the stages stored into (recorded, and resumed only by it; "" for a
        # state of no database)
        self.data: dict[str, Any] = {"fingerprint": fingerprint, "plan": asdict(plan), "done": {}}
        if db:
            self.data["db"] = db
        self.dropped = ""  # why the stages an earlier run finished here are not resumed ("" when none were)
        # persist=False (a capture of another node, nothing measured): neither resumed nor saved, so its skipped
        # stages are never taken as done by a later bring-up on the node itself
        self.persist = persist
        if persist and path.exists() and not path.is_file():
            # read as an unreadable state it was "started over", and its first save failed after a stage ran
            raise ValueError(f"{path}: the bring-up state file's name is taken by something that is not a file (a "
                             "folder?): move it aside")
        if persist and path.exists():
            try:
                old = json.loads(path.read_text())
            except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8 (that error named no file)
                old = {}
                self.dropped = f"cannot be read as a bring-up state ({e}): starting over"
            if not isinstance(old, dict):
                old = {}
            if old.get("db", "") != db:
                # another database's stages (a copied or renamed file): what they stored is not in this one
                if old.get("done"):
                    self.dropped = (f"its finished stages stored into the database {old.get('db') or '(none named)'}, "
                                    f"not {db or '(none named)'}: starting over")
            # Resume only the same node and the same plan; anything else starts over.
            elif old.get("fingerprint") == fingerprint and old.get("plan") == asdict(plan):
                self.data = old
                kept = (old.get("partial") or {}).pop("compare", None)
                if kept and "compared" not in old:  # an older version kept them as the compare stage's partial parts
                    old["compared"] = kept
            else:
                if old.get("fingerprint") == fingerprint and old.get("study_tag"):
                    # a new plan on this node tunes in the studies of its latest restart, not in those it gave up
                    self.data["study_tag"] = old["study_tag"]
                if old.get("done") and old.get("fingerprint") == fingerprint:  # said, never silently dropped
                    was = old.get("plan") if isinstance(old.get("plan"), dict) else {}
                    now = asdict(plan)
                    # the keys of both: a key only the earlier plan has (another moetune version's) was named nowhere
                    changed = sorted(k for k in {*now, *was} if was.get(k) != now.get(k))
                    self.dropped = (f"the plan differs from the one its finished stages ran ({', '.join(changed)}; "
                                    "another moetune version can change a plan's keys and defaults): starting over")

    def done(self, stage: str) -> bool:
        """Whether `stage` finished with no failed part (one with failed parts runs again on a rerun)."""
        return stage in self.data["done"] and stage not in self.data.get("failed", {})

    def failures(self) -> dict[str, list[str]]:
        """The failed parts of each stage that ran with some (what a rerun tries again), by stage."""
        return {k: list(v) for k, v in (self.data.get("failed") or {}).items()}

    def result(self, stage: str) -> Any:
        return self.data["done"].get(stage)

    def save(self) -> None:
        if not self.persist:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(self.data, indent=1))

    def mark(self, stage: str, result: Any, failed: list[str] | None = None) -> None:
        """`stage` ran: its result kept for the stages after it; `failed` (why each failed part failed): it is not
        done, and a rerun runs it again (its finished parts, kept by `keep_partial`, are not run again)."""
        self.data["done"][stage] = result
        if failed:
            self.data.setdefault("failed", {})[stage] = list(failed)
        else:
            self.data.get("failed", {}).pop(stage, None)
            self.data.get("partial", {}).pop(stage, None)  # the stage's result now holds its parts
        self.save()

    def partial(self, stage: str) -> dict[str, Any]:
        """The parts of an unfinished `stage` kept by an earlier, interrupted run (`keep_partial`)."""
        return dict(self.data.get("partial", {}).get(stage) or {})

    def keep_partial(self, stage: str, parts: dict[str, Any]) -> None:
        self.data.setdefault("partial", {})[stage] = parts
        self.save()

    def compared(self) -> dict[str, Any]:
        """The buckets the compare stage compared and stored, by part ("FAMILY/MODEL/S=N/EPn": the tuned setting it
        compared and its row). Unlike `partial` parts they are kept once the stage is done: run again after the tune
        stage ran again, it measures only the buckets whose tuned setting is new. Cleared by `restart` (and a state
        that starts over); a state of an older version kept them as `partial` parts of "compare" (read as these)."""
        return dict(self.data.get("compared") or {})

    def keep_compared(self, parts: dict[str, Any]) -> None:
        self.data["compared"] = parts
        self.save()

    def compare_token(self) -> str:
        """This bring-up's mark on the tuned_vs_default rows its compare stage stores (saved before the first): a
        rerun finds a bucket it stored before the state kept it. A restart, or a state that starts over, has its own:
        a row of an earlier bring-up is never taken for one of this one."""
        if not self.data.get("compare_token"):
            self.data["compare_token"] = secrets.token_hex(8)
            self.save()
        return str(self.data["compare_token"])

    @property
    def study_tag(self) -> str:
        """Tag of the Optuna studies this flow tunes in: "" until a restart, then the restart's own."""
        return str(self.data.get("study_tag") or "")

    def restart(self) -> None:
        """Forget every stage, and tune in new studies: the finished ones would only be resumed (re-tuning
        nothing). They are kept, not deleted: other runs may share a study of the same settings."""
        self.data = {**{k: self.data[k] for k in ("fingerprint", "plan", "db") if k in self.data}, "done": {},
                     "study_tag": "r" + secrets.token_hex(4)}
        self.save()  # now: a rerun after an interrupted restart resumes the new studies, not the old ones


StageFn = Callable[[], Any]


@dataclass
class BucketResult:
    model: str
    tokens: int
    family: str
    default_us: float
    default_spread: float
    tuned_us: float
    tuned_spread: float
    knobs: str
    written: bool
    reason: str
    source: str
    ep_size: int = 0  # the EP group measured (1: the megakernel on one GPU); 0 in rows of older versions


def _decode_notes(compared: list[dict[str, Any]]) -> list[str]:
    """What the report says of the megakernel's decode kernel: launches of a few routed rows run it, and no tile knob
    acts on it, so the tuned sizes that may run it are named and, otherwise, that none does."""
    from moetune.runtime.megakernel.decode import MAX_SLOTS

    sizes = sorted({(t["model"], t["tokens"]) for t in compared if t["family"] == MEGAKERNEL_FAMILY})
    if not sizes:
        return []
    small = [(m, s) for m, s in sizes if s * get_model(m).topk <= MAX_SLOTS]
    if not small:
        return [f"megakernel: the tuned sizes ({', '.join(f'{m} S={s}' for m, s in sizes)}) run the task graph, "
                f"where the tile knobs act; launches of at most {MAX_SLOTS} routed rows (S x topk) whose W_down rows "
                "fit each CTA's shared memory (S=1 on qwen3-30b) run the decode kernel, which has no tile knobs, so "
                "none was tuned for them"]
    return [f"megakernel {m} S={s}: {s * get_model(m).topk} routed rows may run the decode kernel (where its W_down "
            "rows fit each CTA's shared memory), on which the tile knobs do not act: where the library says it "
            "runs, the tune measured the policy default only" for m, s in small]


def _bytes(n: int) -> str:
    """1024 -> '1 KiB', 16777216 -> '16 MiB' (as the report writes sizes)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024:
            return f"{x:g} {unit}"
        x /= 1024
    return f"{x:g} TiB"


def _as_text(text: str) -> str:
    """`text` printed as written through the console: a '[' in a row label is not read as markup."""
    return text.replace("[", "\\[")


def _node_line(facts: Any) -> str:
    if facts.gpu_count:
        return f"{facts.gpu_count} × {facts.gpu_model}"
    return "no GPU (CPU only)"


def _report_node(facts: Any) -> dict[str, Any]:
    """The ReportData fields that describe the node (`stage_report` and `report_from_store` alike): its line, its
    fingerprint, the transports found and those it cannot run (each with why), and discovery's warnings."""
    return {"node": _node_line(facts), "fingerprint": facts.fingerprint,
            "transports": [(t.name, t.reason) for t in facts.transports],
            "unavailable": [(t.name, t.reason) for t in facts.unavailable], "warnings": list(facts.warnings)}


def base_preset_for(facts: Any) -> str:
    """The shipped preset closest to this node, the starting point of its calibration."""
    names = set(facts.transport_names)
    if "nvlink" in names:
        return "nvlink-h200x2"
    if "proxy:ibrc" in names:
        return "ndr-ibrc-h100x8"
    if any(n.startswith("proxy:libfabric") for n in names):
        return "slingshot11-libfabric-a100x4"
    return "pcie4-consumer-4090x4"


def _undivided(experts: dict[str, int], n: int) -> list[str]:
    """The models (as "name (E experts)") whose experts do not divide over an EP group of `n`."""
    return [f"{m} ({e} experts)" for m, e in experts.items() if e % n]


def host_memory_bytes() -> int:
    """This machine's physical memory in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def microbench_sizes_problem(sizes: Sequence[int], facts: Any, host_bytes: int) -> str:
    """Why the plan's microbench_sizes cannot be measured on this node ('' when they can), naming the size and the
    bound. Each rank of a point-to-point microbenchmark holds two buffers of the largest size (its warm-up buffer and
    the message): the gloo pair runs on every node, both ranks in host memory (4 x the size: at most a quarter of
    `host_bytes`); the NCCL pair on >= 2 GPUs, one GPU each (2 x the size: at most half the smallest GPU's memory).
    A size past that was allocated all the same (1 TiB: a GPU out of memory, or a host driven into swap and the OOM
    killer: torch's zeroed pages are only touched later)."""
    if not sizes:
        return ""
    big = max(sizes)
    mib = [g.memory_mib for g in facts.gpus if g.memory_mib > 0]  # 0: not read (no bound from it)
    bounds: list[tuple[int, str]] = []
    if facts.gpu_count >= 2 and mib:
        bounds.append((min(mib) * 2**20 // 2, f"half the memory of this node's smallest GPU ({_bytes(min(mib) * 2**20)}"
                                             "): each NCCL rank holds a warm-up buffer and the message on its GPU"))
    if host_bytes > 0:
        bounds.append((host_bytes // 4, f"a quarter of this host's memory ({_bytes(host_bytes)}): the two gloo ranks "
                                        "each hold a warm-up buffer and the message in it"))
    for bound, why in bounds:
        if big > bound:
            return (f"plan: microbench_sizes: {_bytes(big)} ({big} bytes) is more than this node can hold: at most "
                    f"{_bytes(bound)}, {why}")
    return ""


def plan_ep_sizes(plan: Plan, gpus: int) -> tuple[list[int], str]:
    """(the EP sizes the bring-up tunes on a node of `gpus` GPUs, what the report says of them); ValueError for a
    size the node cannot measure. One-GPU nodes tune no EP size (the megakernel instead)."""
    asked = sorted(set(plan.ep_sizes or ([plan.world] if plan.world else [])))
    if gpus == 1:
        return [], (f"EP sizes {asked} of the plan not tuned: " if asked else "no EP size tuned: ") + \
            "EP transports need >= 2 GPUs and this node has 1"
    from moetune.tuner.search.tune import gloo_ranks_problem  # (Optuna: imported when a plan is checked)

    experts = {get_model(m).name: get_model(m).experts for m in plan.models}
    if asked:
        for n in asked:
            if gpus >= 2 and n > gpus:
                raise ValueError(f"plan: EP size {n} needs {n} GPUs, this node has {gpus} (the bring-up measures on "
                                 "this node only)")
            why = gloo_ranks_problem(n, gpus)
            if why:
                raise ValueError(f"plan: EP size {n} runs {why}")
            bad = _undivided(experts, n)
            if bad:
                raise ValueError(f"plan: EP size {n} does not divide the experts of {', '.join(bad)}")
        return asked, f"EP sizes tuned: {', '.join(map(str, asked))} (as the plan lists)"
    if gpus == 0:
        bad = _undivided(experts, 2)
        if bad:  # up front: found after the microbenchmarks and calibration, a rerun "resumed" into the same error
            raise ValueError(f"EP size 2 (gloo ranks on the CPU: this node has no GPU) does not divide the experts of "
                             f"{', '.join(bad)}")
        return [2], "EP size tuned: 2 (gloo ranks on the CPU: this node has no GPU)"
    fits = [n for n in range(gpus, 1, -1) if all(e % n == 0 for e in experts.values())]
    if not fits:
        raise ValueError(f"no EP size from 2 to {gpus} divides the experts of every planned model "
                         f"({', '.join(f'{m}: {e}' for m, e in experts.items())})")
    n = fits[0]
    why = ("every GPU of this node" if n == gpus else
           f"not {gpus}: the experts of {', '.join(m for m, e in experts.items() if e % gpus)} do not divide over "
           f"{gpus} GPUs")
    return [n], (f"EP size tuned: {n} ({why}); smaller EP groups are not tuned by default: list them in the "
                 "plan's ep_sizes")


def megakernel_left_out(models: Sequence[str]) -> dict[str, str]:
    """{model name: why} for the planned models the megakernel can run no setting of (`model_problem`: the rule its
    trials refuse a model by, so it is not written twice), in plan order."""
    from moetune.runtime.megakernel.config import model_problem

    out: dict[str, str] = {}
    for spec in models:
        model = get_model(spec)
        why = model_problem(model)
        if why is not None:
            out[model.name] = f"the megakernel cannot run it: {why}"
    return out


def captured_ep_note(sizes: list[int], node: str) -> str:
    """The EP line of a bring-up of another node's capture (`node`: its GPUs, as `_node_line` says them): nothing is
    measured on a capture, so no EP size is tuned; it says what a bring-up on that node would tune."""
    would = f"EP size{'s' if len(sizes) > 1 else ''} {', '.join(map(str, sizes))}" if sizes else "no EP size"
    return (f"no EP size tuned: the capture is of another node ({node}), and nothing is measured on a capture; "
            f"a bring-up on that node would tune {would}")


class Bringup:
    """The stages of `moetune profile`, each resumable; `console` shows progress."""

    def __init__(self, *, store: Any, plan: Plan, state_dir: Path, console: Any, capture: Path | None = None,
                 report_dir: Path | None = None, storage: str | None = None, progress: Progress | None = None,
                 mk_measure: Any = None, db_path: Path | None = None):
        from moetune.tuner.fabric.discovery import capture_not_this_node, discover
        from moetune.tuner.fabric.families import megakernel_family

        self.store, self.plan, self.console, self.storage = store, plan, console, storage
        self.progress: Progress = progress or NoProgress()  # drawn by the CLI (rich stays in tuner/cli/)
        self.facts = discover(capture)
        self.capture = capture
        # A number measured here is stored only under this node's key: a capture of another node (other fingerprint
        # or software) runs no measurement, so nothing measured here is stored as that node's. The rest (its facts,
        # transports, plan and report) still shows what a bring-up would do there (tests, support).
        self.not_here = capture_not_this_node(self.facts, capture) if capture is not None else ""
        self.measures = not self.not_here
        # what it measures is stored under this fingerprint: the node is discovered again before each write (and
        # before a measuring stage is marked done), and a change stops the run (`FabricMovedOn`)
        from moetune.tuner.fabric.moved import FabricGuard

        self.guard = FabricGuard(self.facts, rerun=(
            "Run `moetune profile` again: it brings up the node as it is now, under its new fingerprint (the stages "
            "finished before the change are kept for the old one).")) if self.measures else None
        # the state is the database's (db_path: the CLI opens the store after the checks; else the store's file)
        if db_path is None and store is None:
            raise TypeError("Bringup needs the profile database: db_path or store")
        db = Path(db_path if db_path is not None else store.path)
        fp = self.facts.fingerprint
        self.state = BringupState(state_dir / state_file_name(db, fp), fp, plan, persist=self.measures, db=db.name)
        self.unresumed = self._legacy_state(state_dir / LEGACY_STATE.format(fp), plan)
        # the default folder of a capture of another node is that node's, never this node's report/ (replaced by a
        # report that measured nothing); an explicit report_dir is the caller's choice
        self.report_dir = report_dir or state_dir / ("report" if self.measures else f"report-{self.facts.fingerprint}")
        gpus = self.facts.gpu_count
        self.comm_backend = "nccl" if gpus >= 2 else "gloo"
        # EP sizes (each <= the GPUs, each measured with that many ranks; default: every GPU of the node). EP
        # transports need a peer GPU: a one-GPU node tunes only the MoE megakernel (its own family, ep_size 1).
        self.ep_sizes, self.ep_note = plan_ep_sizes(plan, gpus)
        if not self.measures:  # "EP size tuned: 8 (every GPU of this node)" was said of a capture nothing measured
            self.ep_note = captured_ep_note(self.ep_sizes, _node_line(self.facts))
        self.tune_ep = bool(self.ep_sizes)
        if self.measures and (why := microbench_sizes_problem(plan.microbench_sizes, self.facts, host_memory_bytes())):
            raise ValueError(why)  # before any stage: the microbenchmark tried the allocation
        self.mk_ok, self.mk_why = megakernel_family(self.facts)
        # planned models the megakernel can run no setting of (their trials would each fail): left out of its stage
        # up front, each with why, by the rule a trial refuses them by; said as the tune runs and in the report
        self.mk_left_out = megakernel_left_out(plan.models) if self.mk_ok else {}
        self.mk_measure = mk_measure  # tests inject the megakernel's timing (LocalBackend.mk_measure)
        self.failed: list[str] = []  # the failed parts of the stage at hand (`run`), each with why

    def _legacy_state(self, legacy: Path, plan: Plan) -> str:
        """What this run says of the folder's state file of an older moetune (`LEGACY_STATE`) that it would have
        resumed ("" when none): that file names no database, and any database of the folder may have written it,
        so it is neither resumed nor replaced or deleted (it is not known to be this database's)."""
        if not self.measures or self.state.path.exists() or not legacy.is_file():
            return ""
        old = BringupState(legacy, self.facts.fingerprint, plan, persist=True)  # read only: nothing marked
        if not old.data["done"]:
            return ""
        return (f"{legacy}: the bring-up state of an older moetune, shared by every database of that folder, does not "
                "say which database its finished stages stored into, so it is not resumed: starting over (the file "
                "is left as it is and no longer used)")

    @property
    def not_measured(self) -> str:
        """Why this run measures nothing ('' when it measures): what the output and the report say."""
        if not self.not_here:
            return ""
        return (f"nothing measured: {self.not_here}; a number measured on this machine is never stored under "
                "another node's fingerprint (run `moetune profile` on that node)")

    def _check_fabric(self, what: str) -> None:
        """FabricMovedOn when the live node is no longer the fabric this run measures for (`FabricGuard`)."""
        if self.guard is not None:
            self.guard.check(what)

    def _skip(self, stage: str) -> None:  # the full reason is said once before the stages and in the report
        self.console.print(f"[yellow]{stage} skipped: the capture describes another node, so nothing is measured "
                           "here[/]")

    # -- stages ------------------------------------------------------------------------------------
    def _record_node(self) -> None:
        """This node's facts recorded as seen (`record_node_facts`: the daemon's change rule, so profiles measured on
        GPUs since replaced are stale from now on). Another node's capture is not (`fabric diff` compares this node
        with the fingerprint the store saw last: it reported a change of the node to the capture's)."""
        if not self.measures:
            return
        from moetune.tuner.fabric.change import record_node_facts

        note = record_node_facts(self.store, self.facts, by="profile").note()
        if note:
            self.console.print(f"[yellow]note:[/yellow] {_as_text(note)}")

    def stage_discover(self) -> dict:
        self._record_node()
        return {"fingerprint": self.facts.fingerprint, "transports": [[t.name, t.reason] for t in self.facts.transports]}

    def stage_microbench(self) -> list[dict]:
        from moetune.tuner.measure import micro as microbench

        rows: list[dict] = []
        if not self.measures:
            self._skip("microbenchmarks")
            return rows
        # the plan's sizes and iters, as written: the quick sweep and 5 iterations were taken for any plan of
        # trials <= 8 (bench/plans/h200x2.toml's iters = 20 ran 5)
        sizes = self.plan.microbench_sizes or list(microbench.DEFAULT_SIZES)
        applicable = [(b, why) for b, ok, why in microbench.plan(self.facts.transport_names, self.facts.gpu_count,
                                                                  self.plan.models[0]) if ok]
        # A rerun after an interruption skips the benchmarks whose rows are stored (the state keeps them) and
        # runs the rest again; every stored row names its benchmark and this run, so `moetune report` shows only
        # a benchmark's latest run, not also the rows an interrupted run had stored.
        finished = self.state.partial("microbench")
        run_id = secrets.token_hex(4)
        bar = self.progress
        # a resumed stage counts what it kept as done ("resumed, 1/2 done"; it said "started, 0/2 done")
        done = sum(f"{b.transport}/{b.runner}" in finished for b, _why in applicable)
        if applicable:
            self.console.print(f"microbenchmarks: {len(sizes)} message sizes ({_bytes(min(sizes))} to "
                               f"{_bytes(max(sizes))}{'' if self.plan.microbench_sizes else ', the default sweep'}), "
                               f"{self.plan.iters} timed iterations each (plan: microbench_sizes, iters)")
        task = bar.add("microbenchmarks", len(applicable), done)
        for bench, _why in applicable:
            bench_id = f"{bench.transport}/{bench.runner}"
            if bench_id in finished:
                rows += finished[bench_id]
                continue
            bar.update(task, done, description=f"microbenchmark {bench.transport} ({bench.runner})")
            done += 1  # run or failed: its turn is over
            try:
                results = bench.run(sizes if bench.runner != "a2a" else (), iters=self.plan.iters)
            except RuntimeError as e:
                self.console.print(f"[yellow]microbenchmark {bench.transport}/{bench.runner} failed: "
                                   f"{_as_text(str(e))}[/]")
                self.failed.append(f"microbenchmark {bench_id} failed: {e}")  # the stage is not done
                continue  # nothing stored: a rerun tries it again
            self._check_fabric(f"The microbenchmark {bench_id}")
            got = []
            # one transaction: a run killed while storing them left the first rows as the benchmark's latest run,
            # which `moetune report` showed in place of an earlier whole one
            with self.store.atomic():
                for r in results:
                    extra = dict(r.extra or {}, direction=r.direction, bench=bench_id, bench_run=run_id)
                    self.store.add_measurement(fingerprint=self.facts.fingerprint, kind=r.kind, transport=r.transport,
                                               size_bytes=r.size_bytes, value=r.value, spread=r.spread, unit=r.unit,
                                               extra=extra)
                    got.append(asdict(r))
            finished[bench_id] = got
            self.state.keep_partial("microbench", finished)
            rows += got
        bar.update(task, len(applicable), description="microbenchmarks")
        return rows

    def nic_line_rate_gbs(self, base: str) -> float | None:
        """The line rate (GB/s) a fitted NIC bandwidth may not exceed: the fastest ACTIVE port discovery found.
        None where the base preset's [nic] is not a NIC (nvlink-h200x2's is the copy-engine proxy probe) or the
        node has none."""
        from moetune.tuner.fabric_model.presets import load_preset

        gbit = self.facts.link_rates.get("nic_gbit")
        if not gbit or load_preset(base).family == "nvlink":
            return None
        return gbit / 8.0

    def stage_calibrate(self) -> dict:
        import datetime as dt

        from moetune.tuner.fabric_model.calibration import calibrate, calibrated_preset

        rows = [r["extra"] for r in self.state.result("microbench") or [] if (r.get("extra") or {}).get("probe")]
        base = base_preset_for(self.facts)
        if not self.measures:  # no measurement of that node to fit: no node model (it would be labelled its own)
            self._skip("calibration")
            return {"base": base, "skipped": "nothing measured: the capture describes another node than this one"}
        if self.facts.gpu_count == 1:
            # The model describes EP exchanges between GPUs; one GPU has none. Its only rows (an all-to-all of gloo
            # processes on the host) fitted to a GPU preset gave a model of nothing this node runs, accepted or
            # refused by chance (runs 180, 182, 183).
            why = "one GPU: no EP exchange on this node for the fabric model to describe"
            self.console.print(f"node fabric model not calibrated: {why}")
            return {"base": base, "skipped": why}
        from moetune.tuner.fabric_model.presets import load_preset, node_model_family

        family, no_family = node_model_family(load_preset(base), self.facts.transport_names)
        if family is None:
            # as for one GPU: a model of a family this node does not run is refused by `tune --node-model`
            why = f"no transport of this node for the fabric model to describe: {no_family}"
            self.console.print(f"node fabric model not calibrated: {_as_text(why)}")
            return {"base": base, "skipped": why}
        if not rows:
            bad = self.state.failures().get("microbench")
            return {"base": base, "skipped": "no measurement the model can describe"
                    + (f" (the microbenchmarks failed: {'; '.join(bad)})" if bad else "")}
        path = self.state.path.parent / f"node-{self.facts.fingerprint}.toml"
        try:
            rep = calibrate(base, rows, rounds=15, nic_line_rate_gbs=self.nic_line_rate_gbs(base))
        except ValueError as e:  # a row the base preset cannot model: no node model, the bring-up goes on
            problems, s = [str(e)], None
        else:
            problems, s = rep.problems, rep.summary()
        if problems:
            # No node model from a fit that cannot be trusted: tuning measures on this node as without one, and
            # the daemon's model re-tune says no calibrated model exists. A file from an earlier bring-up of
            # this fingerprint is left as it was (it passed these checks on its own data).
            self.console.print(f"[yellow]node fabric model not written (calibration refused): "
                               f"{_as_text('; '.join(problems))}[/]")
            out: dict[str, Any] = {"base": base, "refused": problems, "node_model": None}
            if s is not None:
                out.update(points=s["points"], fit_mean_abs_rel_err=s["mean_abs_rel_err"],
                           fit_max_abs_rel_err=s["max_abs_rel_err"])
            if path.exists():
                out["earlier_node_model"] = str(path)
            return out
        today = dt.date.today().isoformat()
        # measured here (a capture of another node measures nothing): the node model of this fingerprint
        preset = calibrated_preset(rep, [f"moetune profile on {self.facts.fingerprint}"], today,
                                   fingerprint=self.facts.fingerprint)
        if preset.family != family:
            # a node without GPUs measured its collective (gloo): that is the family its model describes and a
            # model tune of it tunes (the base preset's host_staged is a family this node does not have)
            preset = replace(preset, family=family)
        write_atomic(path, preset.to_toml())  # a crash mid-write leaves the earlier node model whole
        return {"base": base, "preset_file": str(path), "points": s["points"], "kept": sorted(rep.kept),
                "mean_abs_rel_err": s["mean_abs_rel_err"], "max_abs_rel_err": s["max_abs_rel_err"]}

    def _backend(self, world: int) -> Any:
        from moetune.tuner.search.local_backend import LocalBackend

        # On CPU the fp8 error is the same arithmetic as on GPU: the search space already keeps compression
        # within the policy's budget by its measured expected error, so trials skip the costly re-check.
        return LocalBackend(world=world, comm_backend=self.comm_backend, repeats=self.plan.repeats,
                            timeout_s=self.plan.trial_timeout_s, metric="comm", iters=self.plan.iters,
                            verify_compression=self.comm_backend == "nccl", persistent=True)

    def _mk_backend(self) -> Any:
        from moetune.tuner.search.local_backend import LocalBackend

        return LocalBackend(world=1, comm_backend="nccl", repeats=self.plan.repeats, iters=self.plan.iters,
                            timeout_s=self.plan.trial_timeout_s, family="megakernel", mk_measure=self.mk_measure)

    def stage_tune(self) -> list[dict]:
        from moetune.tuner.search.tune import check_tune, tune_profiles_detailed

        # kept with the stage's result: a resumed run's summary and report say what this run left out, as recorded (a
        # capture of another node too: what a bring-up there leaves out)
        self.state.data["mk_left_out"] = dict(self.mk_left_out)
        if not self.measures:  # the EP groups and the megakernel alike: every trial would run on this machine
            self._skip("tuning")
            return []
        models = [get_model(m) for m in self.plan.models]
        res: list[tuple[int, str, Any]] = []  # (EP size, the backend's label, the result)
        tag = self.state.study_tag  # after --restart: new studies, the finished ones are not resumed
        ep_left: list[dict] = []
        self.state.data["ep_left_out"] = ep_left  # recorded as decided: a resumed run's summary says the same
        for ep in self.ep_sizes:  # each EP group measured by that many ranks, stored under its own key
            be = self._backend(ep)
            try:
                # the tune's own plan (one rule: the backend's group_problem, the runtime's group_world_problem):
                # a family whose transport cannot serve this EP group is left out before its studies, and said here
                plan = check_tune(self.facts, models=models, backend=be, ep_size=ep, nodes=1)
                for fam, why in plan.left_out.items():
                    ep_left.append({"ep_size": ep, "family": fam, "reason": why})
                    self.console.print(f"[yellow]{_as_text(self.ep_left_note(ep_left[-1]))}[/]")
                res += [(ep, be.label, r) for r in tune_profiles_detailed(self.store, self.facts, models=models, tokens=self.plan.tokens,
                                              backend=be, trials=self.plan.trials, progress=self.progress,
                                              storage=self.storage, ep_size=ep, nodes=1, seed=0, study_tag=tag,
                                              recheck=False, plan=plan)]  # stage_compare compares with the default
            finally:
                be.close()  # the persistent bench workers
        for name, why in self.mk_left_out.items():
            self.console.print(f"[yellow]{_as_text(self.mk_left_note(name, why))}[/]")
        mk_models = [m for m in models if m.name not in self.mk_left_out]
        if self.mk_ok and mk_models:
            mk = self._mk_backend()
            try:
                res += [(1, mk.label, r) for r in tune_profiles_detailed(
                    self.store, self.facts, models=mk_models, tokens=self.plan.tokens, backend=mk, trials=self.plan.trials,
                    progress=self.progress, storage=self.storage, ep_size=1, nodes=1, seed=0, families=["megakernel"],
                    study_tag=tag, recheck=False)]
            finally:
                mk.close()  # the layer's weights and reference its trials put on the GPU, kept there until closed
        # recheck=False stores nothing: the candidates wait in this stage's result (the state file) for the compare
        # stage, the only writer, so no unchecked best is served meanwhile. Ctrl-C before this stage is marked done
        # loses none: a rerun resumes the studies, whose finished trials run no more.
        out = []
        for ep, label, r in res:
            if r.record is None:
                # no candidate (every trial failed): kept as a row that says why, so the summary and the report show
                # the bucket; the stage is not done and a rerun tries the study again (`failed_before`)
                why = self._no_result(r)
                wl = r.study.workload
                out.append({"family": r.study.family, "tokens": wl.tokens, "ep_size": ep, "model": wl.model.name,
                            "study": r.study.study_name, "routing": wl.routing, "source": label,
                            "failed": f"not stored: {why}"})
                self.failed.append(f"tuning {r.study.family} {wl.model.name} S={wl.tokens} EP {ep}: {why}")
                continue
            k = r.record.key
            out.append({"family": k.transport_family, "tokens": k.token_bucket, "ep_size": k.ep_size, "key": k.to_dict(),
                        "software_versions": r.record.software_versions, "knobs": r.record.knobs.to_dict(), "latency_us": r.record.latency_us,
                        "spread_us": r.record.spread_us, "written": r.written, "reason": r.reason,
                        "study": r.study.study_name, "routing": r.study.workload.routing,
                        "model": next(m.name for m in models if (m.hidden, m.intermediate, m.experts, m.topk)
                                      == (k.hidden, k.intermediate, k.experts, k.topk))})
        return out

    @staticmethod
    def mk_left_note(name: str, why: str) -> str:
        """What the progress output and the report say of a planned model left out of the megakernel stage."""
        return f"megakernel: {name} left out: {why}"

    @staticmethod
    def ep_left_note(row: Mapping[str, Any]) -> str:
        """What the output and the report say of a family the tune stage left out of an EP size (`ep_left_out`): the
        tune's words (`group_left_out_note`)."""
        from moetune.tuner.search.tune import group_left_out_note

        return group_left_out_note(str(row["family"]), str(row["reason"]), int(row["ep_size"]), 1)

    @property
    def ep_left_out(self) -> list[dict]:
        """[{ep_size, family, reason}] of the transport families the tune stage left out of an EP size, their
        transport unable to serve that group, as it recorded them; [] before it ran (or where it measured nothing)."""
        got = self.state.data.get("ep_left_out")
        return [dict(r) for r in got if isinstance(r, dict)] if isinstance(got, list) else []

    @property
    def left_out(self) -> dict[str, str]:
        """{model: why} of the planned models the tune stage left out of the megakernel stage, as it recorded them
        (a resumed run says what that run left out, not what this version would decide); {} before it ran."""
        got = self.state.data.get("mk_left_out")
        return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else {}

    @property
    def nothing_tuned(self) -> str:
        """Why nothing was tuned ('' when something was): a one-GPU node tunes only the megakernel, and it cannot run
        here (no sm_90 GPU: `megakernel_family`) or the tune stage left every planned model out of it."""
        if self.ep_sizes:
            return ""
        if not self.mk_ok:  # the report said the megakernel "is what was tuned" beside "MoE megakernel not tuned"
            return ("nothing tuned: the MoE megakernel, the only thing a one-GPU node tunes, cannot run here: "
                    f"{self.mk_why}")
        left = self.left_out
        if not left or any(get_model(m).name not in left for m in self.plan.models):
            return ""
        return (f"nothing tuned: every planned model was left out ({', '.join(left)}: the megakernel, the only "
                "thing a one-GPU node tunes, cannot run them)")

    @staticmethod
    def _no_result(r: Any) -> str:
        """Why the study of `r` (a TuneResult) gave no candidate: every trial failed, and the first failure's error
        (recorded by the tune as it summed the study up: the study is not loaded again here)."""
        s = r.study
        what = ("every trial failed" if s.trials and s.failed == s.trials else
                f"no successful trial ({s.failed} failed, {s.pruned} pruned of {s.trials})" if s.trials else
                str(r.reason or "no trial ran"))
        return f"{what} ({s.first_error})" if s.first_error else what

    def stage_compare(self) -> list[dict]:
        """Tuned against the policy default (and the current stored profile) for every bucket, measured side by
        side (interleaved); the only stage that stores profiles."""
        backends: dict[int, Any] = {}  # EP size (1: the megakernel) -> its backend, started when a row of it comes
        try:
            return self._compare_with(backends)
        finally:
            for be in backends.values():
                be.close()  # the persistent bench workers

    def _compare_with(self, ep_backends: dict[int, Any]) -> list[dict]:
        from moetune.runtime.knobs import Knobs
        from moetune.runtime.profile_record import ProfileKey
        from moetune.tuner.search.backends import TuneWorkload, too_few_samples
        from moetune.tuner.search.policy import load_policy
        from moetune.tuner.search.tune import SideBySide, metric_force, served_incumbent, side_by_side
        from moetune.tuner.store.validate import canonical_routing

        out = []
        tuned_rows = self.state.result("tune") or []
        # each bucket compared (and stored) is kept at once: a rerun after an interruption, or after an earlier stage
        # ran again, compares only the buckets left, not again one whose profile and row it stored
        finished = self.state.compared()
        # and what a run killed after storing a bucket, before the state kept it, stored: found by its row's mark
        token = self.state.compare_token()
        in_store = self._stored_comparisons(token)
        # a bar: this stage runs rounds x 2 settings x repeats per bucket, minutes on a GPU node
        task = self.progress.add("tuned vs default", len(tuned_rows))
        for i, t in enumerate(tuned_rows):
            self.progress.update(task, i, description=f"tuned vs default: {t['family']} {t['model']} S={t['tokens']}")
            if t.get("failed"):  # no candidate to compare: the bucket is shown, with why (the tune stage says it)
                nan = float("nan")
                out.append({**asdict(BucketResult(
                    model=t["model"], tokens=t["tokens"], family=t["family"], default_us=nan, default_spread=0.0,
                    tuned_us=nan, tuned_spread=0.0, knobs="", written=False, reason=t["failed"],
                    source=t.get("source", ""), ep_size=t["ep_size"])), "stored": ""})
                continue
            part = f"{t['family']}/{t['model']}/S={t['tokens']}/EP{t['ep_size']}"
            tuned_as = {"knobs": t["knobs"], "study": t.get("study"), "routing": t.get("routing")}
            if (finished.get(part) or {}).get("tuned") == tuned_as:
                out.append(finished[part]["row"])
                continue
            mark = {"run": token, "part": part, "tuned": tuned_as}
            if (in_store.get(part) or {}).get("mark") == mark:
                # its profile and row were stored (one transaction) before the run ended: kept, not measured again
                out.append(in_store[part]["row"])
                finished[part] = {"tuned": tuned_as, "row": in_store[part]["row"]}
                self.state.keep_compared(finished)
                continue
            tuned = Knobs.from_dict(t["knobs"])
            policy = load_policy(t["family"])
            default = policy.defaults  # the policy default the runtime falls back to
            mk = t["family"] == MEGAKERNEL_FAMILY
            ep = 1 if mk else int(t["key"]["ep_size"])  # measured as tuned: that many ranks on this node
            if ep not in ep_backends:  # the megakernel's under 1 (no EP size is 1): one for its buckets, closed too
                ep_backends[ep] = self._mk_backend() if mk else self._backend(ep)
            be = ep_backends[ep]
            routing = t.get("routing") or "uniform"  # state of an older version: the bring-up tuned uniform
            wl = TuneWorkload(model=get_model(t["model"]), tokens=t["tokens"], nodes=1, gpus_per_node=ep,
                              routing=routing)
            # the family's policy: its error budget holds a compressed setting's measured error in this comparison as
            # in the trials (a fresh backend had none: a tuned fp8 setting over the budget here was stored)
            be.for_family(t["family"], policy.error_budget)
            # The current stored profile is a rival too (a search's best never replaces a faster one unmeasured),
            # unless it was measured under another routing: then it is not compared, and the store keeps it. One no
            # lookup serves (knobs contradicting its family) is no rival, as for `moetune tune`: kept, its fresh
            # number was handed to put_profile, which refuses it (the stage failed); the store's gate replaces it
            current, passed_over = served_incumbent(self.store, ProfileKey(**t["key"]))
            same_routing = current is not None and current.tuned_routing in ("", canonical_routing(routing))
            inc = current.knobs if same_routing else None
            inert = be.inert_reason(t["family"], wl)  # no knob acts here: the default replaces other knobs
            cands = [default] if inert else list(dict.fromkeys(k for k in (tuned, inc, default) if k is not None))
            got = dict(zip(cands, be.compare(cands, wl, rounds=self.plan.compare_rounds), strict=True))
            # measured: before anything of it is stored (its profile, its tuned_vs_default row)
            self._check_fabric(f"The side-by-side measurement of {t['family']} {t['model']} S={t['tokens']} "
                               f"ep{ep}")
            md = got[default]
            mt = got.get(tuned, md)
            mi = got.get(inc) if inc is not None else None
            # The side-by-side measurement decides what is stored, by the rules of `moetune tune`: the tuned
            # setting only when its gain beats the noise of the default and of the current profile; a failed tuned
            # run gives way to the default.
            # the bucket's profile and its tuned_vs_default row (marked as this run's comparison of this tuned
            # setting) in one transaction: a run killed in between stored neither, so a rerun measures the bucket
            # again; one killed after it finds the row (`_stored_comparisons`) and measures nothing again
            with self.store.atomic():
                choice = (SideBySide(default, md, force=inert if inc is not None and inc != default else None)
                          if inert else side_by_side(tuned if mt.ok or not md.ok else default, inc, default, got))
                if choice.knobs is None or choice.meas is None:  # the current profile held its own
                    stored = "current profile"
                    written, reason = False, choice.why
                    force = metric_force(current, be.label, None)
                    if current is not None and choice.incumbent is not None and (
                            current.backend == be.label or current.provenance != "measured" or force):
                        # its fresh number replaces the stored one (the same knobs from the same source, or another
                        # metric's number: `metric_force`)
                        written, how = self._store_decision(t, current.knobs, choice.incumbent, force, be, routing)
                        reason += f" ({how})" if written else ""
                else:
                    stored = "tuned" if choice.knobs == tuned and tuned != default else "policy default"
                    force = metric_force(current if same_routing else None, be.label, choice.force)
                    written, reason = self._store_decision(t, choice.knobs, choice.meas, force, be, routing)
                    reason = "; ".join(w for w in (reason, passed_over) if w)
                keep_tuned = stored == "tuned"
                row = asdict(BucketResult(
                    model=t["model"], tokens=t["tokens"], family=t["family"],
                    default_us=md.median_us if md.ok else float("nan"), default_spread=md.spread_us if md.ok else 0.0,
                    tuned_us=mt.median_us if mt.ok else float("nan"), tuned_spread=mt.spread_us if mt.ok else 0.0,
                    knobs=",".join(f"{k}={v}" for k, v in tuned.to_dict().items() if v != default.to_dict().get(k)),
                    written=written, reason=reason, source=be.label, ep_size=ep))
                row["stored"] = stored
                if mi is not None:
                    row["current_us"] = mi.median_us if mi.ok else float("nan")
                    row["current_spread"] = mi.spread_us if mi.ok else 0.0
                if current is not None and not same_routing:
                    row["current_routing"] = current.tuned_routing  # not compared: measured under another routing
                few = too_few_samples(*got.values())
                if stored == "current profile":
                    row["why_default"] = choice.why
                elif not keep_tuned:
                    # where no knob acts the tuned setting was not run (its column shows the default's run, the same
                    # run): its reason is that, not "did not beat the default" of a number it never had
                    if inert:
                        row["why_default"] = inert
                    elif tuned == default:
                        row["why_default"] = "the tuned setting is the default"
                    elif mt.ok and md.ok:
                        row["why_default"] = (f"tuned {mt.median_us:.1f} ± {mt.spread_us:.1f} µs did not beat the "
                                              f"default {md.median_us:.1f} ± {md.spread_us:.1f} µs by more than the "
                                              "spread" + (f" ({few})" if few else ""))
                    else:
                        row["why_default"] = f"tuned run failed: {mt.error}"
                # The value column takes a number: the tuned time, or where that run failed the default's (the
                # bucket is still reported); a failed time is null in `extra` (JSON has no NaN). Where both failed
                # there is no row (nor its mark): a rerun killed before the state kept the bucket measures it again.
                shown = mt if mt.ok else md
                if shown.ok:
                    extra = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
                    self.store.add_measurement(fingerprint=self.facts.fingerprint, kind="tuned_vs_default",
                                               transport=t["family"], size_bytes=None, value=shown.median_us,
                                               spread=shown.spread_us, unit="us", extra={**extra, COMPARED_AS: mark})
            out.append(row)
            if not md.ok and not mt.ok:
                # nothing measured, nothing stored: the stage is not done (the command fails) and the bucket is not
                # kept as compared, so a rerun measures it again (it was done, exit 0, and never compared again)
                self.failed.append(f"comparing {t['family']} {t['model']} S={t['tokens']} EP {ep} with the policy "
                                   f"default: the default's and the tuned setting's runs failed ({md.error})")
                continue
            finished[part] = {"tuned": tuned_as, "row": row}
            self.state.keep_compared(finished)
        self.progress.update(task, len(tuned_rows), description="tuned vs default")
        return out

    def _stored_comparisons(self, token: str) -> dict[str, dict[str, Any]]:
        """The buckets whose tuned_vs_default row this bring-up (`token`: its state's `compare_token`) stored, by part:
        {"mark": what the row is marked with, "row": the row as the stage returned it}. The latest row of a part."""
        out: dict[str, dict[str, Any]] = {}
        for m in self.store.list_measurements(fingerprint=self.facts.fingerprint, kind="tuned_vs_default"):
            extra = dict(m["extra"] or {})
            mark = extra.pop(COMPARED_AS, None)
            if not isinstance(mark, dict) or mark.get("run") != token or not isinstance(mark.get("part"), str):
                continue
            # a failed time was stored as null (JSON has no NaN): the row had NaN there
            row = {k: float("nan") if v is None and k.endswith("_us") else v for k, v in extra.items()}
            out[mark["part"]] = {"mark": mark, "row": row}
        return out

    def _store_decision(self, t: dict, knobs: Any, m: Any, force: str | None, be: Any,
                        routing: str = "uniform") -> tuple[bool, str]:
        """Write the bucket's profile from the side-by-side measurement by `be` (the backend: its provenance, label
        and the performance environment it measured in, `provenance_fields`) and its routing (the store never lets
        it replace a profile of another routing). `force`: the current profile lost in that comparison (the store's
        force_reason), None: the store's own rules decide."""
        from moetune.runtime.profile_record import ProfileKey, ProfileRecord
        from moetune.tuner.search.backends import provenance_fields

        if not m.ok:
            return False, f"not stored: {m.error}"
        # the key (and software versions) the search tuned under
        rec = ProfileRecord(key=ProfileKey(**t["key"]), knobs=knobs, latency_us=m.median_us, spread_us=m.spread_us,
                            software_versions=t["software_versions"], measured_on=self.facts.fingerprint,
                            routing=routing, **provenance_fields(be))
        return self.store.put_profile(rec, force_reason=force)

    def stage_report(self) -> str:
        from moetune.tuner.bringup.report import ReportData, write_report

        data = ReportData(**_report_node(self.facts), measurements=self.state.result("microbench") or [],
                          tuned=list(self.state.result("compare") or []),  # every bucket, a failed run too
                          importances=self._importances())
        if self.not_measured:
            data.notes.append(self.not_measured)
        cal = self.state.result("calibrate") or {}
        if "mean_abs_rel_err" in cal:
            data.notes.append(f"node fabric model calibrated from {cal['base']} on {cal['points']} measured points: "
                              f"mean error {100 * cal['mean_abs_rel_err']:.1f}%, max {100 * cal['max_abs_rel_err']:.1f}% "
                              f"({cal['preset_file']})")
        elif cal.get("skipped"):
            data.notes.append(f"node fabric model not calibrated: {cal['skipped']}")
        elif cal.get("refused"):
            earlier = (f"; the node model from an earlier bring-up ({cal['earlier_node_model']}) is left as it was"
                       if cal.get("earlier_node_model") else
                       "; the daemon's model re-tune has no node model to use (it says so: measure with "
                       "[tune] backend = \"local\", or fix the measurements and run `moetune profile --restart`)")
            data.notes.append(f"node fabric model NOT written: the calibration from {cal['base']} was refused: "
                              + "; ".join(cal["refused"]) + earlier)
        data.notes.append(self.ep_note)
        if self.facts.gpu_count == 1:
            # "the megakernel is what was tuned" was said where the tune stage had left every planned model out
            data.notes.append("EP transports need >= 2 GPUs: this node has 1, so no exchange was tuned; " + (
                self.nothing_tuned or "the MoE megakernel (the whole layer on one GPU, family `megakernel`) is what "
                "was tuned"))
        elif self.comm_backend == "gloo":
            data.notes.append("no GPUs here: the measured transport is gloo between CPU processes")
        if not self.mk_ok:
            data.notes.append(f"MoE megakernel not tuned: {self.mk_why}")
        data.notes += [self.mk_left_note(name, why) for name, why in self.left_out.items()]  # as the tune recorded
        data.notes += [self.ep_left_note(row) for row in self.ep_left_out]
        data.notes.extend(_decode_notes(self.state.result("compare") or []))
        for stage, whys in self.state.failures().items():
            data.notes += [f"{stage} not finished: {why} (a rerun of `moetune profile` tries it again)" for why in whys]
        for t in self.state.result("compare") or []:
            if t["family"] == MEGAKERNEL_FAMILY and t.get("stored") == "policy default":
                data.notes.append(f"megakernel {t['model']} S={t['tokens']}: the policy default was kept: "
                                  f"{t.get('why_default', t['reason'])}")
        # kept for `moetune report`, which rebuilds the report from the database: its notes (calibration, EP size,
        # the megakernel) and the importances plot come from here, not from the database
        self.state.data["report_data"] = {"notes": list(data.notes), "importances": data.importances}
        self.state.save()
        return str(write_report(data, self.report_dir))

    def _importances(self) -> dict[str, dict[str, float]]:
        if not self.measures:  # no study ran (a capture of another node)
            return {}
        try:
            import optuna

            from moetune.tuner.search.readback import list_studies
            from moetune.tuner.search.storage import default_storage_url

            url = self.storage or default_storage_url(self.store.path)
            # this run's studies (the state names them); a state from before it did: this node's
            ours = {t["study"] for t in self.state.result("tune") or [] if t.get("study")}
            out = {}
            for s in list_studies(url):
                name = s["study"]
                if (name not in ours) if ours else (self.facts.fingerprint[:12] not in name):
                    continue
                study = optuna.load_study(study_name=name, storage=url)
                done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
                if len({tuple(sorted(t.params.items())) for t in done}) >= 3:
                    # Optuna warns (UserWarning, with its own file and line) where a conditional knob was asked in
                    # fewer than 2 trials: printed raw in the middle of `moetune profile`'s output on every run. As
                    # `tune show` (study.summarize_study) computes them: quietly
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out[name.split("/", 1)[-1]] = optuna.importance.get_param_importances(study)
            return out
        except Exception as e:  # importances are a nicety: never fail the report for them
            self.console.print(f"[yellow]parameter importances not available: {e}[/]")
            return {}

    def _forget_state_of_another_database(self) -> None:
        """Start over when the state's finished stages stored rows (microbenchmarks, compared buckets) and the
        database holds no measurement of this node at all: it is not the file they went into (deleted, or replaced,
        since). Resumed, every stage was "done earlier", nothing was stored in it, and the summary and report said
        stored."""
        st = self.state
        if not self.measures or self.store is None:
            return
        # a microbenchmark kept with no rows stored none
        stored = bool(st.result("microbench") or any(st.partial("microbench").values()) or st.compared())
        # each stored row is a measurement of this fingerprint (a microbenchmark's, a compared bucket's
        # tuned_vs_default); the fingerprint row alone is no sign of them: a new database gets it from a restarted
        # daemon or `fabric show --record` before this rerun
        if not stored or self.store.list_measurements(fingerprint=self.facts.fingerprint, limit=1):
            return
        # the studies are kept (as for a new plan): their finished trials were measured on this node
        st.data = {**{k: st.data[k] for k in ("fingerprint", "plan", "db", "study_tag") if k in st.data}, "done": {}}
        st.dropped = (f"its finished stages stored their rows into a database {self.store.path} no longer holds "
                      f"(no measurement of this node, {self.facts.fingerprint}: deleted or replaced since): starting over")
        st.save()

    def run(self) -> dict[str, Any]:
        self._forget_state_of_another_database()
        if self.unresumed:
            self.console.print(f"[yellow]{_as_text(self.unresumed)}[/]")
        if self.state.dropped:
            self.console.print(f"[yellow]{_as_text(f'{self.state.path.name}: {self.state.dropped}')}[/]")
        again = False  # a stage ran: those after it run too (they build on its result)
        for stage in STAGES:
            # the report is cheap and comes from the state: always written (to --report-dir when given; one deleted
            # since is written again)
            if self.state.done(stage) and not again and stage != "report":
                self.console.print(f"[dim]✓ {stage} (done earlier; resuming)[/]")
                if stage == "discover":
                    # the node as this run found it, recorded all the same: a GPU swapped since the earlier run keeps
                    # the fingerprint (and so this state file), and what the earlier stages measured was the old part's
                    self._record_node()
                continue
            again = True
            self.console.print(f"[bold]→ {stage}[/]")
            self.failed = []  # the stage's failed parts, each with why: it is not done, a rerun tries them again
            result = getattr(self, f"stage_{stage}")()
            if stage in MEASURING_STAGES:  # its results (the tune's candidates) kept for this fingerprint only
                self._check_fabric(f"What the {stage} stage measured")
            self.state.mark(stage, result, failed=self.failed)
        return self.state.data["done"]

    def failures(self) -> list[str]:
        """What failed, stage by stage (none when every stage is done): the command exits 1, and a rerun tries
        them again."""
        return [f"{stage}: {why}" for stage, whys in self.state.failures().items() for why in whys]


def _bringup_report_data(db: Path, fingerprint: str) -> dict[str, Any]:
    """What the last bring-up of the database `db` on `fingerprint` put in its report beyond the database's rows
    (notes, importances), from its state file ({} where there is none or it is another database's)."""
    try:
        state = json.loads((db.parent / state_file_name(db, fingerprint)).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(state, dict) or state.get("db", "") != db.name or state.get("fingerprint") != fingerprint:
        return {}
    got = state.get("report_data")
    return got if isinstance(got, dict) else {}


def report_from_store(store: Any, facts: Any, out_dir: Path) -> Path:
    """Rebuild the report of this node from what the database holds (`moetune report`)."""
    from moetune.tuner.bringup.report import ReportData, write_report

    rows = store.list_measurements(fingerprint=facts.fingerprint)
    # a benchmark's latest run replaces its earlier rows (an interrupted run's, a bring-up before)
    latest = {(r["extra"] or {})["bench"]: (r["extra"] or {}).get("bench_run") for r in rows
              if r["kind"] != "tuned_vs_default" and (r["extra"] or {}).get("bench")}
    measurements, tuned = [], {}
    for r in rows:
        extra = dict(r["extra"] or {})
        if r["kind"] == "tuned_vs_default":
            for k in ("default_us", "tuned_us"):  # a failed run is stored as null
                extra[k] = float("nan") if extra.get(k) is None else extra[k]
            # the latest of a bucket wins; each EP size is a bucket of its own
            tuned[(extra.get("model"), extra.get("tokens"), extra.get("family"), extra.get("ep_size"))] = extra
        elif extra.get("bench") and latest[extra["bench"]] != extra.get("bench_run"):
            continue
        else:
            measurements.append({"transport": r["transport"], "kind": r["kind"], "direction": extra.get("direction", ""),
                                 "size_bytes": r["size_bytes"], "value": r["value"], "spread": r["spread"],
                                 "unit": r["unit"], "extra": extra})
    data = ReportData(**_report_node(facts), measurements=measurements,
                      tuned=list(tuned.values()))  # every bucket, one whose tuned run failed too
    # the bring-up's notes and importances (`stage_report`), from its state beside this database: without them this
    # report dropped the notes and deleted the importances plot of the bring-up's report
    kept = _bringup_report_data(Path(store.path), facts.fingerprint)
    data.notes += [str(n) for n in kept.get("notes") or []]
    data.importances = {str(k): dict(v) for k, v in (kept.get("importances") or {}).items() if isinstance(v, dict)}
    if not measurements and not tuned:
        data.notes.append("nothing measured on this node yet: run `moetune profile`")
    return write_report(data, out_dir)
