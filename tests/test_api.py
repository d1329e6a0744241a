"""The Python names `import difftrain` offers: loaded lazily, and the README's example runs as
written on a run directory, giving what `difftrain generate` gives."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_generate_cli import gen, make_run

import difftrain

README = Path(__file__).resolve().parents[1] / "README.md"


def test_import_difftrain_loads_no_torch_and_every_exported_name_resolves():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, difftrain; print('torch' in sys.modules, sorted(difftrain.__all__))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.startswith("False ")
    assert set(difftrain.__all__) == {"__version__", *difftrain._EXPORTS}
    for name in difftrain.__all__:
        assert getattr(difftrain, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        difftrain.nope  # noqa: B018


def test_the_readme_python_example_runs_and_matches_generate(tmp_path, capsys, monkeypatch):
    section = README.read_text().split("## Use from Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    run = make_run(tmp_path / "runs" / "quickstart")
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(code, "README.md", "exec"), names)  # noqa: S102 - the README's own example
    printed = capsys.readouterr().out
    assert names["logits"].shape == (1, len(names["ids"]), names["run"].config.vocab_size)
    for inline in re.findall(r"`(difftrain\.(?:Transformer|load_recipe)\(.*?\))`", section):
        assert eval(inline, {"difftrain": difftrain}) is not None, inline  # noqa: S307 - the README's own
    assert dir(difftrain) == sorted(difftrain.__all__)
    rc, out, _ = gen(capsys, run, "--prompt", "def add(a, b):", "--greedy", "-n", 32)
    assert rc == 0 and out == "def add(a, b):" + printed  # the comment's claim: the CLI's completion
