"""`python -m moetune.runtime.settings_doc > docs/settings.md`: the settings reference, generated from the code.

Its own module, not `python -m moetune.runtime.options`: importing `moetune.runtime` already imports `options`
(through `knobs`), so running that module as `__main__` loaded it twice and runpy warned about it on stderr."""

from __future__ import annotations

import sys

from moetune.runtime.options import settings_markdown

COMMAND = "python -m moetune.runtime.settings_doc > docs/settings.md"


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv):
        print(f"usage: {COMMAND} (takes no arguments)", file=sys.stderr)
        return 2
    sys.stdout.write(settings_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
