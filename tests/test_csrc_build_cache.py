"""The build cache both compiled libraries share (csrc_build.build_cached): a cached library, or a build folder,
that another user owns or can write is refused before anything is loaded from it, and a failed or timed-out nvcc
leaves no temporary output behind. A stand-in nvcc (a shell script) builds here, on the CPU box."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from moetune.runtime import csrc_build
from moetune.runtime.megakernel import _lib as mk_lib

_FAKE_NVCC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 12.4, V12.4.0"; exit 0; fi
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
case "$FAKE_NVCC" in
  fail) printf partial > "$out"; echo "error: boom" >&2; exit 2 ;;
  hang) printf partial > "$out"; exec sleep 30 ;;
  *) printf 'not really a library' > "$out" ;;
esac
"""


def _csrc() -> Path:
    return csrc_build.build().path


def _mk() -> Path:
    return mk_lib.build()


LOADERS: dict[str, Callable[[], Path]] = {"csrc": _csrc, "megakernel": _mk}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """MOETUNE_CACHE in tmp_path, the stand-in nvcc, a fixed arch (no torch.cuda probe)."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(_FAKE_NVCC)
    nvcc.chmod(0o755)
    monkeypatch.setenv("MOETUNE_NVCC", str(nvcc))
    monkeypatch.setenv("MOETUNE_CUDA_ARCH", "90")
    monkeypatch.setenv("MOETUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FAKE_NVCC", raising=False)
    return tmp_path / "cache"


@pytest.mark.parametrize("which", LOADERS)
def test_builds_then_finds_its_own_cache(cache: Path, which: str) -> None:
    old = os.umask(0o002)  # a group-writable umask: the cache's own folders and library must still pass
    try:
        lib = LOADERS[which]()
    finally:
        os.umask(old)
    assert lib.read_bytes() == b"not really a library"
    for p in (lib, lib.parent, lib.parent.parent):
        assert not os.stat(p).st_mode & 0o022, p
    assert LOADERS[which]() == lib  # found in the cache
    if which == "csrc":
        assert not csrc_build.build().built


@pytest.mark.parametrize("which", LOADERS)
@pytest.mark.parametrize("what", ["lib", "key_dir", "build_root"])
def test_a_writable_cache_entry_is_refused(cache: Path, which: str, what: str) -> None:
    """The key is a predictable hash: with the cache group- or world-writable, another user could put a library
    at the path before this user builds, and it was dlopen-ed unchecked."""
    lib = LOADERS[which]()
    p = {"lib": lib, "key_dir": lib.parent, "build_root": lib.parent.parent}[what]
    p.chmod(stat.S_IMODE(os.stat(p).st_mode) | 0o002)
    with pytest.raises(csrc_build.BuildError) as e:
        LOADERS[which]()
    msg = str(e.value)
    assert str(p) in msg and "mode" in msg and f"{stat.S_IMODE(os.stat(p).st_mode):o}" in msg
    assert "group- or world-writable" in msg and "chmod go-w" in msg and "MOETUNE_CACHE" in msg


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("which", LOADERS)
def test_another_users_library_or_link_is_refused(cache: Path, which: str) -> None:
    lib = LOADERS[which]()
    os.chown(lib, 4242, -1)
    with pytest.raises(csrc_build.BuildError, match=rf"{lib} is owned by uid 4242 .*another user owns it"):
        LOADERS[which]()
    os.chown(lib, 0, -1)
    # another user's link where the library goes, to a file that passes (this user's): the link can be repointed
    real = lib.parent / "real.so"
    os.replace(lib, real)
    lib.symlink_to(real)
    os.lchown(lib, 4242, -1)
    with pytest.raises(csrc_build.BuildError, match="symbolic link owned by uid 4242"):
        LOADERS[which]()


@pytest.mark.parametrize("which", LOADERS)
@pytest.mark.parametrize("how", ["fail", "hang"])
def test_a_failed_build_removes_its_temporary_output(cache: Path, monkeypatch: pytest.MonkeyPatch, which: str,
                                                     how: str) -> None:
    """nvcc failing or timing out after it began writing its output left `.<lib>.<pid>.tmp` in the cache; only
    the file this build made goes (another build's temporary file beside it stays)."""
    lib = LOADERS[which]()  # makes the folders
    lib.unlink()
    other = lib.parent / f".{lib.name}.1.tmp"
    other.write_bytes(b"another build's")
    monkeypatch.setenv("FAKE_NVCC", how)
    monkeypatch.setattr(csrc_build, "_BUILD_TIMEOUT_S", 0.5)
    monkeypatch.setattr(mk_lib, "_BUILD_TIMEOUT_S", 0.5)
    with pytest.raises(csrc_build.BuildError, match="timed out" if how == "hang" else "nvcc failed"):
        LOADERS[which]()
    assert sorted(p.name for p in lib.parent.iterdir() if p.name.endswith(".tmp")) == [other.name]
    assert not lib.exists()


@pytest.mark.parametrize("which", LOADERS)
@pytest.mark.parametrize("var", csrc_build.NVCC_ENV_VARS)
def test_nvcc_environment_flags_get_a_build_of_their_own(cache: Path, monkeypatch: pytest.MonkeyPatch, which: str,
                                                         var: str) -> None:
    """nvcc adds NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS (and NVCC_CCBIN's compiler) to every command line: a build
    made under them (-G, a measurement -D switch) is not the plain build and is never loaded under its key."""
    monkeypatch.delenv(var, raising=False)
    plain = LOADERS[which]()
    monkeypatch.setenv(var, "-DMK_DEC_PROBE=16")
    other = LOADERS[which]()
    assert other.parent != plain.parent and other.exists()
    assert f"{var}=-DMK_DEC_PROBE=16" in (other.parent / "build.log").read_text()
    monkeypatch.delenv(var)
    assert LOADERS[which]() == plain  # the plain build's own entry again, not rebuilt


def test_the_megakernel_library_remembers_a_failed_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer of a model asks for the library (MoELayer's auto engine): after a failed build, later asks get the
    same error at once instead of another nvcc run each (up to its timeout, under the cache lock)."""
    calls: list[int] = []

    def failing_build() -> Path:
        calls.append(1)
        raise csrc_build.BuildError("nvcc failed (exit 2): boom")

    monkeypatch.delenv("MOETUNE_MK_LIB", raising=False)
    monkeypatch.setattr(mk_lib, "build", failing_build)
    monkeypatch.setattr(mk_lib, "_lib", None)
    monkeypatch.setattr(mk_lib, "_lib_error", None)
    for _ in range(3):
        with pytest.raises(csrc_build.BuildError, match="boom"):
            mk_lib.load()
    assert len(calls) == 1


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name an fd's file")
@pytest.mark.parametrize("which", LOADERS)
def test_the_library_is_on_disk_before_it_is_renamed_into_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     which: str) -> None:
    """nvcc's output was renamed into the cache unsynced: a power loss soon after could leave the cache's name on an
    empty or partial file, which every later run found there (`lib.exists()`), never rebuilt, and failed to load
    until the cache was removed by hand. The output is fsynced before the rename, the folder after it."""
    calls: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_replace(src: str | Path, dst: str | Path) -> None:
        calls.append(("replace", f"{os.fspath(src)} -> {os.fspath(dst)}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    lib = LOADERS[which]()
    at = [i for i, (what, arg) in enumerate(calls) if what == "replace" and arg.endswith(f" -> {lib}")]
    assert len(at) == 1, calls
    tmp = calls[at[0]][1].split(" -> ")[0]
    assert ("fsync", os.path.realpath(tmp)) in calls[:at[0]], calls  # the bytes, before the name
    assert ("fsync", os.path.realpath(lib.parent)) in calls[at[0]:], calls  # the name, after the rename


@pytest.mark.parametrize("err", [errno.EINVAL, errno.ENOTSUP])
@pytest.mark.parametrize("which", LOADERS)
def test_a_file_system_that_cannot_fsync_still_builds(cache: Path, monkeypatch: pytest.MonkeyPatch, which: str,
                                                      err: int) -> None:
    """fsync of the built library answered EINVAL/ENOTSUP (a file system that does not support it): the build failed
    with a bare OSError ('[Errno 22] Invalid argument', said as a library that cannot load, or not caught at all by
    the megakernel's loader). Not supported here is not a failure: the library is renamed into the cache."""
    def no_fsync(fd: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "fsync", no_fsync)
    lib = LOADERS[which]()
    assert lib.read_bytes() == b"not really a library"
    assert not [p for p in lib.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("which", LOADERS)
def test_an_fsync_that_fails_otherwise_fails_the_build(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                       which: str) -> None:
    """Another fsync error (EIO: the bytes may not be on disk) still fails the build, leaving no library in the
    cache."""
    def eio(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fsync", eio)
    with pytest.raises(OSError):
        LOADERS[which]()
    assert not list(cache.rglob("*.so")) and not list(cache.rglob("*.tmp"))
