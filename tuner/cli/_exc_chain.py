"""The KeyboardInterrupt behind an exception: light (no Typer), so the entry point can ask before the app loads."""

from __future__ import annotations


def interrupt_in_chain(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that `e` is, or that its `__cause__` / `__context__` chain holds; None without one."""
    seen: set[int] = set()
    todo: list[BaseException] = [e]
    while todo:
        cur = todo.pop()
        if isinstance(cur, KeyboardInterrupt):
            return cur
        if id(cur) not in seen:
            seen.add(id(cur))
            todo += [x for x in (cur.__context__, cur.__cause__) if x is not None]
    return None
