"""`TrackedProfile`: one key's profile kept current through the daemon's change notices (`ProfileClient.track`).

It judges every fetch as `ProfileClient.resolve` judges a reply (the same reply checks, node identity, allow_modelled,
transport, runtime options, env_mismatch), through the client's own judgement: it is the client's companion, not a
second implementation of its rules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moetune.runtime import wire
from moetune.runtime.options import RuntimeOptions
from moetune.runtime.profiles.daemon_info import read_daemon_info
from moetune.runtime.profiles.errors import BadReply, DaemonError, ProfileRefused
from moetune.runtime.profiles.perf_env import performance_environment
from moetune.runtime.profiles.replies import reply_problem
from moetune.runtime.shapes import get_model

if TYPE_CHECKING:  # the client makes a TrackedProfile (`track`): importing it here would be a cycle
    from moetune.runtime.profiles.client import ProfileClient

__all__ = ["TrackedProfile"]


class TrackedProfile:
    """One key's profile kept current: subscribe, snapshot, then apply newer changes (Clone pattern).

    `current` is only a profile `resolve` would apply (the same reply checks and judgement: node identity,
    allow_modelled, `transport_ok`, the data-path runtime options `options`, env_mismatch = refuse); `tuned` says
    whether it is applied as tuned (else it is MODELLED, allowed by allow_modelled). Otherwise `current` is None and
    `error` says why. `options`: the tracking job's RuntimeOptions (None: what the config and the client's `env`
    resolve at each fetch), as `resolve(options=...)` takes them."""

    def __init__(self, client: ProfileClient, query: dict[str, Any],
                 transport_ok: Callable[[str], str | None] | None = None, options: RuntimeOptions | None = None):
        if options is not None and not isinstance(options, RuntimeOptions):
            raise TypeError(f"TrackedProfile: options must be a RuntimeOptions or None, got {type(options).__name__}")
        self.client = client
        self.query = query
        self.transport_ok = transport_ok
        self.options = options  # every fetch is judged under these (a profile tuned under others is refused)
        self.current: wire.ProfileResult | None = None
        self.tuned = False
        self.error: DaemonError | BadReply | ProfileRefused | None = None
        self._lock = threading.Lock()
        self._due = False  # notices were taken off the socket but their fetch raised: the next refresh fetches
        client.subscribe()
        self._fetch()

    def _fetch(self) -> None:
        try:
            res = self.client.get_profile(**self.query)
            bad = reply_problem(res, **self._request())  # the checks `resolve` makes of the same reply
            if bad is not None:
                raise BadReply(bad)
            c = self.client  # its private judgement on purpose: the one rule, not a copy (module docstring)
            verdict, why, _, _ = c._judge_reply(res, read_daemon_info(c.endpoint, c._env), self.transport_ok,
                                                performance_environment(c._env).variables,
                                                time.monotonic() + c.timeout_ms / 1000, c._job_options(self.options))
            self.client.version = res.version  # the snapshot's version (a refused profile's too: it was read)
            self.client.restarted = False
            if verdict is None:
                raise ProfileRefused(f"daemon served profile {res.profile_hash}: {why}")
            # labelled as judged: a reply's "measured" claim of a modelling backend is not handed on as a measurement
            self.current, self.error, self.tuned = res.as_effective(), None, verdict == "tuned"
        except (DaemonError, BadReply, ProfileRefused) as e:
            # not found / stale / not an answer / not for this node: never keep serving a profile resolve would not
            self.current, self.error, self.tuned = None, e, False

    def _request(self) -> dict[str, Any]:
        """The query as `reply_problem` compares it (a model given by name is looked up)."""
        q = self.query
        model = q.get("model")
        if isinstance(model, str):
            try:
                model = get_model(model)
            except ValueError:  # a name only the daemon knows (it answered): its shape cannot be compared here
                model = None
        return {"model": model, "ep_size": q["ep_size"],
                "tokens": q["tokens"], "nodes": q.get("nodes", 1), "transport_family": q.get("transport_family")}

    def _drop_announced(self, changes: list[wire.Change]) -> None:
        """Drop `current` where a notice says it no longer holds: the node's fabric changed, or the daemon made it
        stale. Before the fetch, so that a fetch that raises (the daemon stopped answering) leaves no profile of a
        fabric the daemon has left current and tuned; a notice of a new profile leaves it (it holds until then)."""
        cur = self.current
        if cur is None:
            return
        for ch in changes:
            if ch.kind == "fabric_changed":
                why = f"this node's fabric changed ({str(ch.old_fingerprint)[:64]} -> {str(ch.fingerprint)[:64]})"
            elif ch.kind == "profile_stale" and cur.profile_hash in ch.profiles:
                why = f"profile {cur.profile_hash} was made stale"
            else:
                continue
            self.current, self.tuned = None, False
            self.error = ProfileRefused(f"the daemon announced that {why}: the profile held no longer holds here "
                                        "(not fetched again yet)")
            return

    def refresh(self, timeout_ms: int = 0) -> bool:
        """Apply pending changes; True when the profile (hash or presence) changed. When the fetch raises
        (DaemonUnavailable: the daemon stopped answering after its notice) the change stays pending: the next
        refresh fetches again even with no new notice; a profile a pending notice said no longer holds (a fabric change,
        made stale) is dropped meanwhile (`_drop_announced`)."""
        with self._lock:
            changes = self.client.poll_changes(timeout_ms)
            if not changes and not self.client.restarted and not self._due:
                return False
            before = self.current.profile_hash if self.current else None
            self._due = True
            self._drop_announced(changes)
            self._fetch()
            self._due = False
            # only the fetched daemon's own changes count: a restarted daemon's versions start again (an old
            # daemon's v101 in the same batch would hide the new one's v2..v101)
            newest = max((c.version for c in changes if c.epoch == self.client.epoch), default=0)
            self.client.version = max(self.client.version, newest)
            after = self.current.profile_hash if self.current else None
            return before != after
