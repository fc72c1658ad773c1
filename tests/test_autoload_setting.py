"""client.autoload: whether a buffer or layer built without knobs looks up its tuned profile. A typed config key
([client] autoload) whose variable is MOETUNE_AUTOLOAD, parsed by the config's bool parser: a typo is an error naming
the variable (it was silently "on": anything but 0/off/false/no was)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.runtime.config import ConfigError, client_autoload, env_name, load_config, parse_bool
from moetune.runtime.profiles import autoload
from moetune.runtime.shapes import get_model


@pytest.fixture
def env(clean_autoload_env: dict[str, str]) -> dict[str, str]:
    return clean_autoload_env


def _config(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "moetune.toml"
    p.write_text(text)
    return p


def test_the_variable_is_the_keys_and_documented() -> None:
    from moetune.runtime.options import documented_variables, settings_markdown

    assert env_name("client", "autoload") == "MOETUNE_AUTOLOAD"
    assert "MOETUNE_AUTOLOAD" in documented_variables()
    assert "| `client.autoload` | true or false | `true` | `MOETUNE_AUTOLOAD` |" in settings_markdown()


@pytest.mark.parametrize(("raw", "want"), [("0", False), ("off", False), (" No ", False), ("false", False),
                                           ("1", True), ("on", True), ("YES", True), ("", True)])
def test_the_variable_parses_as_every_bool_variable(env: dict[str, str], raw: str, want: bool) -> None:
    on, where = client_autoload({**env, "MOETUNE_AUTOLOAD": raw})
    assert on is want and where == "environment variable MOETUNE_AUTOLOAD"


@pytest.mark.parametrize("raw", ["of", "0ff", "2", "disable"])
def test_a_typo_is_an_error_naming_the_variable(env: dict[str, str], raw: str) -> None:
    with pytest.raises(ConfigError, match=rf"client\.autoload in environment variable MOETUNE_AUTOLOAD: expected "
                                          rf"true or false, got '{raw}'"):
        client_autoload({**env, "MOETUNE_AUTOLOAD": raw})
    with pytest.raises(ConfigError, match="MOETUNE_AUTOLOAD"):
        load_config(env={**env, "MOETUNE_AUTOLOAD": raw})


@pytest.mark.parametrize("raw", ["0", "false"])
def test_the_rules_name_for_it_is_refused_not_ignored(env: dict[str, str], raw: str) -> None:
    """MOETUNE_CLIENT_AUTOLOAD is what the MOETUNE_<SECTION>_<KEY> rule names; it was ignored (autoload stayed on)."""
    bad = {**env, "MOETUNE_CLIENT_AUTOLOAD": raw}
    match = rf"MOETUNE_CLIENT_AUTOLOAD='{raw}' is not read: the variable of client\.autoload is MOETUNE_AUTOLOAD"
    with pytest.raises(ConfigError, match=match):
        client_autoload(bad)
    with pytest.raises(ConfigError, match=match):
        load_config(env=bad)
    assert client_autoload({**env, "MOETUNE_CLIENT_AUTOLOAD": " "}) == (True, "defaults")  # empty: unset


def test_the_config_key_and_the_variable_over_it(env: dict[str, str], tmp_path: Path) -> None:
    cfg = _config(tmp_path, "[client]\nautoload = false\n")
    assert client_autoload({**env, "MOETUNE_CONFIG": str(cfg)}) == (False, str(cfg))
    assert client_autoload({**env, "MOETUNE_CONFIG": str(cfg), "MOETUNE_AUTOLOAD": "1"})[0] is True
    assert client_autoload(env) == (True, "defaults")
    cfg.write_text('[client]\nautoload = "no"\n')  # TOML: a bool, not text
    with pytest.raises(ConfigError, match=rf"client\.autoload in {cfg}: expected true or false"):
        client_autoload({**env, "MOETUNE_CONFIG": str(cfg)})


def test_the_rest_of_the_config_is_not_its_to_judge(env: dict[str, str], tmp_path: Path) -> None:
    """A broken file or another key's bad value leaves autoload at what it can read (the profile client warns)."""
    cfg = _config(tmp_path, "[client\n")
    assert client_autoload({**env, "MOETUNE_CONFIG": str(cfg)}) == (True, "defaults")
    cfg.write_text("[client]\nautoload = false\n[tune]\ntrials = 0\n")
    assert client_autoload({**env, "MOETUNE_CONFIG": str(cfg)}) == (False, str(cfg))


def test_off_runs_the_policy_default_and_says_where(env: dict[str, str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(tmp_path, "[client]\nautoload = false\n")
    monkeypatch.setenv("MOETUNE_CONFIG", str(cfg))
    res = autoload.autoload_profile(model=get_model("custom:64,32,8,2,float32"), ep_size=1, nodes=1, max_tokens=8)
    assert res.status == "default" and res.message == f"client.autoload is false ({cfg})"
    autoload.clear_cache()
    monkeypatch.setenv("MOETUNE_AUTOLOAD", "maybe")
    with pytest.raises(ConfigError, match="MOETUNE_AUTOLOAD"):
        autoload.autoload_profile(model=get_model("custom:64,32,8,2,float32"), ep_size=1, nodes=1, max_tokens=8)
    with pytest.raises(ConfigError, match="MOETUNE_AUTOLOAD"):  # the group path too, before any collective
        autoload.autoload_group_profile(model=get_model("custom:64,32,8,2,float32"), ep_size=1, max_tokens=8)


def test_parse_bool_empty_is_the_callers_default() -> None:
    assert parse_bool("", "x", empty=True) is True and parse_bool(" ", "x") is False
    with pytest.raises(ConfigError, match=r"^x: expected true or false, got 'y'$"):
        parse_bool("y", "x")
