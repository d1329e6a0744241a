"""Fixtures shared by the test files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest


@pytest.fixture()
def cli_probe():
    """Runs difftrain commands one after another in a fresh Python process, as a user's shell
    would (nothing imported yet): `probe(commands, cwd, modules, prelude)` → .codes (each command's
    exit code), .loaded (which of `modules` the commands imported), .stdout, .stderr. `prelude`:
    Python run first (e.g. to stand in for the machine)."""

    def probe(
        commands: list[list[str]], cwd: Path, modules: tuple[str, ...] = ("torch",), prelude: str = ""
    ) -> SimpleNamespace:
        script = (
            f"import json, sys\n{prelude}\nfrom difftrain.cli.app import main\n"
            f"codes = [main(c) for c in {commands!r}]\n"
            f"print(json.dumps([codes, [m for m in {list(modules)!r} if m in sys.modules]]))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, timeout=300
        )
        lines = done.stdout.strip().splitlines()
        assert done.returncode == 0 and lines, done.stdout + done.stderr
        codes, loaded = json.loads(lines[-1])
        return SimpleNamespace(codes=codes, loaded=loaded, stdout=done.stdout, stderr=done.stderr)

    return probe


@pytest.fixture()
def metaspace_tokenizer():
    """A tiny SentencePiece-style tokenizer (Metaspace pieces, as Llama-2's and Mistral's): "▁world"
    starts a word, and decoded alone the decoder drops the space of a text's first piece."""
    import tokenizers

    from difftrain.data.tokenizer import Tokenizer

    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, "▁Hello": 3, "▁world": 4, "!": 5, "▁again": 6}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tk.decoder = tokenizers.decoders.Metaspace()
    tk.add_special_tokens(["<unk>", "</s>", "<s>"])
    return Tokenizer(tk)
