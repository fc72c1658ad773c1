"""docs/architecture.md's map against the tree: every module of tuner/, runtime/ and policies/ is named in its
folder's entry, and every folder and `*.py` file the map names exists. A module added without a line there left
the map silently incomplete (tuner/cli/_torch_import.py was missing from it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tuner", "runtime", "policies")


def _sections() -> dict[str, str]:
    """Folder (`runtime/profiles/`) -> the map's text for it. A line whose first word ends in '/' opens a folder,
    nested by its indent; a line that starts further left than the open folders' column closes them."""
    block = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    sections: dict[str, list[str]] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m:
            continue
        indent, word = len(m.group(1)), m.group(2)
        if indent < 30:  # a word at the descriptions' column continues the folder above
            while stack and stack[-1][0] >= indent:
                stack.pop()
        if word.endswith("/") and indent < 30:
            path = (stack[-1][1] if stack else "") + word
            stack.append((indent, path))
            sections.setdefault(path, []).append(line[m.end(2):])
        elif stack:
            sections.setdefault(stack[-1][1], []).append(line)
    return {k: "\n".join(v) for k, v in sections.items()}


def test_every_module_is_in_the_map() -> None:
    sections = _sections()
    missing = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            if f.name == "__init__.py" or "__pycache__" in f.parts:
                continue
            folder = f.parent.relative_to(ROOT).as_posix() + "/"
            if not re.search(rf"(?<![\w.]){re.escape(f.stem)}(?!\w)", sections.get(folder, "")):
                missing.append(f.relative_to(ROOT).as_posix())
    assert not missing, f"docs/architecture.md's map does not name: {', '.join(missing)}"


def test_every_folder_and_file_the_map_names_exists() -> None:
    sections = _sections()
    gone = [folder for folder in sections if not (ROOT / folder).is_dir()]
    for folder, text in sections.items():
        gone += [folder + name for name in re.findall(r"(?<![\w/.`])(\w+\.py)\b", text) if not (ROOT / folder / name).is_file()]
    assert not gone, f"docs/architecture.md's map names what is not in the tree: {', '.join(gone)}"
