"""The `difftrain` command: a thin Typer app. Each command module under `difftrain/cli/` exposes
`register(app)` and imports torch only inside its command, so that `difftrain --help` is instant."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

import typer

from difftrain import __version__
from difftrain.errors import user_message

# the modules under difftrain.cli that register commands, in the order of --help
COMMAND_MODULES = "recipes prepare pretrain finetune generate evaluate compare interop bench plan".split()

# the base class of click's usage errors, whichever click Typer uses (its own vendored one or `click`)
_USAGE_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

app = typer.Typer(
    name="difftrain",
    help="Pretrain, fine-tune, evaluate and sample Differential Transformers from YAML recipes.",
    no_args_is_help=True,
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"difftrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks for errors."),
) -> None:
    """difftrain — Differential Transformer training toolkit."""


def unwrap_help(doc: str) -> str:
    """`doc` with each paragraph's lines joined (the terminal wraps them); a table (a paragraph
    with an indented line) keeps its lines."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(doc))
    return "\n\n".join(
        p
        if any(line.startswith(" ") for line in p.splitlines())
        else " ".join(line.strip() for line in p.splitlines())
        for p in paragraphs
    )


def _unwrap_commands(group: typer.Typer) -> None:
    for info in group.registered_commands:
        text = info.help or (info.callback.__doc__ if info.callback is not None else None)
        if text:
            info.help = unwrap_help(text)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _unwrap_commands(sub.typer_instance)


for _name in COMMAND_MODULES:
    importlib.import_module(f"difftrain.cli.{_name}").register(app)
_unwrap_commands(app)


def error_line(message: str) -> None:
    """Print a user-facing error as one red line on stderr (the message is no rich markup)."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}")


def usage_message(e: Exception, args: list[str] | None = None) -> str:
    """Click's usage error as one line: the error and where the command's help is."""
    message = e.format_message()  # type: ignore[attr-defined]
    message = message.replace("Input should be", "must be").replace("Value error, ", "").rstrip(".")
    ctx = getattr(e, "ctx", None)
    path = ctx.command_path if ctx is not None else _command_path(args or [])
    if getattr(e, "option_name", None) == "--debug" and path != "difftrain":  # given after the command
        rest = path.removeprefix("difftrain ")
        return f"{message}: --debug goes before the command, e.g. `difftrain --debug {rest} ...`"
    return message if path is None else f"{message} (see `{path} --help`)"


def _dash_file_hint(e: Exception, args: list[str]) -> str:
    """For an unknown option that is an existing file's name (`-dash.yaml`): how to name the file."""
    name = getattr(e, "option_name", None)
    given = next((a for a in args if name and a.startswith(name) and os.path.exists(a)), None)
    if given is None:
        return ""
    return f"; {given} is a file, read as options because it starts with '-': write it as ./{given}"


def _command_path(args: list[str]) -> str | None:
    """`difftrain CMD [SUB]` for the command `args` name (None where they name none)."""
    command: Any = typer.main.get_command(app)
    path = ["difftrain"]
    for arg in args:
        if arg.startswith("-"):
            continue
        sub = getattr(command, "commands", {}).get(arg)  # a group's subcommands
        if sub is None:
            break
        command, path = sub, [*path, arg]
    return " ".join(path) if len(path) > 1 else None


_CTRL_C = {"seen": False}


class Terminated(BaseException):
    """SIGTERM outside training: ends the command as Ctrl-C does, but is no KeyboardInterrupt
    (which a chat catches to stop a reply)."""


def _watch_ctrl_c() -> Callable[[], object]:
    """Ctrl-C as KeyboardInterrupt (noted in `_CTRL_C`) and SIGTERM as `Terminated`, where their
    handlers are the defaults; returns the undo."""
    import signal
    import threading

    _CTRL_C["seen"] = False
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    undo = []

    def on_signal(signum: int, frame: Any) -> None:
        if signum != signal.SIGINT:
            raise Terminated
        _CTRL_C["seen"] = True
        raise KeyboardInterrupt

    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(sig) is default:
            signal.signal(sig, on_signal)
            undo.append((sig, default))
    return lambda: [signal.signal(sig, default) for sig, default in undo]


def _interrupted(message: str = "interrupted (Ctrl-C)") -> None:
    """A stop outside training: one line, after a newline that ends a streamed line on a terminal."""
    with contextlib.suppress(OSError, ValueError):
        if sys.stdout.isatty():
            sys.stdout.write("\n")
        sys.stdout.flush()
    error_line(message)


_COMPLETION_OPTIONS = ("--show-completion", "--install-completion")
_SHELL_CHOICE_ENV = "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION"  # Typer: the options take a shell


def _shell_named(args: list[str]) -> bool:
    """Whether `args` name the shell for --show-completion / --install-completion."""
    for i, arg in enumerate(args):
        if arg in _COMPLETION_OPTIONS:
            return i + 1 < len(args) and not args[i + 1].startswith("-")
        if arg.startswith(tuple(f"{o}=" for o in _COMPLETION_OPTIONS)):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if sys.stdin is None:  # started with standard input closed (`<&-`): read as empty, as /dev/null is
        sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 - the process's stdin from here on
    if any(a.startswith(_COMPLETION_OPTIONS) for a in args):
        from difftrain.cli.complete import use_bash_script

        use_bash_script()
    shell_named = _shell_named(args) and _SHELL_CHOICE_ENV not in os.environ
    if shell_named:
        os.environ[_SHELL_CHOICE_ENV] = "1"
    watch = _watch_ctrl_c()
    try:
        result = app(args=args, prog_name="difftrain", standalone_mode=False)
        if result == 130 and _CTRL_C["seen"]:  # Typer turns Ctrl-C into a silent return of 130
            _interrupted()
    except BaseException as e:
        ending = _ending(e, args)
        if ending is None:  # not a user's failure: a bug, whose traceback stands
            raise
        message, code = ending
        if isinstance(e, (KeyboardInterrupt, Terminated)):
            _interrupted(message)
        elif message is not None:
            if "--debug" in args and user_message(e) is not None:  # the traceback, then the same line
                import traceback

                traceback.print_exc()
            error_line(message)
        return code
    finally:
        watch()
        if shell_named:
            del os.environ[_SHELL_CHOICE_ENV]
    return result if isinstance(result, int) else 0


def _ending(e: BaseException, args: list[str]) -> tuple[str | None, int] | None:
    """(the red line or None, the exit code) that end the command on `e`; None for a bug."""
    if isinstance(e, typer.Exit):
        return None, e.exit_code
    if isinstance(e, SystemExit):  # Typer's --show-completion / --install-completion exit so
        return None, e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if isinstance(e, typer.Abort):
        return "aborted", 130
    if isinstance(e, _USAGE_ERROR):  # unknown option, missing argument, bad value
        if not e.format_message():  # a command group run bare: click has printed its help, nothing failed
            return None, 0
        return usage_message(e, args) + _dash_file_hint(e, args), e.exit_code  # type: ignore[attr-defined]
    if isinstance(e, KeyboardInterrupt):
        return "interrupted (Ctrl-C)", 130
    if isinstance(e, Terminated):
        return "interrupted (SIGTERM)", 143
    message = user_message(e)
    return None if message is None else (message, getattr(e, "exit_code", 2))


if __name__ == "__main__":
    sys.exit(main())
