"""`--help` read as a new user: a flag shows no value placeholder (`--json <bool>` read as if a value were
required), an option with two names shows them apart (`--curve-clients-dir,--clients-dir`), and options whose
default comes from the config say what it is."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from moetune.tuner.cli import app

pytestmark = pytest.mark.timeout(120)


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", r.output))


def _commands(group=None, path=()):  # every command's argv prefix, subcommands included
    import typer

    group = group or typer.main.get_command(app)
    for name in group.list_commands(None):
        cmd = group.get_command(None, name)
        yield (*path, name)
        if hasattr(cmd, "list_commands"):
            yield from _commands(cmd, (*path, name))


def test_no_flag_shows_a_bool_placeholder_anywhere() -> None:
    every = [(), *_commands()]
    assert len(every) > 20
    for args in every:
        h = _help(*args)
        assert "<bool>" not in h, (args, h)
        assert "--help Show this message" in h, (args, h)


def test_a_flag_has_no_placeholder_an_option_keeps_its_own() -> None:
    assert "--version Print the version" in _help()
    h = _help("profiles", "list")
    assert "--json Print JSON." in h and "--db <path>" in h and "--status <str>" in h, h
    assert "--allow-insecure-tcp / --no-allow-insecure-tcp Allow tcp://" in _help("serve")  # one cell, as click


def test_two_names_of_one_option_are_shown_apart() -> None:
    h = _help("serve")
    assert "--curve-clients-dir, --clients-dir <path>" in h, h
    assert "--curve-clients-dir,--clients-dir" not in h


def test_defaults_from_the_config_are_stated() -> None:
    q = _help("query")
    assert re.search(r"--socket <str> Daemon endpoint \(default: \[client\] socket, else the daemon's \[daemon\] "
                     r"socket: ipc:// daemon\.sock in the runtime directory\)", q), q
    assert re.search(r"--db <path> Database to read when the daemon does not answer \(default: the runtime's: "
                     r"\$MOETUNE_STORE_DB, else \[store\] db where a config file sets it, else the daemon's database "
                     r"as daemon\.json names it, else \$MOETUNE_HOME, XDG data dir\)", q), q
    assert "--db <path> Profile database (default: [store] db, $MOETUNE_HOME, XDG data dir)" in _help("report")
    assert "(trusted loopback tests only; default: config daemon.allow_insecure_tcp, false)" in _help("serve")


def test_patched_display_type_rich_takes_ctx_by_keyword_or_position() -> None:
    """Typer calls display_type_rich(ctx=ctx): the patch takes and passes on any arguments."""
    import typer
    from typer.core import TyperOption

    cmd = typer.main.get_command(app).get_command(None, "serve")
    ctx = type(typer.main.get_command(app).make_context("moetune", ["serve"]))(cmd)
    opts = {p.name: p for p in cmd.params if isinstance(p, TyperOption)}
    flag, opt = opts["allow_insecure_tcp"], opts["curve_clients_dir"]
    assert TyperOption.display_type_rich(flag, ctx=ctx) is None
    assert TyperOption.display_type_rich(opt, ctx=ctx) == TyperOption.display_type_rich(opt, ctx) == "<path>"


def test_the_patch_is_skipped_cleanly_without_display_type_rich(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Typer whose TyperOption lacks display_type_rich (< 0.29): that part is left out, the names fix still applies."""
    from rich.highlighter import RegexHighlighter
    from typer import rich_utils
    from typer.core import TyperOption

    from moetune.tuner.cli import _help

    class Plain(RegexHighlighter):
        highlights = (r"(?P<option>--[\w-]+)",)

    class Option:  # a TyperOption without display_type_rich
        pass

    monkeypatch.setattr(rich_utils, "highlighter", Plain())
    monkeypatch.setattr("typer.core.TyperOption", Option)
    _help.apply()
    assert not hasattr(Option, "display_type_rich") and not hasattr(Option, "_moetune_help")
    assert str(rich_utils.highlighter("--curve-clients-dir,--clients-dir")) == "--curve-clients-dir, --clients-dir"
    patched = rich_utils.highlighter
    _help.apply()  # once only
    assert rich_utils.highlighter is patched
    assert getattr(TyperOption, "_moetune_help", False)  # the real one untouched by this test


def test_the_patch_passes_any_arguments_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """Was display_type_rich(self, ctx): a Typer passing another argument (or ctx under another name) broke --help."""
    from rich.highlighter import RegexHighlighter
    from typer import rich_utils

    from moetune.tuner.cli import _help

    class Option:
        is_flag, metavar = False, None

        def display_type_rich(self, *args, **kwargs):
            return (args, kwargs)

    class Plain(RegexHighlighter):
        highlights = ()

    monkeypatch.setattr(rich_utils, "highlighter", Plain())
    monkeypatch.setattr("typer.core.TyperOption", Option)
    _help.apply()
    assert Option.display_type_rich(Option(), context="c", width=3) == ((), {"context": "c", "width": 3})
    flag = Option()
    flag.is_flag = True
    assert Option.display_type_rich(flag, "c") is None


@pytest.mark.parametrize("cmd", [("bench", "moe"), ("bench", "knobs")])
def test_layer_benchmarks_say_their_unit_and_where_results_go(cmd: tuple[str, ...]) -> None:
    """`bench moe --help` and `bench knobs --help` said neither the unit of their table nor that they write no file
    (their numbers go to stdout only, unlike `bench run`'s summary.csv)."""
    h = _help(*cmd)
    assert "µs per forward" in h and "on stdout" in h and "writes no file" in h, h


def test_profile_help_says_what_a_one_gpu_node_tunes() -> None:
    """`moetune profile --help` named no family: a new user on one Hopper GPU could not tell it tunes the megakernel
    there (and no EP transport), nor where the profiles and the report go."""
    h = _help("profile")
    assert "family megakernel" in h and "a one-GPU node has no EP size to tune" in h and "--report-dir" in h, h


@pytest.mark.parametrize("cmd", [("query",), ("status",), ("retune",)])
def test_timeout_ms_help_states_the_bound_the_command_enforces(cmd: tuple[str, ...]) -> None:
    """`--timeout-ms` refused 0 and anything above a day ("must be 1 to 86400000"), while its help named no bound:
    a user learned it only from the error."""
    from moetune.runtime.config import MAX_CLIENT_TIMEOUT_MS

    h = _help(*cmd)
    option = h[h.index("--timeout-ms"):h.index("--timeout-ms") + 200]
    assert f"1 to {MAX_CLIENT_TIMEOUT_MS}" in option, option
    args = ["--model", "qwen3-30b", "--ep", "2", "--tokens", "128"] if cmd == ("query",) else []
    r = CliRunner().invoke(app, [*cmd, *args, "--timeout-ms", str(MAX_CLIENT_TIMEOUT_MS + 1)], env={"COLUMNS": "400"})
    assert r.exit_code == 2 and f"1 to {MAX_CLIENT_TIMEOUT_MS}" in r.output, r.output


def _bound_cases() -> list[tuple[tuple[str, ...], str, str, list[str], str]]:
    """(command, option, the bound its help states, argv past the bound, what the refusal says)."""
    from moetune.runtime.config import MAX_TRIALS
    from moetune.runtime.shapes import MAX_TOKENS_PER_GPU as T

    tune = ["tune", "--model", "qwen3-30b"]
    predict = ["model", "predict", "--preset", "nvlink-h200x2"]
    sweep = ["model", "sweep", "--preset", "nvlink-h200x2", "--over", "group_size"]
    return [
        (("tune",), "--trials", f"1 to {MAX_TRIALS}", [*tune, "--trials", "100000000000000000000"], f"1 to {MAX_TRIALS}"),
        (("tune",), "--nodes", ">= 1", [*tune, "--nodes", "0"], "--nodes must be >= 1"),
        (("tune",), "--repeats", ">= 1", [*tune, "--repeats", "0"], "--repeats must be >= 1"),
        (("tune",), "--trial-timeout", "> 0", [*tune, "--trial-timeout", "0"], "seconds > 0"),
        (("profile",), "--trials", f"1 to {MAX_TRIALS}", ["profile", "--trials", str(MAX_TRIALS + 1)],
         f"--trials must be an integer from 1 to {MAX_TRIALS}"),
        (("model", "predict"), "--nodes", ">= 1", [*predict, "--nodes", "0"], "--nodes must be >= 1"),
        (("model", "predict"), "--tokens", f"1 to {T}", [*predict, "--tokens", str(T + 1)], f"at most {T}"),
        (("model", "predict"), "--tile", f"1 to {T}", [*predict, "--tile", str(T + 1)], f"at most {T}"),
        (("model", "sweep"), "--nodes", ">= 1", [*sweep, "--nodes", "0"], "--nodes must be >= 1"),
        (("model", "sweep"), "--tokens", f"1 to {T}", [*sweep, "--tokens", "0"], "--tokens must be >= 1"),
        (("model", "sweep"), "--tile", f"1 to {T}", [*sweep, "--tile", "0"], "--tile must be >= 1"),
        (("bench", "ep"), "--world", ">= 1", ["bench", "ep", "--world", "0"], "--world must be >= 1"),
        (("bench", "ep"), "--timeout", "> 0", ["bench", "ep", "--timeout", "0"], "seconds > 0"),
    ]


@pytest.mark.parametrize("cmd, option, bound, argv, refusal", _bound_cases())
def test_bounded_options_state_their_bound_in_the_help(tmp_path, cmd: tuple[str, ...], option: str, bound: str,
                                                       argv: list[str], refusal: str) -> None:
    """`tune --nodes/--repeats/--trial-timeout/--trials`, `model predict/sweep --nodes/--tokens/--tile` and `bench ep
    --world/--timeout` refused values their help gave no bound for; `--trials` had no upper bound at all (`profile
    --trials 100000000000000000000` just started). Each help states the bound its command enforces."""
    h = _help(*cmd)
    cell = re.search(rf"{option}(?: -\w)? <\w+> .{{0,260}}", h)  # the option's own cell (a short name beside it)
    assert cell, h
    cell = cell.group(0)
    assert bound in cell, cell
    home = tmp_path / "home"
    env = {"MOETUNE_HOME": str(home), "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"), "MOETUNE_CONFIG": "",
           "COLUMNS": "400"}
    r = CliRunner().invoke(app, argv, env=env)
    assert r.exit_code == 2 and refusal in re.sub(r"\s+", " ", r.output), r.output
