"""The scenario files: Needs, Case and Scenario, read from TOML and validated (`load`, `load_all`, `get`)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetune.tuner.measure.scenarios.checkout import IN_CHECKOUT, NOT_A_CHECKOUT, SCENARIO_DIR
from moetune.tuner.measure.scenarios.drivers.registry import DRIVERS, IN_PROCESS, PER_CASE_ARGS, SINGLE_SHOT
from moetune.tuner.measure.scenarios.errors import ScenarioError

_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")


@dataclass(frozen=True)
class Needs:
    """What a machine must have: `gpus` CUDA devices, `world` ranks over `backend`; `hardware` in words."""

    gpus: int = 0
    world: int = 1
    backend: str = "none"
    hardware: str = "any machine"

    def describe(self) -> str:
        gpu = f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}" if self.gpus else "CPU"
        return f"{gpu}, world {self.world}" + (f", {self.backend}" if self.backend != "none" else "")


@dataclass(frozen=True)
class Case:
    name: str
    args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # runtime options (RuntimeOptions field names): the scenario's `[options]` with the case's own `options` over
    # them, checked when the file is read
    options: dict[str, Any] = field(default_factory=dict)
    smoke: bool = True  # False: left out of --smoke (a case that exists on GPUs only)
    smoke_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    name: str
    path: Path
    question: str
    driver: str
    needs: Needs
    cases: tuple[Case, ...]
    metrics: tuple[str, ...]
    better: str = "lower"  # of the first metric: "lower" (times) or "higher" (throughput)
    launches: int = 3
    args: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # `[options]`: runtime options of every case
    smoke_args: dict[str, Any] = field(default_factory=dict)
    smoke_needs: Needs = field(default_factory=Needs)
    smoke_skip: str = ""  # why no CPU variant can exist ("" = there is one)
    # the metrics that are predictions (`modelled = [...]` in the file): a name, or the name before "[" of a family
    # (`speedup` is speedup[2nodes], speedup[16nodes], ...)
    modelled: tuple[str, ...] = ()

    @property
    def baseline(self) -> Case:
        return self.cases[0]

    def is_modelled(self, metric: str) -> bool:
        """Whether the scenario declares `metric` a prediction (its rows carry MODELLED, a FAILED one too)."""
        return metric in self.modelled or metric.split("[", 1)[0] in self.modelled


def _table(d: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    v = d.get(key, {})
    if not isinstance(v, dict):
        raise ScenarioError(f"{where}: '{key}' must be a table")
    return v


# the keys each table of a scenario file takes: any other is a typo, refused (it was dropped without a word: `[needs]
# gpu = 2` made a GPU scenario one that runs on any machine)
TOP_KEYS = ("name", "driver", "question", "cases", "metrics", "better", "launches", "modelled", "args", "env", "options",
            "needs", "smoke")
CASE_KEYS = ("name", "args", "env", "options", "smoke", "smoke_args")
NEEDS_KEYS = ("gpus", "world", "backend", "hardware")
SMOKE_KEYS = ("args", "needs", "skip")


def _known(d: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    """ScenarioError naming `where` and each key of `d` not in `keys`."""
    unknown = sorted(set(d) - set(keys))
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {unknown}; known: {', '.join(keys)}")


def _needs(d: dict[str, Any], where: str) -> Needs:
    _known(d, NEEDS_KEYS, where)
    for k in ("gpus", "world"):  # int() made gpus = 1.5 one GPU and world = "2" two ranks, without a word
        if k in d and (not isinstance(d[k], int) or isinstance(d[k], bool)):
            raise ScenarioError(f"{where}: {k} must be an integer, got {d[k]!r}")
    try:
        n = Needs(gpus=int(d.get("gpus", 0)), world=int(d.get("world", 1)), backend=str(d.get("backend", "none")),
                  hardware=str(d.get("hardware", "any machine")))
    except (TypeError, ValueError) as e:
        raise ScenarioError(f"{where}: bad needs ({e})") from None
    if n.gpus < 0 or n.world < 1 or n.backend not in ("none", "gloo", "nccl"):
        raise ScenarioError(f"{where}: needs.gpus >= 0, needs.world >= 1, needs.backend none|gloo|nccl; got {n}")
    return n


# drivers that hand runtime options (`options = {...}`) to what they measure; any other refuses them at load
OPTION_DRIVERS = frozenset({"ep"})


def _env(d: dict[str, Any], where: str) -> dict[str, str]:
    """A scenario's or a case's `env` table, refused where it sets a `MOETUNE_*` variable that cannot work or that
    belongs in a typed table: a retired one (an EP buffer refuses to be built under one that became a knob: the
    case could only fail), a runtime option's (`options = {...}` instead: checked when the file is read, where a
    variable's bad value surfaced only in the ranks of a launch), or one docs/settings.md does not list (a typo:
    silently no setting at all). Build and debug variables (MOETUNE_CSRC_LIB, ...) and everything that is not
    moetune's (NCCL_*, ...) pass."""
    from moetune.runtime import options as O

    env = {k: str(v) for k, v in _table(d, "env", where).items()}
    option_of = {doc.env: doc.name for doc in O.OPTION_DOCS}
    for k in env:
        retired = next((r for r in O.RETIRED if r.env == k), None)
        if retired is not None:
            hint = (" (in the case's knobs: args = { knobs = \"...\" })" if retired.now.startswith("the knob") else "")
            raise ScenarioError(f"{where}: env sets {k}, a retired variable the runtime no longer reads (an EP buffer "
                                f"refuses it where it became a knob): it is {retired.now} now{hint}; drop it from env")
        if k in option_of:
            raise ScenarioError(f"{where}: env sets {k}, the variable of runtime option {option_of[k]}: set it as "
                                f"`options = {{ {option_of[k]} = ... }}` (typed, checked when the scenario is read)")
        if k.startswith("MOETUNE_") and k not in O.documented_variables():
            raise ScenarioError(f"{where}: env sets {k}, which no moetune code reads (not in docs/settings.md)")
    return env


def _options(scenario: dict[str, Any], case: dict[str, Any], where: str, drv: str) -> dict[str, Any]:
    """The runtime options of one case (the scenario's `[options]`, then the case's `options`), checked as
    RuntimeOptions checks them; ScenarioError naming the file, the case and the option."""
    from moetune.runtime.options import RuntimeOptionError, RuntimeOptions

    merged = {**scenario, **case}
    if merged and drv not in OPTION_DRIVERS:
        raise ScenarioError(f"{where}: driver {drv} takes no runtime options (options = {{...}}); drivers that do: "
                            f"{', '.join(sorted(OPTION_DRIVERS))}")
    try:
        RuntimeOptions.from_dict(merged)
    except RuntimeOptionError as e:
        raise ScenarioError(f"{where}: options: {e}") from None
    return merged


def _check_ep_knobs(args: dict[str, Any], where: str) -> None:
    """An ep case's knobs parse, with its transport applied, as the EP benchmark takes them (`Knobs.parse`, then
    `transport`): a knob its transport has not (wait_mode off host_staged) fails every launch, so it fails here."""
    from moetune.runtime.knobs import KnobError, Knobs

    try:
        k = Knobs.parse(str(args.get("knobs") or ""))
        if args.get("transport") and args["transport"] != k.transport:
            k.replace(transport=str(args["transport"]))
    except KnobError as e:
        raise ScenarioError(f"{where}: knobs {args.get('knobs', '')!r}: {e}") from None


def load(path: Path) -> Scenario:
    """Read and validate one scenario file; errors name the file and the key."""
    where = str(path)
    try:
        d = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ScenarioError(f"{where}: {e}") from None
    name = d.get("name", "")
    if name != path.stem or not _NAME.match(name):
        raise ScenarioError(f"{where}: 'name' must equal the file's stem ({path.stem!r}) in lower-case-with-dashes, got {name!r}")
    drv = d.get("driver", "")
    if drv not in DRIVERS:
        raise ScenarioError(f"{where}: unknown driver {drv!r}; registered drivers: {', '.join(sorted(DRIVERS))}")
    _known(d, TOP_KEYS, where)
    raw_cases = d.get("cases", [])
    if not isinstance(raw_cases, list) or not raw_cases:
        raise ScenarioError(f"{where}: at least one [[cases]] entry is needed (the first is the baseline)")
    scenario_options = _table(d, "options", where)
    cases = []
    for i, c in enumerate(raw_cases):
        cw = f"{where}: cases[{i}]"
        if not isinstance(c, dict) or not _NAME.match(str(c.get("name", ""))):
            raise ScenarioError(f"{cw}: every case needs a lower-case-with-dashes 'name'")
        cw = f"{cw} ({c['name']})"
        _known(c, CASE_KEYS, cw)
        if not isinstance(c.get("smoke", True), bool):  # bool("false") is True: the GPU-only case ran in smoke runs
            raise ScenarioError(f"{cw}: 'smoke' must be true or false, got {c['smoke']!r}")
        cases.append(Case(name=c["name"], args=_table(c, "args", cw), env=_env(c, cw),
                          options=_options(scenario_options, _table(c, "options", cw), cw, drv),
                          smoke=bool(c.get("smoke", True)), smoke_args=_table(c, "smoke_args", cw)))
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{where}: case names repeat: {names}")
    if drv in IN_PROCESS:
        for wh, env in ((where, _table(d, "env", where)), *((f"{where}: cases[{i}] ({c.name})", c.env)
                                                            for i, c in enumerate(cases))):
            if env:
                raise ScenarioError(f"{wh}: env sets {', '.join(sorted(env))}: driver {drv} measures in `bench "
                                    "run`'s own process, where no variable set now applies (CUDA and torch read "
                                    "theirs at start); set it in the environment `moetune bench run` starts in")
    own = PER_CASE_ARGS.get(drv, ())
    if drv in SINGLE_SHOT and own is not None:
        for i, c in enumerate(cases):
            if extra := sorted((set(c.args) | set(c.smoke_args)) - set(own)):
                raise ScenarioError(
                    f"{where}: cases[{i}] ({c.name}) sets {', '.join(extra)}: driver {drv} runs every case in one "
                    "process with one setting, so a case's own value would be ignored (the first case's applies to "
                    "all); put it in [args] (or [smoke] args)"
                    + (f"; a case sets only {', '.join(own)}" if own else "; its cases take no arguments"))
        for i, c in enumerate(cases[1:], 1):  # the script runs once, with the first case's environment
            if c.env != cases[0].env:
                raise ScenarioError(
                    f"{where}: cases[{i}] ({c.name}): its env {c.env} is not the first case's {cases[0].env}: driver "
                    f"{drv} runs every case in one process with the first case's environment, so it would be "
                    "ignored; put what every case needs in the scenario's [env]")
    if not cases[0].smoke:
        raise ScenarioError(f"{where}: the baseline (first case) must run in smoke mode too")
    metrics = d.get("metrics", [])
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
        raise ScenarioError(f"{where}: 'metrics' must be a non-empty list of metric names (the first is the summary's)")
    better = d.get("better", "lower")
    if better not in ("lower", "higher"):
        raise ScenarioError(f"{where}: 'better' must be lower or higher, got {better!r}")
    launches = d.get("launches", 3)
    if not isinstance(launches, int) or isinstance(launches, bool) or launches < 1:  # true is an int (1)
        raise ScenarioError(f"{where}: 'launches' must be an integer >= 1")
    modelled = d.get("modelled", [])
    if not isinstance(modelled, list) or not all(isinstance(m, str) and m for m in modelled):
        raise ScenarioError(f"{where}: 'modelled' must be a list of metric names (or of the name before '[' of a "
                            "family of metrics) that are predictions, not measurements")
    smoke = _table(d, "smoke", where)
    _known(smoke, SMOKE_KEYS, f"{where}: smoke")
    question = str(d.get("question", "")).strip()
    if not question:
        raise ScenarioError(f"{where}: 'question' (what the scenario measures, in words) is required")
    args, smoke_args = _table(d, "args", where), _table(smoke, "args", f"{where}: smoke")
    if drv == "ep":
        for i, c in enumerate(cases):
            _check_ep_knobs({**args, **c.args}, f"{where}: cases[{i}] ({c.name})")
            if c.smoke:
                _check_ep_knobs({**args, **c.args, **smoke_args, **c.smoke_args}, f"{where}: cases[{i}] ({c.name}), smoke")
    return Scenario(
        name=name, path=path, question=question, driver=drv, needs=_needs(_table(d, "needs", where), f"{where}: needs"),
        cases=tuple(cases), metrics=tuple(metrics), better=better, launches=launches, args=args,
        env=_env(d, where), options=scenario_options, smoke_args=smoke_args,
        smoke_needs=_needs(_table(smoke, "needs", f"{where}: smoke"), f"{where}: smoke.needs"),
        smoke_skip=str(smoke.get("skip", "")), modelled=tuple(modelled),
    )


def _require_dir(directory: Path) -> None:
    """ScenarioError unless the scenario folder exists (saying why when moetune is not run from a checkout)."""
    if not directory.is_dir():
        raise ScenarioError(NOT_A_CHECKOUT if directory == SCENARIO_DIR and not IN_CHECKOUT
                            else f"no scenario folder at {directory}")


def load_all(directory: Path = SCENARIO_DIR) -> dict[str, Scenario]:
    """Every scenario in the folder, by name."""
    _require_dir(directory)
    return {s.name: s for s in (load(p) for p in sorted(directory.glob("*.toml")))}


def get(name: str, directory: Path = SCENARIO_DIR) -> Scenario:
    _require_dir(directory)
    path = directory / f"{name}.toml"
    # a name, not a path: "../x" or "/tmp/y" would load a TOML from outside the scenario folder
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name) or not path.exists():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.toml")))
        raise ScenarioError(f"no scenario {name!r}; known: {known}")
    return load(path)
