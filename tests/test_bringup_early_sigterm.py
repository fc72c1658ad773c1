"""SIGTERM in the first seconds of `moetune profile` (its imports and the node's discovery, before any stage) ended
the process silently with -15, while a SIGTERM during the stages printed one line and exited 143. The early one now
says what it did (nothing measured or stored yet) and exits 143 too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CAPTURES = Path(__file__).parent / "captures"

# the child: discovery (Bringup's construction, before any stage) is where the SIGTERM lands
_CHILD = """
import os, signal, sys, time
from moetune.tuner.bringup import flow
from moetune.tuner.fabric import discovery
discovery.capture_not_this_node = lambda facts, capture: ""  # the capture stands for this node: it would measure
def slow_discovery(self, *a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)  # the signal ends it first
flow.Bringup.__init__ = slow_discovery
sys.argv[0] = "moetune"
from moetune.tuner.cli import main
main()
"""


def test_sigterm_before_any_stage_says_so_and_exits_143(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    p = subprocess.run([sys.executable, "-c", _CHILD, "profile", "--capture", str(CAPTURES / "h200x1"), "--db",
                        str(db)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "MOETUNE_HOME": str(tmp_path / "home"), "MOETUNE_CONFIG": "",
                            "COLUMNS": "1000"})
    said = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 143, (p.returncode, said)
    assert "terminated (SIGTERM)" in said and "nothing was measured or stored" in said, said
    assert "Traceback" not in said, said
    assert not db.exists()  # discovery comes before the database is opened
