"""The auto-load's cache keeps a profile it resolved for the whole process, but a FALLBACK (the policy or built-in
default, because the daemon or the hardware check briefly failed at job start) only for client.fallback_retry_s: a
later construction after that looks up again, so a job does not run on defaults for its life after a brief outage."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from moetune.runtime.config import ClientConfig, ConfigError, load_config
from moetune.runtime.knobs import Knobs
from moetune.runtime.profiles import autoload
from moetune.runtime.profiles.client import Resolution
from moetune.runtime.shapes import get_model

QWEN = get_model("qwen3-30b")


@pytest.fixture
def env(clean_autoload_env: dict[str, str]) -> dict[str, str]:
    return clean_autoload_env


def _answers(monkeypatch: pytest.MonkeyPatch, answers: list[str]) -> list[str]:
    """`_resolve` answers in turn: "down" (the chain ended in the policy default), "tuned" (the daemon's profile)."""
    calls: list[str] = []

    def fake_resolve(**kw: Any) -> Resolution:
        what = answers[min(len(calls), len(answers) - 1)]
        calls.append(what)
        if what == "down":
            k = Knobs()
            return Resolution(knobs=k, source="policy", profile_hash=f"policy:{k.digest()}", status="default",
                              family="collective", message="daemon: no reply")
        k = Knobs(pipeline_depth=4)
        return Resolution(knobs=k, source="daemon", profile_hash="tuned", status="current", family="collective",
                          provenance="measured", tuned=True)

    monkeypatch.setattr(autoload, "_resolve", fake_resolve)
    return calls


def _load() -> Resolution:
    return autoload.autoload_profile(model=QWEN, ep_size=1, nodes=1, max_tokens=64)


def test_a_fallback_is_looked_up_again_after_the_retry_interval(env: dict[str, str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "moetune.toml"
    cfg.write_text("[client]\nfallback_retry_s = 0.3\n")
    monkeypatch.setenv("MOETUNE_CONFIG", str(cfg))
    calls = _answers(monkeypatch, ["down", "tuned"])
    # autoload's clock, moved by hand: real sleeps let a loaded machine pass the interval between two calls
    now = [1000.0]
    monkeypatch.setattr(autoload, "time", SimpleNamespace(monotonic=lambda: now[0]))
    assert _load().source == "policy"
    now[0] += 0.29
    assert _load().source == "policy" and len(calls) == 1  # within the interval: the cached fallback
    now[0] += 0.06
    res = _load()
    assert res.source == "daemon" and res.profile_hash == "tuned" and len(calls) == 2  # the daemon is back
    now[0] += 3600
    assert _load().profile_hash == "tuned" and len(calls) == 2  # a tuned resolution is kept for the process


def test_a_resolved_profile_is_kept_for_the_process(env: dict[str, str], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "moetune.toml"
    cfg.write_text("[client]\nfallback_retry_s = 0\n")
    monkeypatch.setenv("MOETUNE_CONFIG", str(cfg))
    calls = _answers(monkeypatch, ["tuned", "down"])
    assert _load().source == "daemon"
    assert _load().source == "daemon" and len(calls) == 1


def test_the_retry_interval_is_a_typed_client_key(env: dict[str, str], tmp_path: Path) -> None:
    assert ClientConfig().fallback_retry_s == 30.0
    cfg = tmp_path / "moetune.toml"
    cfg.write_text("[client]\nfallback_retry_s = 5\n")
    assert load_config(cfg, env=env).client.fallback_retry_s == 5.0
    for bad, needle in (('"soon"', "a number"), ("-1", ">= 0")):
        cfg.write_text(f"[client]\nfallback_retry_s = {bad}\n")
        with pytest.raises(ConfigError, match=needle) as e:
            load_config(cfg, env=env)
        assert "client.fallback_retry_s" in str(e.value) and str(cfg) in str(e.value)
