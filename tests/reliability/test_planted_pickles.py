"""A pickle planted where difftrain reads weights is refused, never executed.

The payload is an object whose `__reduce__` opens (creates) a marker file when unpickled: if
the marker ever appears, code ran. It is planted as a resume checkpoint (listed in the index
with its true checksum, as an attacker who rewrote the index would; or unlisted, with the
index gone), as last.ckpt, and as model.safetensors read by generate, eval, export and
finetune — both as a torch zip checkpoint and as a raw pickle.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import write_recipe

from difftrain.cli.app import main
from difftrain.recipe import load_recipe
from difftrain.train.checkpoint import find_resume_checkpoint, sha256_file, step_file
from difftrain.train.run import pretrain


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def torch_pickle(path: Path, marker: Path) -> None:
    torch.save({"state_dict": {"x": torch.zeros(1)}, "payload": Payload(marker)}, path)


def raw_pickle(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"global_step": 99, "payload": Payload(marker)}, protocol=2))


KINDS = {"torch-zip": torch_pickle, "raw-pickle": raw_pickle}


def test_the_payload_really_runs_code_when_unpickled(tmp_path):
    """The check has teeth: an unsafe load of the same file creates the marker."""
    marker = tmp_path / "ran"
    torch_pickle(tmp_path / "evil.ckpt", marker)
    torch.load(tmp_path / "evil.ckpt", weights_only=False)
    assert marker.exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp("pickles")
    corpus, cache = shared_data
    recipe = write_recipe(root, "base", steps=4, save_every=2, out=Path("runs"), corpus=corpus, cache=cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        pretrain(load_recipe(recipe))
    return recipe, root / "runs" / "base"


@pytest.fixture()
def run(trained, tmp_path, monkeypatch):
    recipe, src = trained
    monkeypatch.chdir(tmp_path)
    dest = tmp_path / "runs" / "base"
    shutil.copytree(src, dest)
    return recipe, dest


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_pickle_listed_in_the_index_is_refused_on_resume(run, tmp_path, kind, capsys):
    recipe, run_dir = run
    marker = tmp_path / "ran"
    planted = run_dir / "checkpoints" / step_file(6)
    KINDS[kind](planted, marker)
    index_path = run_dir / "checkpoints" / "index.json"
    index = json.loads(index_path.read_text())
    index["checkpoints"].append({"file": planted.name, "step": 6, "sha256": sha256_file(planted), "bytes": 1})
    index_path.write_text(json.dumps(index))
    assert main(["pretrain", str(recipe), "--resume", "train.max_steps=8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{planted.name} cannot be loaded safely" in err and "Traceback" not in err
    assert not marker.exists()


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_unlisted_pickle_is_skipped_with_a_warning_and_removed(run, tmp_path, kind, capsys):
    """Without an index, step files are tried newest first with weights_only loading: the
    planted one fails to load, the run resumes from the newest real one, and the next save
    prunes the planted file."""
    recipe, run_dir = run
    marker = tmp_path / "ran"
    planted = run_dir / "checkpoints" / step_file(9)
    KINDS[kind](planted, marker)
    (run_dir / "checkpoints" / "index.json").unlink()
    point = find_resume_checkpoint(run_dir / "checkpoints")
    assert point.step == 4 and "cannot be loaded" in point.warnings[0]
    assert main(["pretrain", str(recipe), "--resume", "train.max_steps=5", "--no-progress"]) == 0
    assert f"{planted.name} cannot be loaded" in capsys.readouterr().err
    assert not planted.exists() and not marker.exists()


def test_a_pickle_as_last_ckpt_is_never_read(run, tmp_path):
    _, run_dir = run
    marker = tmp_path / "ran"
    last = run_dir / "checkpoints" / "last.ckpt"
    last.unlink()
    torch_pickle(last, marker)
    assert find_resume_checkpoint(run_dir / "checkpoints").step == 4
    (run_dir / "checkpoints" / "index.json").unlink()
    assert find_resume_checkpoint(run_dir / "checkpoints").step == 4
    assert not marker.exists()


def _finetune_recipe(tmp_path: Path, base: Path) -> Path:
    p = tmp_path / "ft.yaml"
    p.write_text(
        f"name: ft\nfinetune: {{base: {base}, method: lora}}\n"
        f"data: {{sources: [{tmp_path / 'corpus'}], val_windows: 0}}\n"
        "train: {max_steps: 1, micro_batch_size: 2}\nlogging: {progress: false, tensorboard: false}\n"
    )
    (tmp_path / "corpus").mkdir(exist_ok=True)
    (tmp_path / "corpus" / "a.py").write_text("def f():\n    return 1\n" * 20)
    return p


COMMANDS = {
    "generate": lambda t, r: ["generate", str(r), "--prompt", "def", "--max-new-tokens", "2"],
    "eval": lambda t, r: ["eval", str(r), "--suite", "ppl"],
    "export": lambda t, r: ["export", str(r), str(t / "hf")],
    "finetune": lambda t, r: ["finetune", str(_finetune_recipe(t, r)), "--no-progress"],
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_pickle_as_model_safetensors_is_refused_by_every_command(run, tmp_path, kind, command, capsys):
    _, run_dir = run
    marker = tmp_path / "ran"
    KINDS[kind](run_dir / "model.safetensors", marker)
    assert main(COMMANDS[command](tmp_path, run_dir)) == 2
    err = capsys.readouterr().err
    assert "model.safetensors is damaged or not a safetensors file" in err and "Traceback" not in err
    assert not marker.exists()
