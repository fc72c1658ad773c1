"""`moetune fabric capture DIR`: save exactly what discovery reads on this node.

Layout (DIR):
  sys/...                      files under /sys discovery read, at their real paths
  proc/...                     files under /proc discovery read (modules, driver version, kernel release)
  commands/<argv joined by _>  stdout of each external command (e.g. commands/nvidia-smi_topo_-m)
  python/packages.json         versions of the Python distributions discovery looks up
  gpu_api.json                 NVML/torch GPU facts, only when nvidia-smi was absent
  manifest.json                format, time, moetune version, each command's status/rc/seconds, file sizes

`moetune fabric show --from DIR` (CaptureSource) reads it back through the same parsers. The manifest's
sizes let a truncated file be reported as such.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

from moetune.tuner.fabric.discovery import SMI_XML, discover_from
from moetune.tuner.fabric.errors import DiscoveryError
from moetune.tuner.fabric.facts import FabricFacts
from moetune.tuner.fabric.sources import (
    CAPTURE_FORMAT,
    GPU_API_FILE,
    MANIFEST_FILE,
    PACKAGES_FILE,
    LiveSource,
    RecordingSource,
    Source,
    command_key,
)

_PROCESSES = re.compile(r"<processes>.*?</processes>", re.S)


class CaptureWriteError(DiscoveryError):
    """The capture directory cannot be written; `errno` the OSError's where one stopped the write (a full disk)."""

    errno: int | None = None


def _rel(path: str) -> str:
    rel = path.lstrip("/")
    if not rel or ".." in Path(rel).parts:
        raise CaptureWriteError(path, "refusing to write a path outside the capture")
    return rel


def write_capture(rec: RecordingSource, dest: Path, facts: FabricFacts) -> Path:
    files: dict[str, int] = {}
    for path in rec.dirs:  # directories listed, even empty ones (e.g. /sys/class/infiniband with no HCA)
        (dest / _rel(path)).mkdir(parents=True, exist_ok=True)
    for path, data in rec.files.items():
        p = dest / _rel(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        files[_rel(path)] = len(data)
    # Entries discovery only listed (never read), e.g. /sys/class/infiniband/X/device/net/<netdev>:
    # kept as empty directories so that listing the capture answers what listing the node did.
    for path, entries in rec.dirs.items():
        for name in entries:
            if name in (".", "..") or "/" in name:
                continue
            p = dest / _rel(path) / name
            if not p.exists():
                p.mkdir(parents=True, exist_ok=True)
    commands: dict[str, Any] = {}
    (dest / "commands").mkdir(parents=True, exist_ok=True)
    for argv, res in rec.commands.items():
        key = command_key(argv)
        commands[key] = {"argv": list(argv), "status": res.status, "rc": res.rc, "seconds": round(res.seconds, 4)}
        if res.status in ("ok", "failed"):
            text = res.stdout
            if tuple(argv) == SMI_XML:  # running processes (names, pids) are nobody's business: not kept
                text, n = _PROCESSES.subn("<processes>\n\t\t</processes>", text)
                if n:
                    commands[key]["scrubbed"] = "processes"
            data = text.encode()
            (dest / "commands" / key).write_bytes(data)
            files["commands/" + key] = len(data)
    if rec.package_versions is not None:
        p = dest / PACKAGES_FILE
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(rec.package_versions, indent=1, sort_keys=True) + "\n")
    if rec.gpu_api_data is not None:
        (dest / GPU_API_FILE).write_text(json.dumps(rec.gpu_api_data, indent=1, sort_keys=True) + "\n")
    manifest = {
        "format": CAPTURE_FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "moetune": facts.software.get("moetune", "none"),
        "fingerprint": facts.fingerprint,
        "discovery_seconds": facts.seconds,
        "commands": commands,
        "files": dict(sorted(files.items())),
    }
    (dest / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return dest


def capture_node(dest: Path | str, *, timeout_s: float = 1.5, source: Source | None = None) -> Path:
    """Discover this node (or `source`) and write everything discovery read under `dest`."""
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise CaptureWriteError(dest, "is a file, not a directory: give a new or empty directory for the capture")
    if dest.is_symlink() and not dest.exists():
        # refused as mkdir refused it: written beside its realpath, the capture went wherever the link pointed
        # (realpath reads a link the kernel's protected_symlinks would not let an open follow in a sticky /tmp)
        raise CaptureWriteError(dest, "is a link to nothing: give a new or empty directory for the capture")
    # a folder above DIR that is a link to nothing too: realpath went through it, making the folders it names
    dangling = next((p for p in dest.parents if p.is_symlink() and not p.exists()), None)
    if dangling is not None:
        raise CaptureWriteError(dest, f"is below {dangling}, a link to nothing: give a new or empty directory for "
                                "the capture")
    if dest.exists() and any(dest.iterdir()):
        raise CaptureWriteError(dest, "already exists and is not an empty directory")
    live = source if source is not None else LiveSource(timeout_s=timeout_s)
    rec = RecordingSource(live)
    try:
        facts = discover_from(rec)
    finally:
        if isinstance(live, LiveSource):
            live.close()
    try:
        _write_whole(rec, dest, facts)
    except OSError as e:
        failed = CaptureWriteError(dest, f"cannot write the capture: {e.strerror or e}")
        failed.errno = e.errno
        raise failed from None
    return dest


def _write_whole(rec: RecordingSource, dest: Path, facts: FabricFacts) -> None:
    """Write the capture into a new folder beside `dest` and rename it to `dest` (absent, or an empty folder, which
    rename(2) replaces) once whole: a kill mid-write leaves `dest` as it was, not a half-written capture that readers
    refuse and the next `fabric capture DIR` refused as "not an empty directory". An existing empty `dest` of
    another user's, one beside which no folder can be made (a parent this user may not write), or a mount point
    (which rename(2) does not replace) is written in place as before."""
    import secrets
    import shutil

    real = Path(os.path.realpath(dest))  # a link to an empty folder: the folder it names is replaced
    existing = os.stat(real) if real.is_dir() else None
    if existing is not None and existing.st_uid != os.getuid():
        _write_in_place(rec, real, facts)  # another user's folder (we may write in it): kept, not replaced by ours
        return
    real.parent.mkdir(parents=True, exist_ok=True)
    tmp = real.with_name(f".{real.name}.capture-{secrets.token_hex(4)}.partial")
    try:
        tmp.mkdir()  # mode as dest.mkdir gave it (the umask's); ours alone to remove
    except PermissionError:
        if existing is None:
            raise
        _write_in_place(rec, real, facts)
        return
    try:
        write_capture(rec, tmp, facts)
        if existing is not None:  # the user's folder as made: its mode (and group, where we may set it)
            os.chmod(tmp, stat.S_IMODE(existing.st_mode))
            with contextlib.suppress(OSError):
                os.chown(tmp, -1, existing.st_gid)
        try:
            os.rename(tmp, real)
        except OSError as e:
            # an empty file system mounted at `dest` (EBUSY; EXDEV on some): no rename replaces it, written in place
            if existing is None or e.errno not in (errno.EBUSY, errno.EXDEV):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            _write_in_place(rec, real, facts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_in_place(rec: RecordingSource, dest: Path, facts: FabricFacts) -> None:
    try:
        write_capture(rec, dest, facts)
    except BaseException:
        # Ctrl-C or a full disk mid-write: the half-written capture goes, so DIR is as it was, empty
        _remove_partial(rec, dest)
        raise


def _remove_partial(rec: RecordingSource, dest: Path) -> None:
    """Remove what `write_capture` may have written under `dest` (new, or empty before): only the top-level names a
    capture has, never anything else found there."""
    import shutil

    tops = {p.lstrip("/").split("/", 1)[0] for p in (*rec.files, *rec.dirs)} - {"", ".", ".."}
    tops |= {"commands", PACKAGES_FILE.split("/", 1)[0], GPU_API_FILE, MANIFEST_FILE}
    for name in tops:
        p = dest / name
        with contextlib.suppress(OSError):  # what cannot be removed stays; the error raised says what went wrong
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.is_symlink() or p.exists():
                p.unlink()
