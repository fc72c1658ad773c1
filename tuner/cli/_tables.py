"""Tables that fit the console without cutting a number: Rich's own layout cuts cells with `…` once a table is
wider than the console (80 columns in a pipe or a CI log: `698…` for 6987.4 µs, `curre…` for current).

Each column says what it holds (`Col.kind`):

* ``num``: a number, a date, an id: never wrapped, never cut (its header may wrap between words);
* ``word``: a status, a name: wrapped between words only, never inside one;
* ``text``: anything else: wrapped, and a word longer than the column folds onto the next line (never cut).

When even the narrowest such layout is wider than the console, the columns marked `drop` are left out, the highest
first, and the table's caption names them. Only when nothing can be left out is the table printed wider than the
console (never cut: `print_table` prints it uncropped).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

TEXT_MIN = 8  # the narrowest a text column is made (its header's longest word if longer)


@dataclass(frozen=True)
class Col:
    header: str
    kind: Literal["num", "word", "text"] = "text"
    justify: Literal["left", "right", "center"] | None = None  # default: right for num, else left
    drop: int = 0  # > 0: left out when the console is too narrow, the highest first
    style: str | None = None


# C0 (but the line break), DEL and C1: a value stored or served with them (a terminal escape) is shown, not obeyed
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x0A), *range(0x0B, 0x20), *range(0x7F, 0xA0))}


def visible(text: str) -> str:
    """`text` with its control characters written as \\xNN (a line break kept)."""
    return text.translate(_CONTROL)


def visible_markup(text: str) -> str:
    """`text` (a daemon's message, a stored value) inside a Rich markup string: its control characters shown as
    \\xNN (`visible`) and its brackets text, never markup."""
    from rich.markup import escape

    return escape(visible(text))


def _text(cell: RenderableType | None) -> Text:
    if isinstance(cell, Text):  # its spans index the raw text: one with control characters keeps its style only
        return cell if visible(cell.plain) == cell.plain else Text(visible(cell.plain), style=cell.style)
    return Text.from_markup(visible(str(cell if cell is not None else "")))


def _natural(cells: Iterable[Text]) -> int:
    return max((max((Text(line).cell_len for line in c.plain.splitlines()), default=0) for c in cells), default=0)


def _longest_word(cells: Iterable[Text]) -> int:
    return max((Text(w).cell_len for c in cells for w in c.plain.split()), default=0)


def _overhead(n: int, kw: dict[str, Any]) -> int:
    """Columns of the table not holding cell text: borders and padding (padding (0, 1) per cell)."""
    boxed = kw.get("box", True) is not None
    edge = kw.get("show_edge", True)
    borders = ((n - 1) + (2 if edge else 0)) if boxed else 0
    # collapse_padding: neighbouring cells share their one column of padding
    padding = n + 1 if kw.get("collapse_padding", False) else 2 * n
    return borders + padding - (0 if kw.get("pad_edge", True) else 2)


def fit_table(console: Console, cols: Sequence[Col], rows: Sequence[Sequence[RenderableType | None]], *,
              left_out_hint: str = "", **table_kw: Any) -> Table:
    """A Rich Table of `rows` laid out for `console.width`; `table_kw` go to Table (title, caption, box, ...).

    `left_out_hint` follows the caption that names columns left out, e.g. "--json has every field"."""
    texts = [[_text(r[i] if i < len(r) else "") for r in rows] for i in range(len(cols))]
    heads = [Text(c.header) for c in cols]
    natural = [max(_natural(t), h.cell_len) for t, h in zip(texts, heads, strict=True)]

    def least(i: int) -> int:
        c, head_word = cols[i], _longest_word([heads[i]])
        if c.kind == "num":  # the header may wrap between its words, the number never
            return max(_natural(texts[i]), head_word)
        if c.kind == "word":
            return max(_longest_word(texts[i]), head_word)
        return min(natural[i], max(TEXT_MIN, head_word))

    width = console.width
    keep = list(range(len(cols)))
    while sum(least(i) for i in keep) + _overhead(len(keep), table_kw) > width:
        droppable = [i for i in keep if cols[i].drop > 0]
        if not droppable:
            break
        keep.remove(max(droppable, key=lambda i: (cols[i].drop, i)))
    left_out = [cols[i].header for i in range(len(cols)) if i not in keep]
    room = width - _overhead(len(keep), table_kw)
    widths: dict[int, int] = {}
    if sum(natural[i] for i in keep) > room:
        # every column at its narrowest (printed wider than the console if even that does not fit); the room left
        # goes first to the text columns up to their longest word (no word folded), then to the word columns (a
        # status on one line) and the headers of the number columns, and last to the text columns again; each
        # column to at most its natural width, the text columns widened evenly
        widths = {i: least(i) for i in keep}
        spare = room - sum(widths.values())

        def level(cap: dict[int, int]) -> None:
            nonlocal spare
            while spare > 0:
                grow = [i for i in cap if widths[i] < cap[i]]
                if not grow:
                    return
                low = min(widths[i] for i in grow)
                for i in (i for i in grow if widths[i] == low):
                    if spare == 0:
                        return
                    widths[i] += 1
                    spare -= 1

        text = [i for i in keep if cols[i].kind == "text"]
        level({i: min(natural[i], _longest_word(texts[i])) for i in text})
        for i in sorted((i for i in keep if cols[i].kind != "text"), key=lambda i: natural[i] - widths[i]):
            add = max(0, min(spare, natural[i] - widths[i]))
            widths[i] += add
            spare -= add
        level({i: natural[i] for i in text})
    if left_out:
        note = f"not shown at {width} columns: {', '.join(left_out)}" + (f" ({left_out_hint})" if left_out_hint else "")
        table_kw["caption"] = f"{table_kw['caption']}\n{note}" if table_kw.get("caption") else note
    t = Table(**table_kw)
    need = sum(widths.get(i, natural[i]) for i in keep) + _overhead(len(keep), table_kw)
    if need > width:
        t.width = need  # nothing left to leave out: wider than the console, nothing cut
    for i in keep:
        c = cols[i]
        t.add_column(c.header, justify=c.justify or ("right" if c.kind == "num" else "left"), style=c.style,
                     overflow="fold" if c.kind == "text" else "ellipsis", width=widths.get(i),
                     min_width=least(i) if c.kind == "num" else None)
    for r in range(len(rows)):
        t.add_row(*(texts[i][r] for i in keep))
    return t


def print_table(console: Console, cols: Sequence[Col], rows: Sequence[Sequence[RenderableType | None]], *,
                left_out_hint: str = "", **table_kw: Any) -> None:
    # soft_wrap off: a console made with soft_wrap=True would print the title and caption on one long line
    console.print(fit_table(console, cols, rows, left_out_hint=left_out_hint, **table_kw), crop=False, soft_wrap=False)
