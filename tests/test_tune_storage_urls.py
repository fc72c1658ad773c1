"""SQLite --storage URLs that tune cannot keep, or could misread: an in-memory storage (`sqlite:///:memory:`,
`sqlite://`, whose studies would vanish at exit) is refused (exit 2, before anything is made), and a query string
(`sqlite:///D/optuna.db?mode=rw`, not to be read as part of the file name) is refused by name."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app
from moetune.tuner.search.storage import StorageRefused, is_memory, make_storage, sqlite_path

pytestmark = pytest.mark.timeout(240)
TUNE = ["tune", "-m", "qwen3-30b", "--preset", "nvlink-h200x2", "--trials", "2", "--tokens", "128"]


def _run(tmp_path: Path, *args: str):
    return CliRunner().invoke(app, list(args), env={"MOETUNE_HOME": str(tmp_path / "home"), "COLUMNS": "300"})


@pytest.mark.parametrize("url", ["sqlite:///:memory:", "sqlite://", "sqlite:///file.db?mode=memory&cache=shared"])
def test_tune_refuses_an_in_memory_storage(tmp_path: Path, url: str) -> None:
    r = _run(tmp_path, *TUNE, "--db", str(tmp_path / "m.db"), "--storage", url)
    assert r.exit_code == 2, r.output
    line = " ".join(r.stderr.split())
    assert f"--storage {url}: an in-memory database: the studies would be lost when moetune exits" in line, r.stderr
    assert not (tmp_path / "m.db").exists() and not (tmp_path / "file.db").exists()
    r = _run(tmp_path, "tune", "show", "--storage", url)
    assert r.exit_code == 2 and "an in-memory database" in r.stderr, r.output


def test_a_query_string_is_refused_by_name(tmp_path: Path) -> None:
    studies = tmp_path / "optuna.db"
    assert _run(tmp_path, *TUNE, "--db", str(tmp_path / "m.db"), "--storage", f"sqlite:///{studies}").exit_code == 0
    url = f"sqlite:///{studies}?mode=rw"
    r = _run(tmp_path, "tune", "show", "--storage", url)
    assert r.exit_code == 2, r.output
    line = " ".join(r.stderr.split())
    assert "query parameters (mode=rw) are not taken" in line and f"give sqlite:///{studies}" in line, r.stderr
    assert "does not exist" not in line
    r = _run(tmp_path, *TUNE, "--db", str(tmp_path / "m2.db"), "--storage", url)
    assert r.exit_code == 2 and "query parameters (mode=rw)" in r.stderr, r.output
    assert not (tmp_path / "m2.db").exists()
    missing = tmp_path / "none.db"
    r = _run(tmp_path, "tune", "show", "--storage", f"sqlite:///{missing}?mode=ro")
    assert r.exit_code == 2 and "query parameters (mode=ro)" in r.stderr, r.output


def test_url_helpers(tmp_path: Path) -> None:
    assert sqlite_path("sqlite:////d/o.db?mode=rw") == Path("/d/o.db")
    assert is_memory("sqlite://") and is_memory("sqlite:///:memory:") and not is_memory(f"sqlite:///{tmp_path}/x.db")
    assert not is_memory("postgresql://u@h/db")
    with pytest.raises(StorageRefused, match="query parameters"):
        make_storage(f"sqlite:///{tmp_path / 'x.db'}?timeout=5")
    assert not (tmp_path / "x.db").exists()


def test_the_default_studies_file_is_beside_the_configured_database(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """default_storage_url(None) asks the config (and runtime/paths.py for its default): $XDG_DATA_HOME is honoured
    (its own copy of the rule went to ~/.local/share), and a broken config is an error, not another folder."""
    from moetune.runtime.config import ConfigError
    from moetune.tuner.search.storage import default_storage_url

    for var in ("MOETUNE_HOME", "MOETUNE_CONFIG", "MOETUNE_STORE_DB"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    assert default_storage_url() == f"sqlite:///{tmp_path / 'xdg-data' / 'moetune' / 'moetune-studies.db'}"
    cfg = tmp_path / "moetune.toml"
    cfg.write_text(f'[store]\ndb = "{tmp_path / "d" / "p.db"}"\n')
    monkeypatch.setenv("MOETUNE_CONFIG", str(cfg))
    assert default_storage_url() == f"sqlite:///{tmp_path / 'd' / 'p-studies.db'}"
    cfg.write_text("[store]\ndb = 5\n")
    with pytest.raises(ConfigError, match=rf"store\.db in {cfg}: expected a string"):
        default_storage_url()


@pytest.mark.parametrize("secret", ["password=s3cret", "sslpassword=s3cret"])
def test_a_password_in_a_server_urls_query_is_not_printed(tmp_path: Path, secret: str) -> None:
    """`postgresql://h/db?user=u&password=...` is a libpq URL as `u:password@h` is: the unreachable server's error
    printed the URL with its password (only the `user:password@` form was redacted)."""
    url = f"postgresql://127.0.0.1:1/db?user=bob&{secret}&connect_timeout=5"
    r = _run(tmp_path, *TUNE, "--db", str(tmp_path / "m.db"), "--storage", url)
    assert r.exit_code == 2, r.output
    assert "cannot open the study storage" in r.stderr and "s3cret" not in r.output, r.output
    assert f"{secret.split('=')[0]}=***" in r.stderr, r.stderr
    r = _run(tmp_path, "tune", "show", "--storage", url)
    assert r.exit_code == 2 and "s3cret" not in r.output, r.output


def test_a_sqlite_path_with_an_at_sign_is_named_as_it_is(tmp_path: Path) -> None:
    """A SQLite URL holds no password: its path was cut at an `@` as if it were `user:password@host`
    (`sqlite:////d/u@h/s.db` said and recorded as `sqlite:////d/u:***@h/s.db`, a file that does not exist)."""
    from moetune.tuner.store.store import Store

    folder = tmp_path / "u@h"
    folder.mkdir()
    url = f"sqlite:///{folder / 'none' / 's.db'}"
    r = _run(tmp_path, *TUNE, "--db", str(tmp_path / "m.db"), "--storage", url)
    assert r.exit_code == 2, r.output
    assert f"--storage {url}:" in " ".join(r.stderr.split()), r.stderr
    url = f"sqlite:///{folder / 's.db'}"
    assert _run(tmp_path, *TUNE, "--db", str(tmp_path / "m.db"), "--storage", url).exit_code == 0
    with Store(tmp_path / "m.db", readonly=True) as s:
        assert {r["storage"] for r in s.list_runs()} == {url}


@pytest.mark.parametrize("url", ["postgresql:/bob:s3cret@h/db", "postgresql//bob:s3cret@h", "postgresql:bob:s3cret@h/db",
                                 "bob:s3cret@h/db"])
def test_a_mistyped_server_url_is_not_echoed_with_its_password(tmp_path: Path, url: str) -> None:
    """A server URL mistyped without `://` was said as it was given ('not a storage URL', and as a SQLite path built
    from it): its password reached the terminal and the logs. It goes through the one redaction (`redact_url`)."""
    from moetune.tuner.search.storage import redact_url

    shown = "postgresql:***@h" if url.startswith("postgresql:bob") else "bob:***@h"  # `scheme:` may be a user
    assert "s3cret" not in redact_url(url) and shown in redact_url(url)
    for args in ([*TUNE, "--db", str(tmp_path / "m.db"), "--storage", url], ["tune", "show", "--storage", url]):
        r = _run(tmp_path, *args)
        assert r.exit_code == 2, r.output
        assert "not a storage URL" in r.stderr and shown in r.stderr, r.stderr
        assert "s3cret" not in r.output, r.output
    assert not (tmp_path / "m.db").exists()


def test_a_plain_path_with_an_at_sign_is_not_taken_for_a_password() -> None:
    """Only a `user:password@` shape is redacted in text without `://`: a file path's `@` is kept as it is."""
    from moetune.tuner.search.storage import redact_url

    assert redact_url("/data/u@h/s.db") == "/data/u@h/s.db"
    assert redact_url("postgresql://u:pw@h/db") == "postgresql://u:***@h/db"
    assert redact_url("postgresql://u@h/db") == "postgresql://u:***@h/db"  # as before
    # a password holding ':' or '/' is masked whole
    assert redact_url("bob:pa:ss@h") == "bob:***@h" and redact_url("postgresql:/bob:pa/s:s@h") == "postgresql:/bob:***@h"


@pytest.mark.skipif(importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is None,
                    reason="no PostgreSQL driver (psycopg or psycopg2) is installed")
def test_a_server_that_never_answers_fails_within_the_connect_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A firewalled database host (its packets dropped) hung the tune ~2 minutes before the clear error, and a host
    that takes the connection but never answers (here: a listener that never accepts) forever: libpq has no connect
    timeout of its own. make_storage and the read-only opening give PostgreSQL one (storage.CONNECT_TIMEOUT_S,
    lowered here to keep the test short); a URL's connect_timeout (or $PGCONNECT_TIMEOUT) still wins."""
    import socket
    import threading
    import time

    from moetune.tuner.search import storage as storage_mod

    monkeypatch.setattr(storage_mod, "CONNECT_TIMEOUT_S", 1, raising=False)
    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nothing ever answers libpq's first message
        url = f"postgresql://bob:pw@127.0.0.1:{silent.getsockname()[1]}/db"

        def took(open_: Any, u: str) -> float | None:
            """Seconds until open_(u) failed, or None while it still hangs after 20 s (it is left to the socket's
            close)."""
            out: list[float] = []

            def go() -> None:
                t0 = time.monotonic()
                with contextlib.suppress(Exception):
                    open_(u)
                out.append(time.monotonic() - t0)

            threading.Thread(target=go, daemon=True).start()
            for _ in range(200):
                if out:
                    return out[0]
                time.sleep(0.1)
            return None

        for open_ in (storage_mod.make_storage, storage_mod.open_readonly_storage):
            t = took(open_, url)
            assert t is not None and t < 10, (open_.__name__, t)  # was: no answer, ever
        monkeypatch.setattr(storage_mod, "CONNECT_TIMEOUT_S", 60)
        # libpq before 17 counts connect_timeout in whole seconds of time(): 2 may give up after anything over 1 s
        t = took(storage_mod.make_storage, url + "?connect_timeout=2")  # the URL's own
        assert t is not None and 0.9 < t < 10, t
        monkeypatch.setenv("PGCONNECT_TIMEOUT", "2")  # libpq's variable, as the URL's
        t = took(storage_mod.make_storage, url)
        assert t is not None and 0.9 < t < 10, t


def test_only_a_server_that_did_not_answer_is_said_to_have_stopped() -> None:
    """`server_lost` names a lost server (no SQLSTATE: no answer; 08: a connection exception; 57P: its shutdown), not
    an error the server answered with (a deadlock, a statement timeout), nor anything on a SQLite file."""
    import optuna
    from sqlalchemy.exc import OperationalError

    from moetune.tuner.cli.tune_storage import server_lost

    class Driver(Exception):
        def __init__(self, msg: str, sqlstate: str | None) -> None:
            super().__init__(msg)
            self.sqlstate = sqlstate

    def wrapped(sqlstate: str | None) -> BaseException:
        try:
            try:
                raise OperationalError("SELECT 1", {}, Driver("the driver's words", sqlstate))
            except OperationalError as e:
                raise optuna.exceptions.StorageInternalError("invalid data in the commit") from e
        except optuna.exceptions.StorageInternalError as e:
            return e

    url = "postgresql://bob:s3cret@h/db"
    for code in (None, "08006", "57P01"):
        said = server_lost(url, wrapped(code))
        assert said is not None and "the storage server stopped answering" in said and "s3cret" not in said, said
    for code in ("40P01", "57014"):
        assert server_lost(url, wrapped(code)) is None
    assert server_lost("sqlite:////d/s.db", wrapped(None)) is None


@pytest.mark.parametrize("sqlalchemy_default", ["psycopg2", "psycopg"])  # SQLAlchemy 2.0's, 2.1's
@pytest.mark.parametrize("installed", [("psycopg",), ("psycopg2",), ("psycopg", "psycopg2")])
def test_a_postgres_url_names_an_installed_driver(monkeypatch: pytest.MonkeyPatch, installed: tuple[str, ...],
                                                  sqlalchemy_default: str) -> None:
    """`postgres://` (many a provider's spelling) is not a SQLAlchemy dialect name since 1.4: it was rewritten only
    where psycopg 3 stands alone, so beside psycopg2 it failed "Can't load plugin: sqlalchemy.dialects:postgres".
    And `postgresql://` was rewritten for psycopg 3 only where psycopg2 is absent, as if SQLAlchemy's default driver
    were always psycopg2: from 2.1 it is psycopg, so a psycopg2-only install failed "No module named 'psycopg'".
    Either spelling now names a driver that is installed, SQLAlchemy's default where both are."""
    import importlib.util as iu

    import sqlalchemy
    from sqlalchemy.dialects.postgresql import base, psycopg, psycopg2

    from moetune.tuner.search.storage import normalize_url

    monkeypatch.setattr(base, "dialect", {"psycopg": psycopg, "psycopg2": psycopg2}[sqlalchemy_default].dialect)
    find_spec = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: (find_spec("json") if name in installed else None)
                        if name in ("psycopg", "psycopg2") else find_spec(name, *a))
    assert sqlalchemy.engine.make_url("postgresql://h/db").get_driver_name() == sqlalchemy_default
    for given in ("postgres://bob:pw@h/db", "postgresql://bob:pw@h/db"):
        url = sqlalchemy.engine.make_url(normalize_url(given))
        url.get_dialect()  # was (postgres:// beside psycopg2): NoSuchModuleError
        driver = url.get_driver_name()
        assert url.get_backend_name() == "postgresql" and driver in installed, (given, url)  # was: psycopg, absent
        assert len(installed) == 1 or driver == sqlalchemy_default, (given, url)
        assert normalize_url(given).endswith("://bob:pw@h/db")
    assert normalize_url("postgresql+psycopg2://bob@h/db") == "postgresql+psycopg2://bob@h/db"  # a driver named: kept
    assert normalize_url("sqlite:////d/postgres://x.db") == "sqlite:////d/postgres://x.db"


@pytest.mark.parametrize("kw", ["password=s3cret", "sslpassword=s3cret", "password='s3 cret'", "password = 's3\\'cret'",
                                "PASSWORD=s3cret"])
def test_a_libpq_keyword_string_is_not_echoed_with_its_password(tmp_path: Path, kw: str) -> None:
    """A libpq keyword string given as --storage (`host=h user=u password=... dbname=x`, not a URL) was echoed whole
    in 'not a storage URL', and as the SQLite path built from it: its password reached the terminal."""
    from moetune.tuner.search.storage import redact_url

    url = f"host=db1 user=bob {kw} dbname=x"
    shown = redact_url(url)
    assert "s3" not in shown and "cret" not in shown and shown.startswith("host=db1 user=bob ")
    assert shown.endswith("*** dbname=x"), shown  # only the value goes; the keywords around it stay
    for args in ([*TUNE, "--db", str(tmp_path / "m.db"), "--storage", url], ["tune", "show", "--storage", url]):
        r = _run(tmp_path, *args)
        assert r.exit_code == 2, r.output
        assert "not a storage URL" in r.stderr and "s3" not in r.output and "cret" not in r.output, r.output
    assert redact_url("host=h user=u") == "host=h user=u"  # nothing secret: kept as it is
    assert redact_url("host=h password='unterminated dbname=x") == "host=h password=***"  # masked to the end
