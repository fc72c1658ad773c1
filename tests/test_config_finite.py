"""Every float setting must be a finite number: `[tune] timeout_s = nan` passed the `<= 0` check and every re-tune
then did nothing; inf is no number of seconds either. Refused from a file and from the environment, and `moetune
serve` exits 2 with the setting named (no traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.runtime.config import ConfigError, load_config


@pytest.mark.parametrize("section,key", [("tune", "timeout_s"), ("daemon", "rediscover_interval_s"),
                                         ("runtime", "onesided_timeout_s"), ("runtime", "megakernel_timeout_s")])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_float_in_a_file_is_refused(tmp_path: Path, section: str, key: str, value: str) -> None:
    from moetune.runtime.options import RuntimeOptions

    cfg = tmp_path / "moetune.toml"
    cfg.write_text(f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"{section}\.{key} in {cfg}: expected a finite number"):
        # the [runtime] table is checked by the options it sets (RuntimeOptions.from_config)
        RuntimeOptions.from_config(load_config(cfg, env={}))


@pytest.mark.parametrize("var,name", [("MOETUNE_TUNE_TIMEOUT_S", "tune.timeout_s"),
                                      ("MOETUNE_DAEMON_REDISCOVER_INTERVAL_S", "daemon.rediscover_interval_s")])
def test_a_non_finite_float_in_the_environment_is_refused(tmp_path: Path, var: str, name: str) -> None:
    cfg = tmp_path / "moetune.toml"
    cfg.write_text("")
    with pytest.raises(ConfigError, match=rf"{name} in environment variable {var}: expected a finite number"):
        load_config(cfg, env={var: "nan"})


def test_serve_exits_2_on_a_nan_timeout(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from moetune.tuner.daemon import server

    cfg = tmp_path / "moetune.toml"
    cfg.write_text("[tune]\ntimeout_s = nan\n")
    monkeypatch.setenv("MOETUNE_HOME", str(tmp_path / "home"))
    assert server.main(["--config", str(cfg), "--db", str(tmp_path / "m.db")]) == 2
    err = capsys.readouterr().err
    assert "tune.timeout_s" in err and "finite" in err and "Traceback" not in err
