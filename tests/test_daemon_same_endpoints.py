"""socket == pub_socket was reported as "another daemon is listening" (exit 1): it is a configuration error (exit 2)
saying the two endpoints must differ."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from moetune.tuner.daemon import server


@pytest.mark.parametrize("pub", ["{run}/d.sock", "{run}/./d.sock", "{link}/d.sock", "{link}/../run/d.sock"])
def test_the_same_socket_and_pub_socket_is_a_configuration_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch, pub: str) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(run)  # the same directory by another name
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    cfg = tmp_path / "moetune.toml"
    cfg.write_text("")
    rc = server.main(["--config", str(cfg), "--db", str(tmp_path / "m.db"), "--socket", f"ipc://{run}/d.sock",
                      "--pub-socket", "ipc://" + pub.format(run=run, link=tmp_path / "link"), "--rediscover-interval", "0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "the two endpoints must differ" in err and "Traceback" not in err
    assert not (run / "d.sock").exists()
