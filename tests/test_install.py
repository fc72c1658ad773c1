"""The built wheel installs `moetune/...` only, with its data files, and works in a fresh virtualenv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# Source folder -> (installed package, suffixes that must ship).
DATA = {
    "migrations": ("moetune/migrations", {".py", ".mako"}),
    "policies": ("moetune/policies", {".toml"}),
    "csrc": ("moetune/csrc", {".cu", ".cuh", ".cpp", ".h"}),
    "tuner": ("moetune/tuner", {".toml", ".service"}),
}


def _source_files() -> list[str]:
    """Files of the working tree that a clean clone would have (tracked + untracked, not ignored)."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT, capture_output=True, check=True, timeout=60,
        ).stdout.decode()
        return [f for f in out.split("\0") if f and (ROOT / f).is_file()]
    skip = {".venv", ".git", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache"}
    return [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and not p.name.endswith(".egg-info")
    ]


def _clean_env() -> dict[str, str]:
    # the suite's MOETUNE_SYSTEM_CONFIG (tests/conftest.py) is kept: without it the CLI children read this machine's
    # /etc/moetune/moetune.toml
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "MOETUNE_")) or k == "MOETUNE_SYSTEM_CONFIG"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for rel in _source_files():
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest)
    out = tmp / "dist"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=180, env=_clean_env(), cwd=tmp,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("moetune-*.whl")
    return whl


def test_wheel_holds_moetune_only_with_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not n.startswith("moetune/") and ".dist-info/" not in n]
    assert outside == [], f"files outside moetune/: {outside[:10]}"
    assert all(n.split("/")[0] in ("moetune",) or n.split("/")[0].startswith("moetune-") for n in names)
    for required in (
        "moetune/tuner/__init__.py",
        "moetune/tuner/store/store.py",
        "moetune/tuner/store/models.py",
        "moetune/runtime/config.py",
        "moetune/tuner/fabric_model/presets/nvlink-h200x2.toml",
        "moetune/tuner/daemon/deploy/moetune.service",
        "moetune/tuner/cli/__init__.py",
        "moetune/runtime/__init__.py",
        "moetune/runtime/knobs.py",
        "moetune/migrations/env.py",
        "moetune/migrations/script.py.mako",
        "moetune/migrations/versions/0001_initial_schema.py",
        "moetune/migrations/versions/0002_measurement_run.py",
    ):
        assert required in names, f"{required} missing from {wheel.name}"
    # Every data file in the source folders ships (catches a package-data glob that misses a folder).
    files = _source_files()
    for folder, (pkg, suffixes) in DATA.items():
        for rel in files:
            p = Path(rel)
            if p.parts[0] == folder and p.suffix in suffixes:
                inst = "/".join((pkg, *p.parts[1:]))
                assert inst in names, f"{rel} is not in the wheel (expected {inst})"
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "moetune = moetune.tuner.cli._entry:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_fresh_venv_install(wheel, tmp_path):
    # The venv lies inside a git repository, as the README's `.venv` inside a clone does.
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    have_git = shutil.which("git") is not None
    if have_git:
        subprocess.run([*git, "init", "-q"], check=True, timeout=60, capture_output=True)
        subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True, timeout=60, capture_output=True)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    py = env_dir / "bin" / "python"
    env = _clean_env()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # Dependencies (torch, SQLAlchemy, ...) come from this interpreter's site-packages (purelib and platlib, which
    # differ where compiled packages live under lib64) and from PYTHONPATH folders that hold no moetune (where the
    # dependencies were installed with --target), appended after the fresh venv's own, so nothing is downloaded and
    # moetune is only the wheel's. Added after installing, so pip never sees them.
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    paths = sysconfig.get_paths()
    extra = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d and not (Path(d) / "moetune").exists()]
    deps = dict.fromkeys([paths["purelib"], paths["platlib"], *extra])
    (site / "_moetune_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=120, env=env, cwd=cwd)

    r = run(str(env_dir / "bin" / "moetune"), "--version")
    assert r.returncode == 0 and r.stdout.startswith("moetune "), r.stderr
    db = tmp_path / "fresh.db"  # a new file (a --db in a missing folder is refused)
    r = run(str(env_dir / "bin" / "moetune"), "db", "upgrade", "--db", str(db))
    assert r.returncode == 0 and "upgraded empty ->" in r.stdout, r.stdout + r.stderr
    r = run(str(env_dir / "bin" / "moetune"), "db", "check", "--db", str(db))
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(str(py), "-c", "import moetune.runtime, moetune.tuner, moetune.tuner.store.store as s; print(s.__file__); print(s.MIGRATIONS_DIR)")
    assert r.returncode == 0, r.stderr
    store_file, migrations = r.stdout.split()
    assert Path(store_file).is_relative_to(env_dir) and Path(migrations).is_relative_to(env_dir)
    for name in ("runtime", "tuner", "csrc", "policies", "migrations"):
        r = run(str(py), "-c", f"import {name}")
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, f"`import {name}` worked: {r.stdout}"

    # Named scenarios belong to a source checkout: installed, they are refused with a reason, exit 2, and nothing is
    # written into site-packages (summary.csv, BENCHMARKS.md).
    before = sorted(p.relative_to(site) for p in (site / "moetune").rglob("*") if "__pycache__" not in p.parts)
    for args in (["bench", "list"], ["bench", "run", "fabric-discovery", "--smoke"], ["bench", "summarize"]):
        r = run(str(env_dir / "bin" / "moetune"), *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "need a moetune source checkout" in " ".join(r.stderr.split()), (args, r.stderr)
    after = sorted(p.relative_to(site) for p in (site / "moetune").rglob("*") if "__pycache__" not in p.parts)
    assert after == before
    # Result stamps name no commit for installed code (not the commit of a repository around the venv).
    r = run(str(py), "-c", "from moetune.tuner.measure.scenarios import stamp; print(stamp.IN_CHECKOUT, repr(stamp._git('rev-parse', 'HEAD')))")
    assert r.returncode == 0 and r.stdout.split() == ["False", "''"], r.stdout + r.stderr


def test_readme_commands_parse_like_ci():
    """.ci/run runs the README's `$ TEST:` line; the README keeps exactly one `$ MAIN:` and one `$ TEST:`."""
    readme = (ROOT / "README.md").read_text()
    for tag in ("MAIN", "TEST"):
        lines = [ln for ln in readme.splitlines() if ln.startswith(f"    $ {tag}: ")]
        assert len(lines) == 1, f"README.md needs exactly one '    $ {tag}: ' line, found {len(lines)}"
    r = subprocess.run(
        ["sed", "-n", r"s/^    \$ TEST: //p", "README.md"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    cmd = r.stdout.strip()
    assert "pytest" in cmd and "pip install" in cmd and "\n" not in cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert r"s/^    \$ TEST: //p" in ci and '"$rc" -eq 5' in ci
