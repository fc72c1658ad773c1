"""The auto-load's cache keeps a profile it resolved for the whole process, but a FALLBACK (the policy or built-in
default, because the daemon or the hardware check briefly failed at job start) only for client.fallback_retry_s: a
later construction after that looks up again, so a job does not run on defaults for its life after a brief outage."""

from __future__ import annotations

import os
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


def _answers(monkeypatch: pytest.MonkeyPatch, answers: list[str],
             envs: dict[str, dict[str, str]] | None = None) -> list[str]:
    """`_resolve` answers in turn: "down" (the chain ended in the policy default), "tuned" (the daemon's profile);
    `envs`: the env each answer's resolution carries (none by default)."""
    calls: list[str] = []
    envs = envs or {}

    def fake_resolve(**kw: Any) -> Resolution:
        what = answers[min(len(calls), len(answers) - 1)]
        calls.append(what)
        if what == "down":
            k = Knobs()
            return Resolution(knobs=k, source="policy", profile_hash=f"policy:{k.digest()}", status="default",
                              family="collective", message="daemon: no reply", env=dict(envs.get(what, {})))
        k = Knobs(pipeline_depth=4)
        return Resolution(knobs=k, source="daemon", profile_hash="tuned", status="current", family="collective",
                          provenance="measured", tuned=True, env=dict(envs.get(what, {})))

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


# launcher_env's variables: the fallback (a proxy:ibrc policy default) exports both, the tuned profile one of them
RT, IBGDA = "NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA"
ENVS = {"down": {RT: "ibrc", IBGDA: "0"}, "tuned": {RT: "ucx"}}


@pytest.fixture
def retry_every_time(env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fallback_retry_s = 0 (every construction looks up again); RT and IBGDA unset, and put back after the test."""
    cfg = tmp_path / "moetune.toml"
    cfg.write_text("[client]\nfallback_retry_s = 0\n")
    monkeypatch.setenv("MOETUNE_CONFIG", str(cfg))
    for k in (RT, IBGDA):
        monkeypatch.setenv(k, "")  # recorded, so the test's exports are undone whatever it leaves
        monkeypatch.delenv(k)


def test_a_retry_replaces_the_environment_its_fallback_exported(retry_every_time: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback's exports looked user-set to the retry's apply ("values already set win"): the tuned profile's
    NVSHMEM_REMOTE_TRANSPORT was not applied and the fallback's NVSHMEM_IB_ENABLE_IBGDA stayed."""
    calls = _answers(monkeypatch, ["down", "tuned"], ENVS)
    assert _load().source == "policy"
    assert os.environ.get(RT) == "ibrc"
    assert _load().source == "daemon" and len(calls) == 2
    assert os.environ.get(RT) == "ucx"  # the profile's value replaces the fallback's
    assert _load().source == "daemon" and os.environ.get(RT) == "ucx"  # a cache hit keeps it


def test_a_variable_only_the_fallback_set_is_unset_again_after_the_retry(retry_every_time: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    _answers(monkeypatch, ["down", "tuned"], ENVS)
    _load()
    assert os.environ.get(IBGDA) == "0"
    assert _load().source == "daemon"
    assert IBGDA not in os.environ  # the profile does not set it: as it was before the fallback (unset)


def test_a_variable_the_user_set_wins_over_the_fallback_and_the_profile(retry_every_time: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard of the fix's scope (unfixed code passes it; a fix exporting the profile's values over everything
    fails it): what the user set, before autoload or since, is never replaced or unset."""
    _answers(monkeypatch, ["down", "tuned"], ENVS)
    monkeypatch.setenv(RT, "libfabric")  # before autoload
    _load()
    assert os.environ[RT] == "libfabric" and os.environ.get(IBGDA) == "0"
    monkeypatch.setenv(IBGDA, "1")  # since autoload exported it: the user's now
    assert _load().source == "daemon"
    assert os.environ[RT] == "libfabric" and os.environ[IBGDA] == "1"


def test_a_variable_changed_since_the_fallback_exported_it_is_the_users(retry_every_time: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """As above: the value autoload set is remembered, so a change since is the user's (not replaced by the retry)."""
    _answers(monkeypatch, ["down", "tuned"], ENVS)
    _load()
    monkeypatch.setenv(RT, "none")
    _load()
    assert os.environ[RT] == "none"


def test_override_sets_a_variable_autoload_exported(retry_every_time: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """apply_env(override=True) sets its variables over what is set: one autoload exported itself was skipped as
    "autoload's, settled" and kept its value, the call returning {} without a word. Set that way it is the caller's,
    so a later retry of the lookup leaves it alone."""
    from moetune.runtime.profiles.launcher_env import apply_env

    _answers(monkeypatch, ["down", "tuned"], ENVS)
    _load()
    assert os.environ.get(RT) == "ibrc"
    assert apply_env({RT: "ucx"}, override=True) == {RT: "ucx"} and os.environ[RT] == "ucx"
    assert apply_env({IBGDA: "1"}, override=True) == {IBGDA: "1"}
    assert _load().source == "daemon"  # the retry's profile sets RT=ucx only: IBGDA stays the caller's
    assert os.environ[RT] == "ucx" and os.environ[IBGDA] == "1"


def test_another_lookups_profile_does_not_take_away_what_a_fallback_exported(retry_every_time: None,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard of the fix's scope (passes without it too): only the same lookup's retry replaces a fallback's
    variables; another layer's profile (a megakernel's, which sets none) must not unset what this buffer needs."""
    _answers(monkeypatch, ["down", "tuned"], {"down": ENVS["down"], "tuned": {}})
    _load()
    res = autoload.autoload_profile(model=QWEN, ep_size=1, nodes=1, max_tokens=4096)  # another key
    assert res.source == "daemon"
    assert os.environ.get(RT) == "ibrc" and os.environ.get(IBGDA) == "0"


def test_a_group_retry_replaces_the_fallback_s_environment_whatever_dtype_spelling(
        retry_every_time: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An EP group's lookup (rank 0 of one host: no real collective, monkeypatched) with dtype=None, then the same
    lookup naming the model's own dtype (an EP buffer passes its torch dtype, autoload_knobs the caller's None): one
    lookup, as autoload_profile keys it. Its exports were owned by two keys (None vs "bfloat16"), so the fallback's
    stayed wanted and the retry's profile did not replace them."""
    import torch.distributed as dist

    _answers(monkeypatch, ["down", "tuned"], ENVS)
    monkeypatch.setattr(autoload, "_dist_on", lambda group=None: True)
    monkeypatch.setattr(autoload, "_gather_states", lambda state, group, device: [state, state])  # one host
    monkeypatch.setattr(autoload, "_group_device", lambda group: "cpu")
    monkeypatch.setattr(autoload, "_broadcast_bytes", lambda data, group, device: data)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def load(dtype: Any) -> Resolution:
        return autoload.autoload_group_profile(model=QWEN, ep_size=2, max_tokens=64, dtype=dtype)

    assert load(None).source == "policy" and os.environ.get(RT) == "ibrc"
    assert QWEN.dtype == "bfloat16"
    assert load("bfloat16").source == "daemon"
    assert os.environ.get(RT) == "ucx" and IBGDA not in os.environ
    import torch

    assert load(torch.bfloat16).source == "daemon" and os.environ.get(RT) == "ucx"  # a torch dtype: the same lookup


def test_a_rank_s_failure_travels_to_the_group_bounded_in_size(
        env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose MOETUNE_AUTOLOAD is 100 KB of junk tells the others its ConfigError at the host gather: the text
    that travels (and every rank's gather is padded to the longest) is cut to FAILURE_TEXT_MAX, the cut said, and the
    error every rank raises still names the variable."""
    import torch.distributed as dist

    sent: list[str] = []

    def gather(state: Any, group: Any, device: Any) -> list[Any]:
        sent.append(state.error)
        return [state, state]  # one host, both ranks failed alike

    monkeypatch.setattr(autoload, "_dist_on", lambda group=None: True)
    monkeypatch.setattr(autoload, "_gather_states", gather)
    monkeypatch.setattr(autoload, "_group_device", lambda group: "cpu")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setenv("MOETUNE_AUTOLOAD", "x" * 100_000)
    with pytest.raises(ConfigError, match="MOETUNE_AUTOLOAD") as got:
        autoload.autoload_group_profile(model=QWEN, ep_size=2, max_tokens=64)
    assert len(sent) == 1 and len(sent[0]) <= autoload.FAILURE_TEXT_MAX + 200
    assert "more characters cut" in sent[0] and str(got.value) == sent[0]


def test_a_rank_s_failure_naming_a_non_utf8_path_still_travels(
        env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A ConfigError naming a config file whose name has a byte that is not UTF-8 (Python holds it as a lone
    surrogate) could not be encoded as the JSON that travels: that rank raised UnicodeEncodeError before the gather
    and the others waited in it for the process group's timeout. The real encoding runs here (only the collective is
    faked): every rank raises the ConfigError, the byte escaped."""
    import torch.distributed as dist

    name = os.fsdecode(bytes(tmp_path) + b"/moetune-\xff.toml")
    with open(os.fsencode(name), "w") as f:
        f.write('[client]\nautoload = "maybe"\n')
    sent: list[str] = []

    def gather(text: str, group: Any, device: Any) -> list[str]:
        sent.append(text)
        return [text, text]  # one host, both ranks failed alike

    monkeypatch.setattr(autoload, "_dist_on", lambda group=None: True)
    monkeypatch.setattr(autoload, "_all_gather_text", gather)
    monkeypatch.setattr(autoload, "_group_device", lambda group: "cpu")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setenv("MOETUNE_CONFIG", name)
    with pytest.raises(ConfigError, match=r"moetune-\\udcff\.toml") as got:
        autoload.autoload_group_profile(model=QWEN, ep_size=2, max_tokens=64)
    assert len(sent) == 1 and "failed on rank 1" in str(got.value)
