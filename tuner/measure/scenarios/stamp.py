"""The stamp every row carries: the code (git SHA, dirty), versions, GPU, fabric fingerprint, hardware."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetune.tuner.measure.scenarios.checkout import BENCHMARKS_MD, IN_CHECKOUT, ROOT, SUMMARY_CSV

# what the bench commands themselves write into the checkout: the results table, the rows kept beside it where it could
# not be written (results.keep_rows) and BENCHMARKS.md. Results, not code: changed, they left the next `bench run`'s
# rows stamped dirty (each such launch a batch of its own in the summary, never pooled at its commit). With them the
# temporary file `bench summarize` writes BENCHMARKS.md through (store.atomic_files.write_temp's ".NAME.<random>.tmp"),
# which a summarize killed before its rename leaves behind: it too stamped every later row dirty
_RESULTS = (SUMMARY_CSV.relative_to(ROOT).as_posix(),
            (SUMMARY_CSV.parent / f"{SUMMARY_CSV.stem}.unsaved-*.csv").relative_to(ROOT).as_posix(),
            BENCHMARKS_MD.relative_to(ROOT).as_posix(),
            (BENCHMARKS_MD.parent / f".{BENCHMARKS_MD.name}.*.tmp").relative_to(ROOT).as_posix())


def _git(*args: str) -> str:
    """git's output for `args` in ROOT, "" where it failed or moetune is not run from a checkout."""
    return _git_answer(*args) or ""


def _git_answer(*args: str) -> str | None:
    """git's output for `args` in ROOT, None where git gave no answer (not a checkout, no git, a non-zero exit, the
    10 s timeout): `code_stamp` must tell "no changes" ("") from "could not tell"."""
    if not IN_CHECKOUT:  # installed: a git repository around site-packages (a venv in a clone) is not this code
        return None
    try:
        p = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _given_sha() -> tuple[str, bool]:
    """MOETUNE_GIT_SHA: (the commit a copied tree is, whether the tree had changes on top of it): hex, 7-40
    digits, with "-dirty" appended when the copy was not exactly that commit (bench/tools/sync_megakernel_device.sh
    writes it so); ("", False) when unset or malformed."""
    v = os.environ.get("MOETUNE_GIT_SHA", "").strip().lower()
    m = re.fullmatch(r"([0-9a-f]{7,40})(-dirty)?", v)
    return (m.group(1), bool(m.group(2))) if m else ("", False)


def code_stamp() -> tuple[str, bool]:
    """(git SHA, dirty) of the code that runs. Where this tree is a git checkout of its own (git's top level is ROOT),
    git decides: HEAD, and dirty where `git status` shows any change, untracked files included (a scenario or driver
    not yet added ran, and the commit does not hold it), but for the results the bench commands write (`_RESULTS`),
    and dirty where `git status` gives no answer (a timeout, an error: the changes could not be checked, with a
    warning). MOETUNE_GIT_SHA (`_given_sha`) stamps only a tree without
    one (an exported tree on a GPU machine: bench/tools/sync_megakernel_device.sh writes it), and a tree whose .git does not know
    the commit the variable names (a stale .git copied with a newer tree: the variable's commit, always dirty, as
    unverified); where both exist and disagree otherwise,
    git's HEAD and dirtiness are stamped and a warning says so (before, the variable won: a dirty checkout was stamped
    clean with whatever commit it named). Neither: ("unknown", False)."""
    given, given_dirty = _given_sha()
    top = _git("rev-parse", "--show-toplevel")
    own = bool(top) and Path(top).resolve() == ROOT.resolve()  # not a repository around it (an archive unpacked in one)
    head = _git("rev-parse", "HEAD") if own else ""
    if not head:
        return (given, given_dirty) if given else ("unknown", False)
    if given and not head.lower().startswith(given) and not _git("rev-parse", "--verify", "--quiet",
                                                                    f"{given}^{{commit}}"):
        # a commit this repository has never seen: a stale .git copied along with a newer tree (run 13's case), where
        # the variable (set by whoever staged the tree) names the code, or a variable naming nothing real. Its commit
        # is stamped, never clean: nothing here can confirm the tree is exactly that commit
        warnings.warn(f"MOETUNE_GIT_SHA={given} is unknown to this tree's .git (HEAD {head[:12]}): a stale .git? "
                      "stamping the variable's commit, marked dirty (unverified)", stacklevel=2)
        return given, True
    status = _git_answer("status", "--porcelain", "--untracked-files=normal", "--", ".",
                         *(f":(exclude,glob){path}" for path in _RESULTS))
    if status is None:
        # git could not say whether the tree has changes (a status that timed out on a large copied tree, a broken
        # index): "" (no changes) was taken for an answer and such a tree was stamped clean. Unverified is dirty
        warnings.warn(f"`git status` gave no answer in {ROOT}: stamping HEAD {head[:12]} as dirty (its changes "
                      "could not be checked)", stacklevel=2)
    dirty = status is None or bool(status)
    if given and (not head.lower().startswith(given) or given_dirty != dirty):
        warnings.warn(f"MOETUNE_GIT_SHA={given}{'-dirty' if given_dirty else ''} is not this checkout: git says HEAD "
                      f"{head[:12]}{' with changes' if dirty else ''}; stamping git's (the variable is for a tree "
                      "without .git)", stacklevel=2)
    return head, dirty


def machine_facts(backend: str, fingerprint: Callable[[], str] | None = None) -> dict[str, Any]:
    """The stamp every row carries: code (git SHA + dirty), versions, GPU, fabric fingerprint, hardware.

    `fingerprint` computes the fabric fingerprint (the CLI passes discovery's; measure does not import
    fabric, import rule 3)."""
    import torch

    from moetune.tuner import __version__

    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    nccl = ""
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (RuntimeError, AttributeError):
            nccl = ""
    try:
        fp = fingerprint() if fingerprint is not None else "unknown (not given)"
    except Exception as e:  # discovery is a stamp here, not the measurement: say why it is missing
        fp = f"unknown ({type(e).__name__})"
    gpu = torch.cuda.get_device_name(0) if gpus else "none"
    cpu = platform.processor() or platform.machine()
    sha, dirty = code_stamp()
    return {
        "git_sha": sha, "git_dirty": dirty,
        "moetune": __version__, "torch": torch.__version__, "nccl": nccl, "cuda": torch.version.cuda or "",
        "gpu": gpu, "gpu_count": gpus, "fabric_fingerprint": fp,
        "hardware": f"{gpus}x {gpu}, {os.cpu_count()} CPU cores" if gpus else f"{os.cpu_count()} CPU cores ({cpu}), no GPU",
    }
