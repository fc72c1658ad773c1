"""`python -m moetune.tuner.cli`: the `moetune` command, for an environment without the console script (a checkout
on PYTHONPATH, a venv whose bin/ is not on PATH). Without this file Python answered "No module named
moetune.tuner.cli.__main__; 'moetune.tuner.cli' is a package and cannot be directly executed".

`_entry` is imported first and alone: importing it takes Ctrl-C over before the CLI's own imports (its docstring
says why), as the console script does."""

from moetune.tuner.cli._entry import main

if __name__ == "__main__":
    main()
