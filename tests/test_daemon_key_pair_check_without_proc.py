"""`check_public_beside` compares the NAME.key beside the daemon's NAME.key_secret with the secret file's public key
(a `keys generate --force` cut short between its two renames left the old public key there, and every client given
it was refused by the CURVE handshake without a word). It reads NAME.key through /proc/self/fd; without /proc (a
chroot or sandbox) that read failed and the check passed silently. The daemon serves without /proc (it reads its own
keys by path), so the start goes on, but the skipped check is said: a warning naming the file and why."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from moetune.tuner.cli.keys import generate_keys
from moetune.tuner.daemon.auth import check_public_beside, load_curve_keys

pytestmark = pytest.mark.timeout(30)


def _no_proc(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if str(p).startswith("/proc/self/fd/") else real(p))


@pytest.mark.parametrize("same_pair", [True, False], ids=["pair", "torn-pair"])
def test_without_proc_the_skipped_pair_check_is_warned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture, same_pair: bool) -> None:
    public_file, secret_file = generate_keys(tmp_path / "keys")
    if not same_pair:
        other, _ = generate_keys(tmp_path / "other")
        public_file.write_bytes(other.read_bytes())
    public, _ = load_curve_keys(secret_file)
    _no_proc(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="moetune.daemon"):
        check_public_beside(secret_file, public)
    said = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert str(public_file) in said and "/proc" in said and "not checked" in said, said


def test_with_proc_a_matching_pair_says_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _public_file, secret_file = generate_keys(tmp_path / "keys")
    with caplog.at_level(logging.WARNING, logger="moetune.daemon"):
        check_public_beside(secret_file, load_curve_keys(secret_file)[0])
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
