"""The runtime option `proxy_cpu` (where the proxy thread runs) and the CPU list syntax it takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.runtime.config import ConfigError, load_config
from moetune.runtime.options import MAX_CPU_INDEX, RuntimeOptionError, RuntimeOptions, parse_cpulist


def test_cpulist_parses_ranges_and_single_cpus() -> None:
    assert parse_cpulist("0-3,8-11") == (0, 1, 2, 3, 8, 9, 10, 11)
    assert parse_cpulist("5") == (5,)
    assert parse_cpulist("0-1,1,3\n") == (0, 1, 3)  # as sysfs writes it (a newline), each CPU once
    assert parse_cpulist(" 12 , 8-9 ") == (8, 9, 12)
    assert parse_cpulist("") == () and parse_cpulist("\n") == ()


@pytest.mark.parametrize("text", ["0-", "-1", "a", "1,,2", "1,", "3-1", "1-2-3", "0x3", "1 2", "1.5"])
def test_a_malformed_cpulist_is_a_clear_error(text: str) -> None:
    with pytest.raises(ValueError, match=r"CPU list") as e:
        parse_cpulist(text)
    assert repr(text) in str(e.value)  # names what it was given


def test_a_cpu_index_past_the_engines_limit_is_refused() -> None:
    assert parse_cpulist(str(MAX_CPU_INDEX)) == (MAX_CPU_INDEX,)
    with pytest.raises(ValueError, match=f"CPU {MAX_CPU_INDEX + 1} is past"):
        parse_cpulist(f"0-{MAX_CPU_INDEX + 1}")


def test_proxy_cpu_is_an_option_with_numa_by_default(tmp_path: Path) -> None:
    assert RuntimeOptions().proxy_cpu == "numa"
    for value in ("numa", "none", "0", "12", "8-15,40"):
        assert RuntimeOptions(proxy_cpu=value).proxy_cpu == value
    assert RuntimeOptions.from_env({"MOETUNE_PROXY_CPU": " None "}).proxy_cpu == "none"
    assert RuntimeOptions.from_env({"MOETUNE_PROXY_CPU": "3"}).proxy_cpu == "3"
    assert RuntimeOptions(proxy_cpu="numa").digest() != RuntimeOptions(proxy_cpu="none").digest()  # ranks agree on it
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    cfg = tmp_path / "moetune.toml"
    cfg.write_text('[runtime]\nproxy_cpu = "none"\n')
    assert RuntimeOptions.resolve(env={**env, "MOETUNE_CONFIG": str(cfg)}).proxy_cpu == "none"


@pytest.mark.parametrize("value", ["numa-ish", "", "3-1", "1,,2", "cpu5", 5, True, None, f"{MAX_CPU_INDEX + 1}"])
def test_a_bad_proxy_cpu_names_the_option_and_the_value(value: object) -> None:
    with pytest.raises(RuntimeOptionError, match=r"proxy_cpu \(MOETUNE_PROXY_CPU\)") as e:
        RuntimeOptions(proxy_cpu=value)
    assert repr(value) in str(e.value) and "numa" in str(e.value)


def test_a_bad_proxy_cpu_from_a_variable_or_the_config_says_where(tmp_path: Path) -> None:
    with pytest.raises(RuntimeOptionError, match=r"proxy_cpu.*'nearby'"):
        RuntimeOptions.from_env({"MOETUNE_PROXY_CPU": "nearby"})
    env = {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    cfg = tmp_path / "moetune.toml"
    cfg.write_text('[runtime]\nproxy_cpu = "far"\n')
    with pytest.raises(RuntimeOptionError, match=rf"proxy_cpu.*'far'.*{cfg.name}"):
        RuntimeOptions.resolve(env={**env, "MOETUNE_CONFIG": str(cfg)})
    cfg.write_text("[runtime]\nproxy_cpu = 12\n")  # TOML: a string, as every CPU list
    with pytest.raises(ConfigError, match=r"runtime\.proxy_cpu.*expected a string"):
        load_config(env={**env, "MOETUNE_CONFIG": str(cfg)})
