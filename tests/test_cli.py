"""The command line's own failure modes: usage mistakes are one clear message and exit code 2."""

from __future__ import annotations

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
    assert err.rstrip().endswith(f"(see `{command} --help`)")


@pytest.mark.parametrize("argv", [[], ["recipes"]])
def test_a_command_group_run_bare_shows_its_help_and_no_empty_error(argv, capsys):
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "Commands" in out and ("pretrain" if not argv else "explain") in out
    assert "error" not in err  # it printed "error:  (see ...)" with an empty message, exit 2


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


def test_recipes_cp_copies_to_a_file_or_into_a_folder(tmp_path, capsys):
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
