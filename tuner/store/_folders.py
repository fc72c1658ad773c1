"""Where moetune may create a new SQLite file: the ONE rule for the profile store (`--db`, `[store] db`) and a SQLite
studies storage (`--storage sqlite:///...`, the default studies file).

moetune creates no folder but its own data folder ($MOETUNE_HOME, else the XDG data dir): a path in a folder that
does not exist is most likely a typo, and the system daemon's /var/lib/moetune comes from its unit's StateDirectory."""

from __future__ import annotations

from pathlib import Path


def make_parent(path: Path, error: type[Exception]) -> None:
    """Make sure the folder of new file `path` is there: create it only when it is moetune's own data folder. Any
    refusal or failure is raised as `error` (each caller's own exception type)."""
    from moetune.runtime.paths import data_dir

    parent = path.parent
    if parent.is_dir():
        return
    own = data_dir().expanduser().absolute()
    if parent.absolute() != own:
        if parent.exists():
            raise error(f"cannot create {path}: {parent} is not a folder")
        raise error(f"cannot create {path}: the folder {parent} does not exist (moetune creates only its own data "
                    f"folder, {own}; create {parent} first or give another path)")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise error(f"cannot create the folder of {path}: {e}") from None
