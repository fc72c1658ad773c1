"""The default re-tune of a daemon job and what it refuses: planning by group and shape, the backend it tunes with."""

from __future__ import annotations

import collections
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from moetune.runtime.profile_record import (
    ENGINE_FAMILIES,
    MEGAKERNEL_FAMILY,
    UNIFORM_ROUTING,
    ProfileKey,
    ProfileRecord,
    family_refusal,
    key_knobs_problem,
    megakernel_key_problem,
    not_served_reason,
)
from moetune.runtime.shapes import MODELS, ModelShape

if TYPE_CHECKING:
    from moetune.tuner.daemon.jobs import Job, JobContext
    from moetune.tuner.daemon.server import TuneSettings
    from moetune.tuner.search.backends import BenchmarkBackend
    from moetune.tuner.store.store import Store

# the jobs' logger: what a re-tune logs is its job's, under the name the daemon's log has always shown
log = logging.getLogger("moetune.daemon.jobs")


def _shape_of(key: ProfileKey) -> ModelShape:
    for m in MODELS.values():
        if (m.hidden, m.intermediate, m.experts, m.topk, m.dtype) == (key.hidden, key.intermediate, key.experts, key.topk, key.dtype):
            return m
    name = f"custom:{key.hidden},{key.intermediate},{key.experts},{key.topk},{key.dtype}"
    return ModelShape(name=name, hidden=key.hidden, intermediate=key.intermediate, experts=key.experts, topk=key.topk, dtype=key.dtype)


def group_keys(keys: list[ProfileKey], routing_of: Callable[[ProfileKey], str] | None = None,
               ) -> dict[tuple[int, int], dict[tuple[str, str], tuple[ModelShape, list[int]]]]:
    """(ep_size, nodes) -> {(routing, shape name): (shape, its token buckets)} to re-tune: each shape is one tune call
    with the buckets its keys have, never another shape's (a cross product tuned keys nobody asked for), under the
    routing `routing_of` says its key was tuned under (uniform without it): a call tunes one routing, and a key
    re-tuned under another than its profile's comes back as another routing's profile (`Store.routing_of`)."""
    groups: dict[tuple[int, int], dict[tuple[str, str], tuple[ModelShape, set[int]]]] = {}
    for k in keys:
        m = _shape_of(k)
        routing = routing_of(k) if routing_of is not None else UNIFORM_ROUTING
        groups.setdefault((k.ep_size, k.nodes), {}).setdefault((routing, m.name), (m, set()))[1].add(k.token_bucket)
    return {g: {n: (m, sorted(b)) for n, (m, b) in shapes.items()} for g, shapes in groups.items()}


def tuning_key(k: ProfileKey) -> tuple:
    """What a re-tune of `k` tunes (its fingerprint and software are the node's at the time): an EP key's group,
    shape and bucket (its re-tune tunes the node's transport families), and for an engine family (the megakernel,
    its own tune at EP 1) that family too, so a transport profile at EP 1 never stands for a megakernel key."""
    engine = k.transport_family if k.transport_family in ENGINE_FAMILIES else ""
    return (k.ep_size, k.nodes, k.hidden, k.intermediate, k.experts, k.topk, k.dtype, k.token_bucket, engine)


def served_tuning_keys(records: Iterable[ProfileRecord]) -> set[tuple]:
    """The `tuning_key`s that a current row of `records` is served for: a row no lookup serves (`not_served_reason`:
    its knobs contradict its family, or no run of this runtime can take it) stands for no key, whose lookups fall
    back as for a missing row; its key is re-tuned as one without a current profile."""
    return {tuning_key(r.key) for r in records if not_served_reason(r.key, r.knobs) is None}


def key_holds_a_profile(rec: ProfileRecord) -> bool:
    """Whether a re-tune of `rec`'s key can give it a served profile: not where the key itself contradicts its family
    (a megakernel key at EP 2, or of a dtype other than bf16: the store refuses every profile of it), only where the
    knobs do (engine=megakernel under a transport key: a re-tune stores sound ones)."""
    p = key_knobs_problem(rec.key, rec.knobs)
    return p is None or not p[0].startswith("key.")


TUNE_BACKENDS = ("model", "local")  # [tune] backend: this node's calibrated model, or measure on this node


class RetuneImpossible(RuntimeError):
    """The automatic re-tune cannot produce a profile that is true for this node (said, not guessed)."""


def node_model_file(store: Store, fingerprint: str, directory: str | Path | None = None) -> Path:
    """Where `moetune profile` leaves this node's calibrated fabric model: node-<fingerprint>.toml in the
    bring-up state directory, which is the database's directory."""
    base = Path(directory) if directory else Path(store.path).parent
    return base / f"node-{fingerprint}.toml"


def _capture_elsewhere(facts: Any) -> str:
    """'' unless `facts` were read from a capture (`serve --capture`) of another node than this one: why then (a
    number measured here may be stored only under this node's identity, as `tune --capture` refuses)."""
    src = str(getattr(facts, "source", ""))
    if not src.startswith("capture:"):
        return ""
    from moetune.tuner.fabric.discovery import capture_not_this_node

    return capture_not_this_node(facts, src.removeprefix("capture:"))


def _backend_for(ctx: JobContext) -> tuple[Any, str | None]:
    """(backend, calibrated preset file or None) for this node; RetuneImpossible otherwise. The search labels
    what it writes from these: a local measurement is measured, this node's calibrated model node_model."""
    return node_backend(ctx.store, ctx.facts, ctx.tune)


def node_backend(store: Store, facts: Any, tune: TuneSettings) -> tuple[Any, str | None]:
    """`_backend_for` of a store, facts and [tune] settings: also asked before a user's `retune` is queued
    (`retune_refusal`)."""
    backend = tune.backend
    if backend == "local":  # (a capture of another node is refused before: key_refusals)
        return "local", None
    if backend != "model":
        raise RetuneImpossible(f"unknown tune.backend {backend!r} (expected one of {', '.join(TUNE_BACKENDS)})")
    path = node_model_file(store, facts.fingerprint, tune.node_model_dir)
    if not path.is_file():
        # `moetune profile` alone is no advice after a bring-up whose calibration was refused: a rerun resumes its
        # finished stages ("calibrate (done earlier; resuming)") and writes no model again
        raise RetuneImpossible(
            f"cannot re-tune fabric {facts.fingerprint}: no calibrated model of this node ({path} does not exist) "
            "and [tune] backend is \"model\"; set [tune] backend = \"local\" to measure, or run `moetune profile` "
            "on this node to calibrate one (where a bring-up already finished with its calibration refused, a rerun "
            "only resumes it and writes none: `moetune profile --restart` measures and calibrates again). Still "
            "serving the profiles that remain valid.")
    from moetune.tuner.fabric_model.calibration_record import forced_fit_warning
    from moetune.tuner.fabric_model.presets import load_preset
    from moetune.tuner.search.model_backend import ModelBackend

    try:
        preset = load_preset(path, fresh=True)  # as on disk now: `moetune profile` may have re-written it since
    except (OSError, ValueError) as e:
        raise RetuneImpossible(f"cannot re-tune fabric {facts.fingerprint}: the calibrated model {path} is unreadable: {e}") from None
    warning = forced_fit_warning(preset)
    if warning:
        # the calibration checks refused this fit (`--force` wrote it): it must not silently become the
        # basis of the profiles served for this node
        raise RetuneImpossible(
            f"cannot re-tune fabric {facts.fingerprint}: the calibrated model {path} is a fit the calibration checks "
            f"refused ([calibration] warning: {warning}); re-run `moetune profile` on this node, "
            "or `moetune model calibrate` without --force, or set [tune] backend = \"local\" to measure. "
            "Still serving the profiles that remain valid.")
    from moetune.tuner.fabric_model.presets import node_model_refusal

    # the file's name is no proof: a file copied from another node, or written before presets recorded their node,
    # would have its predictions stored as THIS node's model (node_model, outranking every preset)
    why = node_model_refusal(preset, facts.fingerprint)
    if why:
        raise RetuneImpossible(f"cannot re-tune fabric {facts.fingerprint} with the calibrated model {path}: {why}. "
                               "Still serving the profiles that remain valid.")
    return ModelBackend(preset), str(path)


def model_family(store: Store, facts: Any, tune: TuneSettings) -> str | None:
    """The transport family a re-tune with [tune] backend = "model" tunes on this node: its calibrated model's (the
    job tunes with `node_model`, which tunes that family only). None with the local backend, or where the model is
    missing or refused (`retune_refusal` says why; the job then fails as impossible)."""
    if tune.backend != "model" or facts is None:
        return None
    try:
        be, _path = node_backend(store, facts, tune)
    except RetuneImpossible:
        return None
    family = getattr(be.preset, "family", None)
    return family if isinstance(family, str) and family else None


def retune_refusal(store: Store, facts: Any, tune: TuneSettings, keys: list[ProfileKey]) -> str:
    """Why the default re-tune (`tuner_retune`) of `keys` cannot run at all ('' when it may): with [tune] backend =
    "model", EP keys need this node's accepted node model (`node_backend`), and without it the whole job fails as
    impossible. Asked before a user's `retune` queues a job that could only fail that way. Nothing else is asked
    here: a local job's refusals depend on what it finds when it runs (the GPUs, the megakernel's library), and a
    job of megakernel keys alone says its own reason."""
    if tune.backend != "model" or facts is None or all(k.transport_family in ENGINE_FAMILIES for k in keys):
        return ""
    try:
        node_backend(store, facts, tune)
    except RetuneImpossible as e:
        return str(e)
    return ""


def local_refusal(ep_size: int, nodes: int, gpus: int) -> str:
    """Why a local re-tune cannot measure the EP group (ep_size, nodes) on this node ('' when it can): it launches
    ep_size ranks on this one host, one per GPU (a node without GPUs runs them as gloo processes on its CPUs, as
    its bring-up did), and stores what it ran as MEASURED."""
    if nodes > 1:
        return (f"a local re-tune measures on this one node, the group spans {nodes} nodes "
                "(measuring it needs every node of the group)")
    if gpus >= 1 and ep_size > gpus:
        return f"EP {ep_size} needs {ep_size} GPUs, this node has {gpus}"
    return ""


# what a re-tune of keys the local backend cannot measure here may do instead (the job's failure, a user's refusal)
MEASURE_ELSEWHERE = ("Re-tune them where the group can be measured, or set [tune] backend = \"model\" to predict "
                     "them (stored as node_model)")


class KeyRefusal(NamedTuple):
    """Keys the default re-tune refuses on this node (`key_refusals`), one EP group or megakernel lot at a time."""

    keys: list[ProfileKey]
    what: str  # "2 key(s) of EP 16 over 2 node(s)"
    verb: str  # not "re-tuned" / not "re-measured"
    why: str  # "" where `what` says it
    measuring: bool  # the local backend cannot measure the group here: the model backend may predict it

    def said(self, tail: str = "", *, naming: bool = False) -> str:
        """"<what> not <verb>: <why>[; <tail>]", the keys' shapes and buckets after <what> with `naming`."""
        named = f" ({key_names(self.keys)})" if naming else ""
        return (f"{self.what}{named} not {self.verb}" + (f": {self.why}" if self.why else "")
                + (f"; {tail}" if tail else ""))


def key_names(keys: list[ProfileKey]) -> str:
    """The keys as a user names them: each shape (with its families) at its token buckets."""
    shapes: dict[str, tuple[set[str], set[int]]] = {}
    for k in keys:
        fams, buckets = shapes.setdefault(_shape_of(k).name, (set(), set()))
        fams.add(k.transport_family)
        buckets.add(k.token_bucket)
    return "; ".join(f"{name} [{', '.join(sorted(f))}] at {', '.join(map(str, sorted(b)))} token(s)"
                     for name, (f, b) in sorted(shapes.items()))


def key_refusals(keys: list[ProfileKey], facts: Any, backend: str, tuned_family: str | None = None,
                 ) -> list[KeyRefusal]:
    """The keys of `keys` that the default re-tune (`tuner_retune`) with [tune] backend `backend` refuses on the node
    of `facts`, and why: the job refuses them by this (they stay stale), and a user's `retune` leaves them out of
    the job it queues (handlers.run_retune). An EP group of a transport family at EP 1 (both backends:
    `one_rank_exchange`); with "local", a group this node cannot measure (`local_refusal`: several nodes, more
    ranks than it has GPUs); with "model", a group for which `tuned_family` (the family it tunes here: `model_family`;
    None: not known, nothing refused so) gives only what-if profiles (`family_refusal`: nvlink or host_staged across
    nodes, ibgda: the key would be planned again by every `retune`, its new row never served); a megakernel key not at EP 1 on one node or not bf16 (`megakernel_key_problem`), or one
    `megakernel_refusal` refuses. With "local" and facts read from a capture of another node (`_capture_elsewhere`),
    every key, the megakernel's too: it measures on this machine only. An EP key's family is no reason: its group is
    re-tuned over the node's families, whichever the key names."""
    from moetune.tuner.search.backends import one_rank_exchange

    local = backend == "local"
    elsewhere = _capture_elsewhere(facts) if local and keys else ""
    if elsewhere:
        # what it measured here would be stored under the captured node's identity: the whole job failed once it ran
        # (queued first); refused here, the reply leaves every key out at once and says why
        measuring = any(k.transport_family not in ENGINE_FAMILIES for k in keys)
        return [KeyRefusal(list(keys), f"{len(keys)} key(s)", "re-measured",
                           f"a local re-tune measures on this machine only, and {elsewhere}", measuring)]
    gpus = int(facts.gpu_count or 0)
    out: list[KeyRefusal] = []
    ep_keys = [k for k in keys if k.transport_family not in ENGINE_FAMILIES]
    for ep, nodes in sorted({(k.ep_size, k.nodes) for k in ep_keys}):
        group = [k for k in ep_keys if (k.ep_size, k.nodes) == (ep, nodes)]
        what = f"{len(group)} key(s) of EP {ep} over {nodes} node(s)"
        one = one_rank_exchange(ep, sorted({k.transport_family for k in group}),
                                done="a re-tune of {families} would store a profile",
                                fix="Neither backend tunes a transport family at EP 1 (both refuse it)")
        if one:
            # a key of a transport family at EP 1 (stored before EP 1 was refused for them): the search refuses it
            # (a ValueError that failed the whole job, every other group's keys untuned with it): refused here
            out.append(KeyRefusal(group, what, "re-tuned", one, False))
            continue
        why = local_refusal(ep, nodes, gpus) if local else ""
        if why:
            out.append(KeyRefusal(group, what, "re-measured", why, True))
            continue
        unserved = family_refusal(tuned_family, ep, nodes) if backend == "model" and tuned_family else None
        if unserved:
            # the model tunes its calibrated family only: a row of it this group cannot run is what-if, never served,
            # so the key stays unserved and every `retune` planned it again (a job that could only repeat itself)
            out.append(KeyRefusal(group, what, "re-tuned",
                                  f'[tune] backend = "model" tunes family {tuned_family} here (this node\'s calibrated '
                                  f"model), which this group can only have as a what-if profile, never served: "
                                  f"{unserved}", False))
    mk_keys = [k for k in keys if k.transport_family == MEGAKERNEL_FAMILY]
    # the store's own rule for a megakernel key (`megakernel_key_problem`): a key no profile of which can be stored.
    # A dtype other than bf16 was queued before (only the group was checked here): it waited for idle GPUs, then
    # every trial was refused ("the megakernel runs bfloat16 activations") and the key stayed as it was
    bad = [k for k in mk_keys if megakernel_key_problem(k) is not None]
    off_group = [k for k in bad if (k.ep_size, k.nodes) != (1, 1)]
    if off_group:
        out.append(KeyRefusal(off_group, f"{len(off_group)} megakernel key(s) not at EP 1 on 1 node (the megakernel "
                                         "runs on one GPU)", "re-tuned", "", False))
    off_dtype = [k for k in bad if k not in off_group]
    if off_dtype:
        dtypes = ", ".join(sorted({k.dtype[:64] for k in off_dtype}))
        out.append(KeyRefusal(off_dtype, f"{len(off_dtype)} megakernel key(s) of dtype {dtypes} (the megakernel "
                                         "runs bfloat16 only)", "re-tuned", "", False))
    good = [k for k in mk_keys if megakernel_key_problem(k) is None]
    why = megakernel_refusal(facts, backend) if good else ""
    if why:
        out.append(KeyRefusal(good, f"{len(good)} megakernel key(s)", "re-tuned", why, False))
    return out


def _installed_version(dist: str) -> str | None:
    """The version of the Python distribution `dist` installed now (None: not installed), read afresh as discovery
    reads it (the runtime's reading is once per process)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
    except Exception:  # a broken dist-info reads as not installed, as discovery reads it
        return None


def process_software_problem() -> str:
    """Why this process runs other software than is installed now ('' when it does not): the torch and moetune it
    imported (`_IMPORTED`), read as discovery reads the installed ones. The megakernel is timed in this process;
    after an upgrade the node's facts, and so the key its profile is stored under, name the installed versions, and
    a measurement here would be the old software's numbers stored as the new one's."""
    if "torch" not in sys.modules:  # the measurement imports the torch installed now
        _IMPORTED["torch"] = _installed_version("torch")
    for dist in ("torch", "moetune"):
        now = _installed_version(dist)
        was = _IMPORTED.setdefault(dist, now)  # imported since, unseen: taken as what is installed now
        if was != now:
            return (f"this daemon's process runs {dist} {was or 'none'}, {dist} {now or 'none'} is installed now "
                    "(the megakernel is timed in this process): restart the daemon to measure with the installed "
                    "software")
    return ""


# The installed versions (importlib.metadata, as discovery reads them for the key) of what this process imported:
# moetune at start (this module is moetune's), torch when it was imported (at start, or after the last check before
# the first megakernel re-tune imports it). Compared with what is installed now, never with torch.__version__: a
# build's own version string can differ from its metadata for the same install (2.11.0+cu130 against 2.11.0 on the
# GPU machine of run 233).
_IMPORTED: dict[str, str | None] = {"moetune": _installed_version("moetune")}
if "torch" in sys.modules:
    _IMPORTED["torch"] = _installed_version("torch")


def megakernel_refusal(facts: Any, backend: str) -> str:
    """Why the re-tune cannot re-tune a `megakernel` key on this node ('' when it can).

    The megakernel (family `megakernel`, ep_size 1, nodes 1) is the whole MoE layer in one kernel on one GPU, not
    an EP exchange: only a measurement of it on this node makes its profile (the bring-up's megakernel backend,
    `megakernel_backend`). The fabric model predicts exchanges, so the model backend has nothing to say of it; a
    measurement needs an sm_90 (Hopper) GPU and the megakernel's library (a prebuilt one in MOETUNE_MK_LIB, or nvcc
    to build it) and torch to time it, in a process that runs the installed software (`process_software_problem`).
    Checked before anything runs: a node without them refuses, it never tunes
    another family in the megakernel's place."""
    if backend != "local":
        return ("the fabric model ([tune] backend = \"model\") predicts EP exchanges, not the MoE megakernel's "
                "kernel (it has no prediction for family megakernel); only a measurement on this node re-tunes it: "
                "set [tune] backend = \"local\" or re-run `moetune profile` on this node")
    from moetune.tuner.fabric.families import megakernel_family

    if not hasattr(facts, "gpus"):
        return "this node's facts list no GPU (the megakernel needs an sm_90 GPU)"
    ok, why = megakernel_family(facts)
    if not ok:
        return f"the megakernel cannot run here: {why}"
    pre = os.environ.get("MOETUNE_MK_LIB")
    if pre and not Path(pre).is_file():
        return f"the megakernel library MOETUNE_MK_LIB={pre} does not exist"
    from moetune.runtime.megakernel.engine import library_problem

    why = library_problem()
    if why is not None:
        return f"the megakernel library is not built and cannot be: {why}"
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (the megakernel is timed through torch on the GPU)"
    return process_software_problem()


def megakernel_backend(tune: TuneSettings) -> BenchmarkBackend:
    """The backend that measures the megakernel family: the one GPU, in this process (as `moetune profile`'s
    bring-up measures it, Bringup._mk_backend). Tests replace it with one whose measurement is injected."""
    from moetune.tuner.search.local_backend import LocalBackend

    return LocalBackend(world=1, comm_backend="nccl", family=MEGAKERNEL_FAMILY)


def tuner_retune(ctx: JobContext) -> list[ProfileRecord]:
    """The default re-tune: the tuner's `tune_profiles` on the new facts, per (EP size, nodes) group, and the
    megakernel keys as the megakernel family.

    EP keys: it measures on this node (`[tune] backend = "local"`, world = the key's EP size) or predicts with this
    node's calibrated fabric model (what `moetune profile` wrote for this fingerprint). It never takes a shipped
    preset (another machine) as this node's profile: without a calibrated model it fails with RetuneImpossible,
    which the daemon reports in the job, its log and `status`.

    Megakernel keys (family `megakernel`, EP 1 on one node): measured as that family only, with the bring-up's
    megakernel backend (`megakernel_backend`), when `megakernel_refusal` allows it; otherwise (the model backend,
    no Hopper GPU, no library) they are refused and stay stale, with the reason in the job. They are never tuned as
    the node's transport families at EP 1.

    Routing (EP and megakernel keys alike): each key is tuned under the routing its profile was tuned under
    (`Store.routing_of`: a `moetune tune --routing zipf:S` profile again under zipf:S, a row that records none under
    uniform), one call per routing; the job's message and events count the keys of each routing but uniform.

    Cancellation: the `on_trial` callback stops the study after its running trial, `stop` is asked before every
    study and side-by-side check, and what the calls did is tallied before JobCancelled ends the job."""
    from moetune.tuner.search.tune import (
        NoFamilyServesGroup,
        group_left_out_note,
        make_backend,
        tune_profiles_detailed,
    )

    tune = ctx.tune

    def on_trial(_name: str, study: Any, _trial: Any) -> None:
        if ctx.cancel.is_set():  # the study ends here; `stop` then returns what the call did, tallied below
            study.stop()

    def refuse(msg: str) -> None:
        ctx.refused.append(msg)
        log.warning("re-tune job %d: %s", ctx.job.id, msg)

    # a local job of another node's capture: every key is refused here, before anything reads the store or measures
    refusals = key_refusals(ctx.keys, ctx.facts, tune.backend, model_family(ctx.store, ctx.facts, tune))
    for r in refusals:
        refuse(r.said("they stay stale"))
    ep_refused = any(r.measuring for r in refusals)
    refused = {k for r in refusals for k in r.keys}
    # each key is tuned under the routing its profile was: the default (uniform) brought a zipf key back as a uniform
    # profile, or, beside its current zipf profile, one the store never compares with it (the key stayed as it was)
    routings = {k: ctx.store.routing_of(k) for k in ctx.keys if k not in refused}
    ep_keys = [k for k in ctx.keys if k.transport_family not in ENGINE_FAMILIES and k not in refused]
    mk_keys = [k for k in ctx.keys if k.transport_family == MEGAKERNEL_FAMILY and k not in refused]
    runnable = []
    tuned: list[ProfileKey] = []
    for (ep, nodes), shapes in sorted(group_keys(ep_keys, routings.__getitem__).items()):
        runnable.append((ep, nodes, [(r, m, b) for (r, _name), (m, b) in shapes.items()]))
        tuned += [k for k in ep_keys if (k.ep_size, k.nodes) == (ep, nodes)]
    mk_shapes: list[tuple[str, ModelShape, list[int]]] = []
    if mk_keys:  # at EP 1 on one node, measurable here (`key_refusals`)
        mk_shapes = [(r, m, b) for (r, _name), (m, b) in group_keys(mk_keys, routings.__getitem__)[(1, 1)].items()]
        tuned += mk_keys
    if not runnable and not mk_shapes:
        advice = ". " + MEASURE_ELSEWHERE if ep_refused else ""
        raise RetuneImpossible(f"cannot re-tune fabric {ctx.facts.fingerprint} here: " + "; ".join(ctx.refused) + advice)
    be: Any = None
    preset_file: str | None = None
    if runnable:
        try:
            be, preset_file = _backend_for(ctx)
        except RetuneImpossible as e:
            if not ctx.refused:
                raise
            raise RetuneImpossible(f"{e} Also: " + "; ".join(ctx.refused)) from None
    # said in the job's message and events: a routing other than uniform is no default of the tuner
    ctx.job.routings = dict(collections.Counter(routings[k] for k in tuned if routings[k] != UNIFORM_ROUTING))
    written: list[ProfileRecord] = []
    # one time budget for the whole job, whatever the number of calls, shared by bucket: a call gets the time left in
    # the proportion of its buckets to the buckets not tuned yet (unused time passes on to the later calls), as one
    # call shares its own over its studies; before, the first shape could spend the whole job's budget
    deadline = None if tune.timeout_s is None else time.monotonic() + tune.timeout_s
    buckets_left = (sum(len(b) for _ep, _n, shapes in runnable for _r, _m, b in shapes)
                    + sum(len(b) for _r, _m, b in mk_shapes))

    def share(buckets: list[int]) -> float | None:
        nonlocal buckets_left
        n = len(buckets)
        part = n / max(1, buckets_left)  # of the buckets not tuned yet, this call's
        buckets_left -= n
        return None if deadline is None else max(0.0, deadline - time.monotonic()) * part

    # each shape is one call (its own buckets only); a cancel is seen between studies and before each side-by-side
    # check (`stop`), what was done by then is tallied, then the job ends cancelled
    groups_refused = 0  # groups no family of the node can serve (`NoFamilyServesGroup`)
    for ep, nodes, shapes in runnable:
        ctx.check_cancel()

        def left_out(family: str, why: str, ep: int = ep, nodes: int = nodes) -> None:
            # a family the tune left out of this group (its transport cannot serve it): said in the job as the tune
            # says it (one line a family and group, whatever the number of shapes), not only in the daemon's log
            note = group_left_out_note(family, why, ep, nodes)
            if note not in ctx.refused:
                ctx.refused.append(note)

        # a local measurement launches ep ranks on this node (the key it stores is the group it ran): one backend
        # (its bench workers) for the group's shapes
        group_be = make_backend("local", facts=ctx.facts, world=ep) if be == "local" else be
        try:
            for routing, m, buckets in shapes:
                ctx.check_cancel()
                _say_routing(ctx, routing, f"EP {ep} over {nodes} node(s)", m, buckets)
                written += _tally(ctx.job, tune_profiles_detailed(
                    ctx.store, ctx.facts, models=[m], tokens=buckets, backend=group_be, preset=preset_file,
                    trials=tune.trials, timeout_s=share(buckets), ep_size=ep, nodes=nodes, routing=routing,
                    on_trial=on_trial, node_model=preset_file is not None, stop=ctx.cancel.is_set,
                    on_left_out=left_out))
        except NoFamilyServesGroup as e:
            # refused by the tune's plan before any study (every shape of the group alike): that group's refusal,
            # as key_refusals' are; it failed the whole job before, every other group untuned with it
            group = [k for k in ep_keys if (k.ep_size, k.nodes) == (ep, nodes)]
            refuse(f"{len(group)} key(s) of EP {ep} over {nodes} node(s) not re-tuned: {e.why}; they stay stale")
            groups_refused += 1
        finally:
            if group_be is not be:
                group_be.close()
    if runnable and groups_refused == len(runnable) and not mk_shapes:
        # nothing could run: impossible here, as when key_refusals refuses every key up front
        raise RetuneImpossible(f"cannot re-tune fabric {ctx.facts.fingerprint} here: " + "; ".join(ctx.refused))
    if mk_shapes:
        ctx.check_cancel()
        mk_be = megakernel_backend(tune)
        try:
            for routing, m, buckets in mk_shapes:
                ctx.check_cancel()
                _say_routing(ctx, routing, "the megakernel", m, buckets)
                written += _tally(ctx.job, tune_profiles_detailed(
                    ctx.store, ctx.facts, models=[m], tokens=buckets, backend=mk_be, trials=tune.trials,
                    timeout_s=share(buckets), ep_size=1, nodes=1, families=[MEGAKERNEL_FAMILY], routing=routing,
                    on_trial=on_trial, stop=ctx.cancel.is_set))
        finally:
            mk_be.close()  # every backend has one (a no-op where nothing is held)
    ctx.check_cancel()
    return written


def _say_routing(ctx: JobContext, routing: str, group: str, m: ModelShape, buckets: list[int]) -> None:
    if routing != UNIFORM_ROUTING:  # the log says what the job's message counts
        log.info("re-tune job %d: %s, %s at %s token(s) under routing %s (as its profile was tuned)", ctx.job.id, group,
                 m.name, ",".join(map(str, buckets)), routing)


def _tally(job: Job, results: list[Any]) -> list[ProfileRecord]:
    """The records a re-tune wrote as current (`TuneResult`s in); the rest said in the job: a key whose current
    profile stayed (a prediction beside a measurement, a result within the noise, the incumbent held its own in
    the side-by-side check: `kept`, with the distinct reasons) or that got no result at all, and why."""
    written = []
    for r in results:
        if r.written and r.record is not None:
            written.append(r.record)
        elif r.stopped:  # the job's cancel: said as cancelled, not as a key that kept its profile
            continue
        elif r.kept and r.study.best_knobs is not None and not r.budget_ended:
            job.kept += 1
            if r.reason and r.reason not in job.kept_why:
                job.kept_why.append(r.reason)
        else:  # nothing to compare (no successful trial, the budget ended), whether or not a profile stands
            job.no_result.append(f"{r.study.study_name}: {r.reason}")
    return written
