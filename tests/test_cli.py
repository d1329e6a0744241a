"""The command line's own failure modes: usage mistakes are one clear message and exit code 2."""

from __future__ import annotations

import os

import pytest

from difftrain.cli.app import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--bogus"], "No such option: --bogus"),
        (["generate"], "Missing argument"),
        (["plan"], "Missing argument"),
        (["no-such-command"], "No such command"),
        (["bench", "--reps", "many"], "Invalid value for '--reps'"),
        (["pretrian"], "No such command 'pretrian'. Did you mean 'pretrain'? (see `difftrain --help`)"),
        (["recipes", "shw"], "(see `difftrain recipes --help`)"),
        (
            ["plan", "quickstart", "--gpu-mem"],
            "Option '--gpu-mem' requires an argument",
        ),  # click gives no context
        (["recipes", "cp", "quickstart"], "Missing argument 'dest'"),
    ],
)
def test_usage_errors_exit_2_with_a_message_and_no_traceback(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    # one line, as every user-facing error: the error first, then where the help is
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    command = "difftrain" if argv[0] == "pretrian" or argv[0].startswith("no-") else f"difftrain {argv[0]}"
    if argv[:2] == ["recipes", "cp"]:
        command = "difftrain recipes cp"
    assert err.rstrip().endswith(f"(see `{command} --help`)")


def test_debug_goes_before_the_command_and_keeps_the_exit_code(capsys):
    assert main(["prepare", "nosuch", "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "error: No such option: --debug: --debug goes before the command, e.g. `difftrain --debug prepare ...`"
    )
    assert main(["--debug", "prepare", "nosuch"]) == 2  # a user mistake: the traceback, then the line, exit 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("Traceback") and lines[-1].startswith("error: no recipe file `nosuch`")
    assert main(["recipes", "show", ""]) == 2
    assert "error: the recipe name is empty; give a recipe file" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["recipes"]])
def test_a_command_group_run_bare_shows_its_help_and_no_empty_error(argv, capsys):
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "Commands" in out and ("pretrain" if not argv else "explain") in out
    assert "error" not in err  # it printed "error:  (see ...)" with an empty message, exit 2


def test_a_recipe_file_named_with_a_leading_dash_is_told_how_to_name_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-dash.yaml").write_text("name: x\n")
    assert main(["prepare", "-dash.yaml"]) == 2
    err = capsys.readouterr().err
    assert "No such option: -d" in err and "-dash.yaml is a file, read as options because it starts" in err
    assert "write it as ./-dash.yaml" in err and len(err.strip().splitlines()) == 1
    assert main(["prepare", "-x"]) == 2  # an option that names no file: no hint
    assert "is a file" not in capsys.readouterr().err


def test_h_is_help_everywhere_and_completion_scripts_are_offered(capsys):
    for argv in (["-h"], ["eval", "-h"], ["recipes", "show", "-h"]):
        assert main(argv) == 0, argv
        out = capsys.readouterr().out
        assert "Usage: difftrain" in out and "--help" in out, argv
    assert main(["--show-completion", "bash"]) == 0
    assert "_DIFFTRAIN_COMPLETE=complete_bash" in capsys.readouterr().out


def test_help_text_wraps_at_the_terminal_not_at_the_docstring_line_breaks(capsys, monkeypatch):
    from difftrain.cli.app import unwrap_help

    assert unwrap_help("One line\n    and its rest.\n\n    Second\n    paragraph.") == (
        "One line and its rest.\n\nSecond paragraph."
    )
    monkeypatch.setenv("COLUMNS", "200")  # wide enough for every paragraph of prepare's docstring
    assert main(["prepare", "--help"]) == 0
    out = capsys.readouterr().out
    # the docstring wraps after "it is the way"; a line break there in --help is the bug this guards
    assert "it is the way to check the data" in out


def test_every_help_text_fits_an_80_column_terminal():
    # Paragraphs are joined (the terminal wraps them); a table keeps its lines, so each must fit
    # 80 columns less the 1-space margin, or it wraps mid-row (eval's list of suites did).
    import typer.main

    from difftrain.cli.app import app

    def walk(cmd, path):
        yield path, cmd.help or ""
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")

    texts = dict(walk(typer.main.get_command(app), "difftrain"))
    assert {"difftrain eval", "difftrain compare", "difftrain recipes explain"} <= set(texts)
    for path, text in texts.items():
        for para in text.split("\n\n"):
            lines = para.splitlines()
            assert len(lines) == 1 or all(line.startswith(" ") for line in lines[1:]), (path, para)
            assert len(lines) == 1 or all(len(line) <= 78 for line in lines), (path, para)
    assert "  needle     multi-needle retrieval" in texts["difftrain eval"]


def test_help_and_version_exit_0(capsys):
    assert main(["--help"]) == 0
    assert "pretrain" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert "difftrain" in capsys.readouterr().out


def test_recipes_cp_copies_to_a_file_or_into_a_folder(tmp_path, capsys, monkeypatch):
    from difftrain.recipe import find_recipe

    shipped = find_recipe("quickstart").read_bytes()
    assert main(["recipes", "cp", "quickstart", str(tmp_path / "my.yaml")]) == 0
    assert (tmp_path / "my.yaml").read_bytes() == shipped
    assert main(["recipes", "cp", "quickstart", str(tmp_path)]) == 0  # an existing folder
    assert (tmp_path / "quickstart.yaml").read_bytes() == shipped
    assert main(["recipes", "cp", "quickstart", str(tmp_path / "new") + "/"]) == 0  # a folder to create
    assert (tmp_path / "new" / "quickstart.yaml").read_bytes() == shipped
    capsys.readouterr()
    (tmp_path / "my.yaml").write_text("mine")
    assert main(["recipes", "cp", "quickstart", str(tmp_path / "my.yaml")]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (tmp_path / "my.yaml").read_text() == "mine"
    assert main(["recipes", "cp", "quickstart", str(tmp_path / "my.yaml"), "--force"]) == 0
    assert (tmp_path / "my.yaml").read_bytes() == shipped
    capsys.readouterr()
    assert main(["recipes", "cp", "quickstart", str(tmp_path / "my.yaml" / "x.yaml")]) == 2  # under a file
    err = capsys.readouterr().err
    assert "cannot write" in err and "Traceback" not in err
    monkeypatch.chdir(tmp_path / "new")
    for empty in ("", "  "):  # was taken for the current folder
        assert main(["recipes", "cp", "quickstart", empty]) == 2
        assert "DEST is empty; give the file to write" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["quickstart.yaml"]


def test_recipes_cp_of_a_recipe_file_says_which_relative_paths_now_name_something_else(tmp_path, capsys):
    """A recipe's relative paths are read against its own folder: a copy elsewhere reads other data."""
    (tmp_path / "proj" / "data").mkdir(parents=True)
    (tmp_path / "proj" / "data" / "a.txt").write_text("text")
    (tmp_path / "proj" / "r.yaml").write_text(
        "name: r\nmodel: {d_model: 64, n_layers: 1, n_heads: 2}\ntrain: {max_steps: 1}\n"
        "data: {sources: [data/a.txt, builtin:needles, " + str(tmp_path / "proj" / "data") + "]}\n"
        "tokenizer: {path: tok.json}\n"
    )
    assert main(["recipes", "cp", str(tmp_path / "proj" / "r.yaml"), str(tmp_path / "elsewhere") + "/"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"reads data/a.txt (and 1 more) relative to its own folder {tmp_path / 'elsewhere'}" in err
    assert f"no longer from {tmp_path / 'proj'}" in err
    for dest in (tmp_path / "proj" / "r2.yaml", tmp_path / "q.yaml"):  # the same folder; a shipped recipe
        src = str(tmp_path / "proj" / "r.yaml") if dest.name == "r2.yaml" else "quickstart"
        assert main(["recipes", "cp", src, str(dest)]) == 0
        assert "warning" not in capsys.readouterr().err
    # a relative `extends:` is read against the recipe's folder too; a shipped name anywhere
    (tmp_path / "proj" / "sub").mkdir()
    (tmp_path / "proj" / "sub" / "child.yaml").write_text("extends: ../r.yaml\nname: c\n")
    assert (
        main(["recipes", "cp", str(tmp_path / "proj" / "sub" / "child.yaml"), str(tmp_path / "x" / "c.yaml")])
        == 0
    )
    err = " ".join(capsys.readouterr().err.split())
    assert "reads extends: ../r.yaml relative to its own folder" in err
    assert "(and " not in err  # the parent's own data paths are not the copy's to fix
    (tmp_path / "proj" / "sibling.yaml").write_text("extends: r.yaml\nname: s\n")  # next to its parent
    assert (
        main(["recipes", "cp", str(tmp_path / "proj" / "sibling.yaml"), str(tmp_path / "y" / "s.yaml")]) == 0
    )
    err = " ".join(capsys.readouterr().err.split())
    assert "reads extends: r.yaml relative to its own folder" in err and "(and " not in err
    (tmp_path / "proj" / "sub" / "shipped.yaml").write_text("extends: quickstart\nname: s\n")
    assert (
        main(
            ["recipes", "cp", str(tmp_path / "proj" / "sub" / "shipped.yaml"), str(tmp_path / "x" / "s.yaml")]
        )
        == 0
    )
    assert "warning" not in capsys.readouterr().err


def test_table_values_are_plain_text_not_markup():
    """A run named `exp[lr=1e-3]` or `[bold]x` is printed as named (rich ate the brackets: the
    start table and the `next` command named a folder that does not exist)."""
    from rich.console import Console

    from difftrain.cli.common import kv_table

    con = Console(record=True, width=200)
    con.print(kv_table("t", [("run", "runs/exp[lr=1e-3]"), ("next", "difftrain generate 'runs/[bold]x'")]))
    text = con.export_text()
    assert "runs/exp[lr=1e-3]" in text and "difftrain generate 'runs/[bold]x'" in text


def test_recipes_show_resolved_prints_the_recipe_a_run_would_use(tmp_path, capsys):
    import yaml

    child = tmp_path / "child.yaml"
    child.write_text("extends: quickstart\nname: child\ntrain:\n  max_tokens: 1e6\n")
    capsys.readouterr()
    assert main(["recipes", "show", str(child), "--resolved", "model.d_model=96"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["name"] == "child" and doc["model"]["d_model"] == 96 and doc["model"]["n_layers"] == 4
    assert doc["train"]["max_tokens"] == 1_000_000 and doc["train"]["max_steps"] is None
    assert doc["optim"]["lr"] == 2.0e-3  # the parent's, and the defaults filled in
    assert main(["recipes", "show", str(child), "model.d_model=96"]) == 2  # overrides need --resolved
    assert "with --resolved only" in capsys.readouterr().err


def test_completion_scripts_for_a_named_shell(capsys):
    # Typer's options detect the shell and take no value: `--install-completion zsh` from bash
    # installed bash's script; named, the shell is the one asked for, and a wrong name is one line
    assert main(["--show-completion", "bash"]) == 0  # no space after `key=` or a folder; names quoted
    script = capsys.readouterr().out
    assert "compopt -o nospace" in script and "printf '%q'" in script
    assert main(["--show-completion", "zsh"]) == 0
    assert capsys.readouterr().out.startswith("#compdef difftrain")
    assert main(["--show-completion=fish"]) == 0
    assert "complete --command difftrain" in capsys.readouterr().out
    assert main(["--install-completion", "tcsh"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'tcsh' is not one of 'bash', 'zsh', 'fish'" in err and "\n" not in err
    assert "Value error" not in err
    assert "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION" not in os.environ  # not left set


def _complete(monkeypatch, capsys, shell: str, words: str) -> list[str]:
    """What TAB offers at the end of `words` (as the shell's completion script asks for it)."""
    monkeypatch.setenv("_DIFFTRAIN_COMPLETE", f"complete_{shell}")
    if shell == "bash":  # bash has split the line at '=' already (COMP_WORDBREAKS)
        parts = words.replace("=", " = ").split() + ([""] if words.endswith(" ") else [])
        monkeypatch.setenv("COMP_WORDS", " ".join(parts))
        monkeypatch.setenv("COMP_CWORD", str(len(parts) - 1))
    else:
        monkeypatch.setenv("_TYPER_COMPLETE_ARGS", words)
    assert main([]) == 0
    return capsys.readouterr().out.split()


def test_tab_completes_recipes_overrides_and_suites(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("extends: quickstart\nname: mine\n")
    (tmp_path / "notes.txt").write_text("x")
    assert _complete(monkeypatch, capsys, "bash", "difftrain pretrain quick") == [
        "quickstart",
        "quickstart-baseline",
    ]
    assert _complete(monkeypatch, capsys, "bash", "difftrain plan mi") == ["mine.yaml"]
    assert _complete(monkeypatch, capsys, "bash", "difftrain pretrain mine.yaml train.max_st") == [
        "train.max_steps="
    ]
    # a value after '=': bash completes the word after the '=' it split off, zsh the whole word
    assert _complete(monkeypatch, capsys, "bash", "difftrain pretrain mine.yaml model.arch=d") == [
        "diff",
        "diff2",
    ]
    assert _complete(monkeypatch, capsys, "bash", "difftrain pretrain mine.yaml model.arch=") == [
        "baseline",
        "diff",
        "diff2",
    ]  # readline completes the word after the '='
    zsh = " ".join(_complete(monkeypatch, capsys, "zsh", "difftrain finetune x.yaml train.compile=t"))
    assert "train.compile=true" in zsh and "false" not in zsh
    assert _complete(monkeypatch, capsys, "bash", "difftrain eval runs/q --suite ppl,ne") == ["ppl,needle"]
    assert _complete(monkeypatch, capsys, "bash", "difftrain recipes show diff2") == ["diff2-124m"]


def test_the_peak_memory_cell_of_several_processes_says_whose_it_is():
    # the figures are rank 0's: read as the run's total they undercount it by the process count
    from difftrain.cli.common import peak_memory

    assert peak_memory({"peak_rss_mb": 812.4}) == "RSS 812 MiB"
    assert peak_memory({"peak_rss_mb": 812.4, "devices": 2}) == "RSS 812 MiB (rank 0 of 2 processes)"
    assert peak_memory({"peak_rss_mb": None, "devices": 2}) == "RSS —"


def test_recipes_cp_to_another_name_says_the_copy_keeps_the_originals_run_name(tmp_path, capsys, monkeypatch):
    # `recipes cp quickstart mine.yaml` then `pretrain mine.yaml` was refused: runs/quickstart holds a run
    monkeypatch.chdir(tmp_path)
    assert main(["recipes", "cp", "quickstart", "mine.yaml"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "its name is still quickstart: a run of it goes to the original's run folder (out_dir/quickstart)"
        in out
    )
    assert main(["recipes", "cp", "quickstart", "quickstart.yaml"]) == 0  # the same name: nothing to say
    assert "its name" not in capsys.readouterr().out


def test_recipe_completion_of_a_path_in_the_root_folder_stays_absolute():
    # "/x".rpartition("/") has no folder: it listed the current folder and dropped the "/"
    from difftrain.cli.complete import recipe_refs

    assert ("/tmp/", "folder") in recipe_refs("/tm")


def test_a_closed_standard_input_reads_as_empty(monkeypatch, capsys):
    # started with `<&-`, sys.stdin is None: `--prompt-file -`, --interactive and chat raised
    # AttributeError tracebacks; now standard input reads as /dev/null does (an empty input)
    import sys

    monkeypatch.setattr(sys, "stdin", None)
    assert main(["--version"]) == 0
    assert sys.stdin is not None and sys.stdin.read() == "" and not sys.stdin.isatty()
    sys.stdin.close()


def test_recipes_show_of_a_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    p = tmp_path / "b.yaml"
    p.write_bytes(b"\xff\xfe\x00bad")
    assert main(["recipes", "show", str(p)]) == 2  # a UnicodeDecodeError traceback, exit 1
    assert "not UTF-8 text (byte 0); save the recipe as UTF-8" in capsys.readouterr().err
