"""Ctrl-C in a command's first milliseconds: start it, send SIGINT after d ms (d evenly over 1..--max-ms), count
how each start ended: its exit status, and where a traceback (if any) was raised.

A probe, not a benchmark (bench/tools/README.md). The CLI's rule is one line and exit 130 on Ctrl-C, never a
traceback; what runs before moetune's first statement (the interpreter's start, site and the environment's .pth
files, the console script's own `import re`) cannot follow it, and is counted apart from moetune's code:

    python bench/tools/ctrl_c_at_start.py [--tries 40] [--max-ms 40] -- moetune --help
    python bench/tools/ctrl_c_at_start.py -- python -m moetune.tuner.cli._entry --help
"""

from __future__ import annotations

import argparse
import collections
import signal
import subprocess
import time

BEFORE_THE_COMMAND = "interrupted: before the command started; nothing was done"


def ending(rc: int, err: str, script: str) -> str:
    """The exit status and where the traceback on stderr was raised (moetune's code, the script's lines, the
    interpreter's start); `script`: the file the command runs ("" for `python -m`)."""
    if "Traceback" not in err:
        text = err.strip()
        if not text:
            return f"rc={rc} nothing on stderr"
        return f"rc={rc} " + ("the one line" if text == BEFORE_THE_COMMAND else f"no traceback: {text[:60]!r}")
    lines = err.splitlines()
    frames = [ln.strip() for ln in lines if ln.strip().startswith("File ")]
    if any("/moetune/" in f for f in frames):
        return f"rc={rc} traceback in moetune's code"
    if script and any(f.startswith(f'File "{script}"') for f in frames):
        i = max(i for i, ln in enumerate(lines) if ln.strip().startswith(f'File "{script}"'))
        statement = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if statement.startswith(("from moetune", "import moetune")):
            return f"rc={rc} traceback in the script's import of moetune, before any moetune code"
        return f"rc={rc} traceback in the script's own lines ({statement[:30]!r})"
    if "<frozen runpy>" in err:
        return f"rc={rc} traceback in runpy (python -m), before any moetune code"
    return f"rc={rc} traceback in the interpreter's start (init, site, .pth files)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=40)
    ap.add_argument("--max-ms", type=float, default=40.0)
    ap.add_argument("command", nargs="+", help="the command to start (after --)")
    a = ap.parse_args()
    script = "" if "-m" in a.command else a.command[0]
    counts: collections.Counter[str] = collections.Counter()
    for i in range(a.tries):
        delay_ms = 1 + (a.max_ms - 1) * i / max(a.tries - 1, 1)
        p = subprocess.Popen(a.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(delay_ms / 1000)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        counts[ending(p.returncode, err.decode(errors="replace"), script)] += 1
    for what, n in sorted(counts.items()):
        print(f"{n:4d}  {what}")


if __name__ == "__main__":
    main()
