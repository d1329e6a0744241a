"""`difftrain generate` end to end on a tiny run directory: streaming, JSON, prompt files, REPL, errors."""

from __future__ import annotations

import builtins
import io
import json
import os

import pytest
import torch

from difftrain.cli.app import main
from difftrain.data.config import TokenizerTrainConfig
from difftrain.data.tokenizer import train_tokenizer
from difftrain.errors import DataError
from difftrain.model import ModelConfig, Transformer
from difftrain.rundir import save_weights

TEXTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n"] * 10 + [
    "hello world, the quick brown fox"
] * 10


def make_run(path, *, vocab_size: int | None = None, weights: bool = True, arch: str = "diff"):
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(TEXTS, TokenizerTrainConfig(vocab_size=300))
    tok.save(path / "tokenizer.json")
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch=arch,
        vocab_size=vocab_size or tok.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        max_seq_len=64,
        init_std=0.2,
    )
    cfg.to_json(path / "config.json")
    if weights:
        save_weights(path / "model.safetensors", Transformer(cfg))
    else:
        (path / "recipe.yaml").write_text("name: x\n")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("runs") / "tiny")


def gen(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def json_results(capsys, *args) -> list[dict]:
    code, out, err = gen(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)["results"]


def test_generate_streams_prompt_and_completion_then_a_footer(run_dir, capsys):
    code, out, err = gen(capsys, run_dir, "--prompt", "def f(n):", "--max-new-tokens", 8, "--seed", 1)
    assert code == 0, err
    assert out.startswith("def f(n):")
    assert "tokens/s" in err and "seed 1" in err


def test_json_output_parses_and_holds_every_prompt_times_samples(run_dir, capsys):
    code, out, _ = gen(
        capsys, run_dir, "-p", "hello", "-p", "def", "--num-samples", 2, "-n", 6, "--seed", 3, "--json"
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["settings"]["seed"] == 3 and doc["arch"] == "diff"
    res = doc["results"]
    assert [(r["prompt"], r["sample"], r["seed"]) for r in res] == [
        ("hello", 0, 3),
        ("hello", 1, 4),
        ("def", 0, 5),
        ("def", 1, 6),
    ]
    for r in res:
        assert 1 <= r["completion_tokens"] == len(r["token_ids"]) <= 6
        assert r["finish_reason"] in ("eos", "length")
        assert r["tokens_per_s"] > 0
    assert doc["total"]["completion_tokens"] == sum(r["completion_tokens"] for r in res)
    assert doc["settings"]["temperature"] == 0.8 and doc["settings"]["stop"] == []
    # greedy: the settings it does not use are null, not a random seed and a temperature; a --stop
    # spelled with \n (as --prompt is) is a newline
    code, out, _ = gen(capsys, run_dir, "-p", "def", "-n", 4, "--greedy", "--stop", r"\n", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["settings"]["stop"] == ["\n"] and doc["settings"]["greedy"] is True
    assert [doc["settings"][k] for k in ("temperature", "top_k", "top_p", "min_p", "seed")] == [None] * 5
    assert doc["results"][0]["seed"] is None


def test_a_seed_reproduces_the_samples_streamed_or_batched(run_dir, capsys):
    args = (run_dir, "-p", "hello", "-p", "def fib", "--num-samples", 2, "-n", 10, "--seed", 5)
    first = json_results(capsys, *args)
    again = json_results(capsys, *args, "--batch-size", 1)
    assert [r["token_ids"] for r in first] == [r["token_ids"] for r in again]
    code, out, _ = gen(capsys, *args)  # streamed one by one: the same text
    assert code == 0
    for r in first:
        assert r["prompt"] + r["completion"] in out
    rules = [line for line in out.splitlines() if "· sample " in line]
    assert len(rules) == 4 and all(len(line) <= 80 for line in rules)  # piped: 80 columns, not 1000
    other = json_results(capsys, *args[:-1], 6)
    assert [r["token_ids"] for r in other] != [r["token_ids"] for r in first]


def test_greedy_no_stream_prints_the_same_completion_as_json(run_dir, capsys):
    (r,) = json_results(capsys, run_dir, "-p", "the quick", "--greedy", "-n", 12)
    code, out, err = gen(capsys, run_dir, "-p", "the quick", "--greedy", "-n", 12, "--no-stream")
    assert code == 0
    assert out == "the quick" + r["completion"] + "\n"
    assert "tokens/s" in err and "compiling" not in err


def test_compiled_greedy_generation_prints_the_eager_completion(run_dir, capsys):
    (r,) = json_results(capsys, run_dir, "-p", "the quick", "--greedy", "-n", 12)
    # figures that include a compilation (seconds, where a token takes milliseconds) say so
    code, out, err = gen(capsys, run_dir, "-p", "the quick", "--greedy", "-n", 12, "--compile", "--no-stream")
    assert code == 0 and out == "the quick" + r["completion"] + "\n"
    assert "s (incl. compiling the decode step)" in err
    (c,) = json_results(capsys, run_dir, "-p", "the quick", "--greedy", "-n", 12, "--compile")
    assert c["token_ids"] == r["token_ids"] and c["completion"] == r["completion"]
    # the same shapes again: compiled already, and the footer does not claim a compilation
    code, _, err = gen(capsys, run_dir, "-p", "the quick", "--greedy", "-n", 12, "--compile", "--no-stream")
    assert code == 0 and "compiling" not in err


def test_compile_without_a_cpu_compiler_exits_2_before_loading(run_dir, capsys, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/bin/g++")
    code, _, err = gen(capsys, run_dir, "-p", "x", "--compile", "--device", "cpu")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--compile on CPU needs a C++ compiler (/nonexistent/bin/g++ on PATH)" in err
    assert "or leave out the option" in err


def test_prompt_file_of_lines_and_jsonl(run_dir, tmp_path, capsys, monkeypatch):
    lines = tmp_path / "prompts.txt"
    lines.write_text("first prompt\n\nsecond\\n prompt\n")
    res = json_results(capsys, run_dir, "--prompt-file", lines, "-n", 2, "--seed", 0)
    assert [(r["prompt"], r["source"]) for r in res] == [
        ("first prompt", f"{lines}, line 1"),
        ("second\\n prompt", f"{lines}, line 3"),  # file lines are literal
    ]
    records = tmp_path / "prompts.jsonl"
    records.write_text(json.dumps({"prompt": "a\nb", "id": 1}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    res = json_results(capsys, run_dir, "--prompt-file", records, "-n", 2)
    assert [r["prompt"] for r in res] == ["a\nb", "c"]
    assert res[0]["record"] == {"id": 1} and "record" not in res[1]  # the line's other fields come back
    assert "record" not in json_results(capsys, run_dir, "-p", "x", "-n", 1)[0]
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n\nsecond\n"))
    res = json_results(capsys, run_dir, "--prompt-file", "-", "-n", 2, "--seed", 0)
    assert [(r["prompt"], r["source"]) for r in res] == [
        ("from stdin", "stdin, line 1"),
        ("second", "stdin, line 3"),
    ]


def test_escapes_in_prompt_become_newlines(run_dir, capsys):
    (r,) = json_results(capsys, run_dir, "-p", "def f(n):\\n    return", "-n", 1)
    assert r["prompt"] == "def f(n):\n    return"


def test_no_prompt_samples_a_document_from_the_separator(run_dir, capsys):
    (r,) = json_results(capsys, run_dir, "-n", 3, "--seed", 2)
    assert r["prompt"] == "" and r["prompt_tokens"] == 1


def test_a_full_context_stops_generation_with_a_note(run_dir, capsys):
    prompt = "hello world " * 9  # 54 tokens (+ the leading eos) of a 64-token context
    code, _, err = gen(capsys, run_dir, "-p", prompt, "-n", 200, "--greedy")
    assert code == 0
    (r,) = json_results(capsys, run_dir, "-p", prompt, "-n", 200, "--greedy")
    assert r["finish_reason"] == "context"
    assert (r["prompt_tokens"], r["completion_tokens"]) == (55, 64 - 55 + 1)
    assert "context is full" in err


def test_interactive_ctrl_c_interrupts_a_generation_without_quitting(run_dir, capsys, monkeypatch):
    inputs = iter(
        [
            "hello",
            KeyboardInterrupt,
            "/set top_p 2",
            "/bogus",
            "/set temperature 0.5",
            "/set greedy maybe",
            "/show",
            "/set greedy on",
            "/show",
            "/set greedy off",
            "/set max_new_tokens 3.5",
            "/set temperature hot",
            "def",
            "/quit",
        ]
    )

    def fake_input(prompt=""):
        x = next(inputs)
        if x is KeyboardInterrupt:
            raise KeyboardInterrupt
        return x

    calls = {"n": 0}
    forward = Transformer.forward

    def interrupting_forward(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # in the middle of the first generation
            raise KeyboardInterrupt
        return forward(self, *a, **kw)

    monkeypatch.setattr(builtins, "input", fake_input)
    monkeypatch.setattr(Transformer, "forward", interrupting_forward)
    code, out, err = gen(capsys, run_dir, "--interactive", "-n", 4, "--seed", 0)
    assert code == 0
    assert "interrupted" in err
    assert "top_p=2.0 is outside (0, 1]" in err
    assert "unknown command /bogus; /help lists the commands" in err  # not sent to the model
    # /show: the settings as /set names them, the one just set included
    assert "max_new_tokens=4 greedy=false temperature=0.5 top_k=50 top_p=0.95" in err and "seed=0" in err
    assert "greedy: 'maybe' is not on or off; use /set greedy on (or off)" in err  # left unchanged
    assert (
        "max_new_tokens: '3.5' is not a whole number" in err and "temperature: 'hot' is not a number" in err
    )
    assert (
        "(temperature = 0.5)" in err and "(greedy = on)" in err and "(greedy = off)" in err
    )  # each /set says so
    assert "max_new_tokens=4 greedy=true temperature=0.5" in err
    assert err.count("tokens/s") == 1  # the second prompt ran to its end
    assert "def" in out
    assert calls["n"] > 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "hello world " * 40], "has max_seq_len=64; shorten it by at least"),
        (["--top-p", "1.5"], "top_p=1.5 is outside (0, 1]"),
        (["--top-p", "0"], "top_p=0.0 is outside (0, 1]"),
        (["--temperature", "-1"], "temperature=-1.0 is invalid"),
        (["--num-samples", "0"], "--num-samples 0 must be ≥ 1"),
        (["--max-new-tokens", "0"], "max_new_tokens=0"),
        (["--stop", ""], "a stop string is empty"),
        (["--prompt", "a", "--interactive"], "--interactive reads prompts from the keyboard"),
        (["--dtype", "float8"], "--dtype 'float8' is unknown"),
        (["--compile", "--no-cache"], "--compile runs the cached decode step; leave out --no-cache"),
        (["--seed", str(10**20)], f"--seed {10**20} is out of range; use a whole number from 0 to 2^62"),
        (["--seed", "-1"], "--seed -1 is out of range"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(run_dir, capsys, args, message):
    code, out, err = gen(capsys, run_dir, *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert message in err


def test_bad_prompt_files_exit_2_with_the_line(run_dir, tmp_path, capsys, monkeypatch):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    code, _, err = gen(capsys, run_dir, "--prompt-file", f)
    assert code == 2 and f'{f}, line 2: no "prompt" field' in err
    f.write_text('{"prompt": "ok"}\n{"prompt": \n')
    code, _, err = gen(capsys, run_dir, "--prompt-file", f)
    assert code == 2 and f"{f}, line 2: invalid JSON (Expecting value at column 12)" in err
    code, _, err = gen(capsys, run_dir, "--prompt-file", tmp_path / "missing.txt")
    assert code == 2 and "does not exist" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, _, err = gen(capsys, run_dir, "--prompt-file", empty)
    assert code == 2 and "holds no prompts" in err
    code, _, err = gen(capsys, run_dir, "--prompt-file", empty, "--prompt", "x")
    assert code == 2 and "not both" in err
    with monkeypatch.context() as m:  # `-` reads standard input, plain lines
        m.setattr("sys.stdin", io.StringIO("\n \n"))
        code, _, err = gen(capsys, run_dir, "--prompt-file", "-")
    assert code == 2 and "--prompt-file - (standard input) holds no prompts" in err


def test_text_that_is_not_utf8_is_one_line_naming_where_it_came_from(run_dir, tmp_path, capsys, monkeypatch):
    # bytes that are not UTF-8 reach Python as lone surrogates (argv, stdin), and so does half
    # an emoji escaped in JSON: the tokenizer cannot encode them (it raised a TypeError)
    code, _, err = gen(capsys, run_dir, "--prompt", "bad \udcff bytes")  # as Python decodes b"\xff"
    assert code == 2 and "--prompt: byte 0xff at character 5 is not UTF-8 text; give UTF-8 text" in err
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "half \\ud83d"}\n')
    code, _, err = gen(capsys, run_dir, "--prompt-file", f)
    assert code == 2 and f"{f}, line 2: a lone surrogate U+D83D at character 6 is not UTF-8 text" in err
    with monkeypatch.context() as m:
        m.setattr("sys.stdin", io.StringIO("x \udcff y\n"))
        code, _, err = gen(capsys, run_dir, "--prompt-file", "-")
    assert code == 2 and "stdin, line 1: byte 0xff at character 3" in err
    # typed at the prompt: said, and read again (the session goes on)
    from difftrain.cli import generate as g

    bom = tmp_path / "bom.txt"  # a byte-order mark is not the first prompt's first character
    bom.write_bytes("\ufeffEmoji one\r\nsecond\r\n".encode())
    assert [p.text for p in g.read_prompt_file(bom)] == ["Emoji one", "second"]
    typed = iter(["bad \udcff", "good"])
    monkeypatch.setattr("builtins.input", lambda marker="": next(typed))
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    assert g._read_prompt() == "good"
    assert "byte 0xff at character 5 is not UTF-8 text; type it again" in capsys.readouterr().err
    # piped into the REPL: nobody can type it again; refused as --prompt-file - refuses it
    typed = iter(["bad \udcff", "good"])
    monkeypatch.setattr("sys.stdin.isatty", lambda: False, raising=False)
    with pytest.raises(DataError, match="standard input: byte 0xff at character 5 is not UTF-8 text"):
        g._read_prompt()


def test_a_run_without_weights_or_checkpoints_says_to_start_it_again(tmp_path, capsys):
    # it said "resume it with ... --resume", which resume refuses: there is nothing to resume
    run = make_run(tmp_path / "unfinished", weights=False)
    code, _, err = gen(capsys, run, "--prompt", "x")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "has no model.safetensors and no checkpoint" in err
    assert (
        f"start it again with `difftrain pretrain {run / 'recipe.yaml'} --overwrite`" in err
        and "--resume" not in err
    )


def test_a_run_still_training_is_not_told_to_resume(tmp_path, capsys):
    from difftrain.io import RunLock

    run = make_run(tmp_path / "training", weights=False)
    lock = RunLock(run)
    assert lock.acquire() is None  # as pretrain holds it (another open file: flock conflicts)
    try:
        code, _, err = gen(capsys, run, "--prompt", "x")
    finally:
        lock.release()
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"is still training (pid {os.getpid()})" in err and "--resume" not in err


def test_the_resume_advice_names_the_command_that_trained_the_run(tmp_path):
    from difftrain.errors import CheckpointError, RunDirError
    from difftrain.rundir import read_safetensors, require_weights

    run = tmp_path / "run dir"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000004.ckpt").write_bytes(b"x")
    # a run's recipe.yaml lists every section: a pretraining run's holds `finetune: null`
    for recipe, command in (
        ("finetune: null\nname: a\n", "pretrain"),
        ("finetune:\n  base: runs/a\n", "finetune"),
    ):
        (run / "recipe.yaml").write_text(recipe)
        with pytest.raises(RunDirError) as e:
            require_weights(run)
        assert f"`difftrain {command} '{run / 'recipe.yaml'}' --resume`" in str(e.value)
        (run / "adapter.safetensors").write_bytes(b"damaged")
        with pytest.raises(CheckpointError) as e:  # damaged weights (a LoRA run's adapter)
            read_safetensors(run / "adapter.safetensors")
        assert f"`difftrain {command} '{run / 'recipe.yaml'}' --resume`" in str(e.value)
        with pytest.raises(RunDirError, match="has adapter.safetensors but no adapter.json"):
            require_weights(run)  # a LoRA run never has model.safetensors: its lost adapter.json is named
        (run / "adapter.safetensors").unlink()


def test_a_tokenizer_from_another_run_is_refused(tmp_path, capsys):
    run = make_run(tmp_path / "mismatch", vocab_size=200)
    code, _, err = gen(capsys, run, "--prompt", "x")
    assert code == 2 and "tokenizer belongs to another run" in err


def test_a_missing_run_directory_is_an_error(tmp_path, capsys):
    code, _, err = gen(capsys, tmp_path / "nope", "--prompt", "x")
    assert code == 2 and "no run directory" in err


def test_a_run_name_points_to_its_folder_under_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    code, _, err = gen(capsys, "quickstart", "--prompt", "x")
    assert code == 2 and "no run directory quickstart; did you mean runs/quickstart?" in err
    code, _, err = gen(capsys, "other", "--prompt", "x")
    assert code == 2 and "did you mean" not in err and "train one with" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when no GPU is present")
def test_asking_for_cuda_without_a_gpu_is_an_error(run_dir, capsys):
    code, _, err = gen(capsys, run_dir, "--device", "cuda", "--prompt", "x")
    assert code == 2 and "no CUDA GPU is visible" in err


# ----- how fine-tuned runs read prompts, and chat ------------------------------------------------
def finetuned_run(path, finetune: dict):
    import yaml

    make_run(path)
    (path / "recipe.yaml").write_text(yaml.safe_dump({"name": "ft", "finetune": finetune}))
    return path


def test_a_pretrained_run_reads_the_prompt_after_the_document_separator(run_dir, capsys):
    from difftrain.data.tokenizer import load_tokenizer

    tok = load_tokenizer(run_dir / "tokenizer.json")
    (r,) = json_results(capsys, run_dir, "-p", "def f", "-n", 1)
    assert r["prompt_tokens"] == 1 + len(tok.encode("def f"))


def test_an_instruction_tuned_run_reads_its_prompt_format_without_a_leading_token(tmp_path, capsys):
    from difftrain.data.tokenizer import load_tokenizer

    run = finetuned_run(
        tmp_path / "ft", {"data_format": "instruction", "prompt_format": "Q: {prompt}\nA ({lang}):"}
    )
    tok = load_tokenizer(run / "tokenizer.json")
    code, _, err = gen(capsys, run, "-p", "hello", "--json")
    assert code == 2 and "needs the field 'lang'" in err and ".jsonl --prompt-file" in err
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hello", "lang": "en"}) + "\n")
    (r,) = json_results(capsys, run, "--prompt-file", f, "-n", 1)
    assert r["prompt_tokens"] == len(tok.encode("Q: hello\nA (en):"))
    code, out, _ = gen(capsys, run, "--prompt-file", f, "-n", 1)
    assert code == 0 and out.startswith("Q: hello\nA (en):")


def test_a_text_finetune_still_reads_documents(tmp_path, capsys):
    run = finetuned_run(tmp_path / "cont", {"data_format": "text", "prompt_format": "Q: {prompt}"})
    (r,) = json_results(capsys, run, "-p", "hello", "-n", 1)
    assert r["prompt"] == "hello"
    code, out, _ = gen(capsys, run, "-p", "hello", "-n", 1)
    assert out.startswith("hello")


def test_the_repl_reader_sends_a_message_cut_by_the_end_of_input_and_marks_only_a_terminal(monkeypatch):
    from difftrain.cli import generate as g

    shown: list[str] = []

    def typed(lines):
        it = iter(lines)

        def fake_input(marker=""):
            shown.append(marker)
            x = next(it)
            if x is EOFError:
                raise EOFError
            return x

        return fake_input

    # Ctrl-D (or the end of piped input) at a continuation line: the message typed so far is sent
    monkeypatch.setattr("builtins.input", typed(["line one \\", EOFError]))
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    assert g._read_prompt("you » ") == "line one "
    assert shown == ["you » ", "… "]
    # piped input: no markers written to the output (a transcript is replies, not "you » " per line)
    shown.clear()
    monkeypatch.setattr("sys.stdin.isatty", lambda: False, raising=False)
    monkeypatch.setattr("builtins.input", typed(["a \\", "b"]))
    assert g._read_prompt("you » ") == "a \nb" and shown == ["", ""]

    # the reader of the output gone (`| head`): the session ends as at the end of input
    def gone(marker=""):
        raise BrokenPipeError

    monkeypatch.setattr("builtins.input", gone)
    with pytest.raises(EOFError):
        g._read_prompt()
    # an output already closed (the console went quiet after its first failed write): the session
    # ends before reading on, instead of answering every line into /dev/null
    monkeypatch.setattr("builtins.input", typed(["hello"]))
    monkeypatch.setattr(g.console, "quiet", True)
    with pytest.raises(EOFError):
        g._read_prompt()
    monkeypatch.setattr(g.console, "quiet", False)
    monkeypatch.setattr("builtins.input", typed(["\ufeffhello"]))  # a byte-order mark is no part of it
    assert g._read_prompt() == "hello"


def test_chat_renders_the_conversation_streams_replies_until_end_and_resets(tmp_path, capsys, monkeypatch):
    from difftrain.data.tokenizer import load_tokenizer

    run = finetuned_run(tmp_path / "chat", {"data_format": "instruction"})
    tok = load_tokenizer(run / "tokenizer.json")
    end = tok.token_to_id("<|end|>")
    script = tok.encode("hi there") + [end, 5, 6]
    prompts: list[str] = []
    state = {"step": 0}
    forward = Transformer.forward

    def scripted_forward(self, ids, *a, **kw):  # the real model, with its choices overridden
        out = forward(self, ids, *a, **kw)
        if ids.shape[1] > 1:  # a prefill: a new reply starts
            prompts.append(tok.decode(ids[0].tolist()))
            state["step"] = 0
        out.logits[:, -1] = -1e9
        out.logits[:, -1, script[state["step"]]] = 1e9
        state["step"] += 1
        return out

    inputs = iter(["hello", "and you?", "/reset", "again", EOFError])

    def fake_input(prompt=""):
        x = next(inputs)
        if x is EOFError:
            raise EOFError
        return x

    monkeypatch.setattr(Transformer, "forward", scripted_forward)
    monkeypatch.setattr(builtins, "input", fake_input)
    code, out, err = gen_chat(capsys, run, "--system", "be brief", "--seed", 0)
    assert code == 0, err
    turn1 = "<|system|>\nbe brief<|end|>\n<|user|>\nhello<|end|>\n<|assistant|>\n"
    turn2 = turn1 + "hi there<|end|>\n<|user|>\nand you?<|end|>\n<|assistant|>\n"
    turn3 = "<|system|>\nbe brief<|end|>\n<|user|>\nagain<|end|>\n<|assistant|>\n"
    assert prompts == [turn1, turn2, turn3]
    assert out.count("hi there\n") == 3 and "<|end|>" not in out
    assert err.count("stopped: end of reply (<|end|>)") == 3


def test_chat_notes_a_run_fine_tuned_on_prompt_response_records(tmp_path, capsys, monkeypatch):
    def eof(prompt=""):
        raise EOFError

    monkeypatch.setattr(builtins, "input", eof)
    note = "fine-tuned on prompt/response records, not `messages`"
    for kinds, noted in (
        (["prompt/response"], True),
        (["messages"], False),
        (["messages", "prompt/response"], False),
    ):
        run = finetuned_run(tmp_path / "-".join(k[0] for k in kinds), {"data_format": "instruction"})
        (run / "summary.json").write_text(json.dumps({"record_kinds": kinds}))
        code, _, err = gen_chat(capsys, run, "--seed", 0)
        assert code == 0 and (note in err) == noted, (kinds, err)
    (run / "summary.json").write_text("{not json")  # an unreadable summary: no note, no error
    code, _, err = gen_chat(capsys, run, "--seed", 0)
    assert code == 0 and note not in err


def test_generate_points_a_run_tuned_on_messages_only_to_chat(tmp_path, capsys):
    note = "fine-tuned on `messages` records only: `difftrain chat"
    for kinds, noted in (
        (["messages"], True),
        (["messages", "prompt/response"], False),
        (["prompt/response"], False),
    ):
        run = finetuned_run(tmp_path / "-".join(k[0] for k in kinds), {"data_format": "instruction"})
        (run / "summary.json").write_text(json.dumps({"record_kinds": kinds}))
        code, _, err = gen(capsys, run, "-p", "hello", "-n", 2, "--seed", 0)
        assert code == 0 and (note in err) == noted, (kinds, err)


def gen_chat(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["chat", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_chat_drops_the_oldest_exchanges_whole_to_fit_the_context_and_keeps_the_system_message():
    from types import SimpleNamespace

    from difftrain.errors import DataError
    from difftrain.infer.chat import Chat

    roles = {"system": "S{content}|", "user": "U{content}|", "assistant": "A{content}<|end|>"}
    chat = Chat(SimpleNamespace(roles=roles), "sys")
    chars = SimpleNamespace(encode=lambda text: list(text))  # one token per character

    def say(*turns):
        chat.messages[:] = [{"role": r, "content": c} for r, c in turns]

    say(("user", "aaaa"), ("assistant", "bbbb"), ("user", "cc"), ("assistant", "dd"), ("user", "e"))
    whole = chat.render()
    assert chat.fit(chars, len(whole) + 1) == (whole, list(whole), 0)  # fits: nothing dropped
    text, ids, dropped = chat.fit(chars, len(whole))  # one token short: the first exchange goes
    assert dropped == 2 and text.startswith("Ssys|Ucc|") and ids == list(text)
    assert [m["content"] for m in chat.messages] == ["cc", "dd", "e"]
    say(("user", "aaaa"), ("assistant", "bbbb"), ("user", "cc"), ("assistant", "dd"), ("user", "e"))
    text, _, dropped = chat.fit(chars, len(whole) + 1, room=25)  # the reply's room: both exchanges go
    assert dropped == 4 and text == "Ssys|Ue|A" and [m["content"] for m in chat.messages] == ["e"]
    assert chat.fit(chars, len(text) + 1, room=25) == (text, list(text), 0)  # the newest alone: 1 suffices
    say(("user", "x" * 50))
    with pytest.raises(DataError, match="the context is 20: shorten it"):
        chat.fit(chars, 20)
    assert chat.messages == []  # the message that cannot fit is taken back
    # ... and the conversation before it is kept whole, not emptied while trying to make room
    say(("user", "aaaa"), ("assistant", "bbbb"), ("user", "x" * 50))
    with pytest.raises(DataError, match="the conversation before it is kept"):
        chat.fit(chars, 30)
    assert [m["content"] for m in chat.messages] == ["aaaa", "bbbb"]
    # `unseen` counts every message dropped so far, across turns
    chat.unseen = 0
    say(("user", "aaaa"), ("assistant", "bbbb"), ("user", "cc"), ("assistant", "dd"), ("user", "e"))
    assert chat.fit(chars, len(whole))[2] == 2 and chat.unseen == 2
    chat.messages += [{"role": "assistant", "content": "ff"}, {"role": "user", "content": "g"}]
    assert chat.fit(chars, len(chat.render()) - 1)[2] == 2 and chat.unseen == 4


def test_ctrl_c_during_a_generation_exits_130_with_one_line(run_dir, capsys, monkeypatch):
    import os
    import signal

    calls = {"n": 0}
    forward = Transformer.forward

    def interrupted_forward(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # a real SIGINT, as a terminal's Ctrl-C sends it
            os.kill(os.getpid(), signal.SIGINT)
        return forward(self, *a, **kw)

    monkeypatch.setattr(Transformer, "forward", interrupted_forward)
    code, _, err = gen(capsys, run_dir, "--prompt", "def", "-n", 50, "--seed", 0)
    assert code == 130
    assert err.strip().splitlines()[-1] == "error: interrupted (Ctrl-C)"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # main put Python's back


def test_sigterm_during_an_interactive_generation_ends_the_command(run_dir, capsys, monkeypatch):
    """Ctrl-C in the REPL only stops the reply; a SIGTERM (`kill`, a scheduler) must end the
    process, with one line and exit 143, not be taken for a Ctrl-C and wait for the next prompt."""
    import builtins
    import os
    import signal

    calls = {"n": 0}
    forward = Transformer.forward

    def terminated_forward(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, *a, **kw)

    prompts = iter(["def", "class"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(prompts))
    monkeypatch.setattr(Transformer, "forward", terminated_forward)
    code, _, err = gen(capsys, run_dir, "--interactive", "-n", 20, "--seed", 0)
    assert code == 143 and err.strip().splitlines()[-1] == "error: interrupted (SIGTERM)"
    assert next(prompts) == "class"  # the REPL did not read another prompt
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_chat_refuses_a_system_message_that_fills_the_context(tmp_path, capsys, monkeypatch):
    # every user message was refused as too long ("the message is 612 tokens"): the message was "hi"
    monkeypatch.setattr(builtins, "input", lambda prompt="": "hi")
    run = finetuned_run(tmp_path / "ft", {"data_format": "instruction"})
    code, _, err = gen_chat(capsys, run, "--system", "word " * 200, "--seed", 0)
    assert code == 2 and "--system is" in err and "tokens with the template; the context is 64" in err


def test_a_run_name_without_runs_is_refused_before_torch_loads_by_every_command(tmp_path, cli_probe):
    # `difftrain eval quickstart` for runs/quickstart: the usual slip, answered at once (no 3-8 s
    # of torch and Lightning loading first) by each command that reads a run directory
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    commands = [
        ["generate", "quickstart", "--prompt", "x"],
        ["eval", "quickstart"],
        ["eval", "quickstart", "--suite", "ppl", "--data", "builtin:python-stdlib"],
        ["merge", "quickstart"],
        ["export", "quickstart", "--format", "hf", "out"],
        ["compare", "quickstart", "runs/quickstart"],
    ]
    done = cli_probe(commands, tmp_path)
    assert done.codes == [2] * len(commands) and done.loaded == [], done.stderr
    errors = done.stderr.strip().splitlines()
    assert errors == [
        "error: no run directory quickstart; did you mean runs/quickstart? (runs live under runs/)"
    ] * len(commands), errors


def test_option_mistakes_and_a_folder_without_a_model_are_refused_before_torch_loads(tmp_path, cli_probe):
    # each of these says what is wrong without waiting seconds for torch to load
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "model.safetensors").write_bytes(b"")  # the options are refused before it is read
    (tmp_path / "runs" / "empty").mkdir()
    mistakes = {
        ("generate", "runs/r", "--top-p", "0"): "top_p=0.0 is outside (0, 1]",
        ("generate", "runs/r", "--temperature", "-1"): "temperature=-1.0 is invalid",
        ("generate", "runs/r", "-n", "0"): "max_new_tokens=0 must be a whole number ≥ 1",
        ("generate", "runs/r", "--num-samples", "0"): "--num-samples 0 must be ≥ 1",
        ("generate", "runs/r", "--no-cache", "--compile"): "--compile runs the cached decode step",
        ("generate", "runs/r", "--interactive", "-p", "hi"): "--interactive reads prompts from the keyboard",
        ("generate", "runs/r", "--prompt-file", "nope.txt"): "--prompt-file nope.txt does not exist",
        ("generate", "runs/r", "--stop", ""): "a stop string is empty",
        ("chat", "runs/r", "--top-p", "0"): "top_p=0.0 is outside (0, 1]",
        ("eval", "runs/r", "--suite", "perplexity"): "unknown suite `perplexity`",
        ("eval", "runs/r", "--suite", "ppl,needel"): "did you mean `needle`?",
        ("eval", "runs/r", "--windows", "0"): "--windows 0 must be ≥ 1",
        ("eval", "runs/r", "--suite", "quant", "--bits", "1"): "--bits 1 is out of range",
        ("eval", "runs/r", "--data-label", "x"): "--data-label names the results of --data",
        ("generate", "runs/empty"): "runs/empty is not a difftrain run directory (no model.safetensors",
        ("chat", "runs/empty"): "runs/empty is not a difftrain run directory",
        ("eval", "runs/empty"): "runs/empty is not a difftrain run directory",
        ("export", "runs/empty", "out"): "runs/empty is not a difftrain run directory",
    }
    done = cli_probe([list(c) for c in mistakes], tmp_path)
    assert done.codes == [2] * len(mistakes) and done.loaded == [], done.stderr
    errors = done.stderr.strip().splitlines()
    assert len(errors) == len(mistakes), errors
    for (command, says), line in zip(mistakes.items(), errors, strict=True):
        assert line.startswith("error: ") and says in line, (command, line)


@pytest.mark.parametrize(
    ("command", "commands"),
    [
        ("chat", ["/reset", "/set", "/show", "/help", "/quit"]),
        ("generate", ["/set", "/show", "/help", "/quit"]),
    ],
)
def test_help_in_each_repl_lists_its_commands_one_line_each(
    tmp_path, run_dir, capsys, monkeypatch, command, commands
):
    # chat's /help printed `chat --help` (no /set, /show) though its banner and its "unknown
    # command" error send the user to /help for the commands
    printed: list[str] = []  # what the REPL wrote to stderr before each read of the keyboard
    inputs = iter(["/help", "/quit"])

    def fake_input(prompt=""):
        printed.append(capsys.readouterr().err)
        return next(inputs)

    monkeypatch.setattr(builtins, "input", fake_input)
    if command == "chat":
        run = finetuned_run(tmp_path / "chat", {"data_format": "instruction"})
        code = main(["chat", str(run), "--seed", "0"])
    else:
        code = main(["generate", str(run_dir), "--interactive", "--seed", "0"])
    assert code == 0
    help_text = printed[1]  # the answer to /help
    listed = [line.split()[0] for line in help_text.splitlines() if line.lstrip().startswith("/")]
    assert listed == commands, help_text
    assert all(len(line.split()) > 2 for line in help_text.splitlines() if line.lstrip().startswith("/"))
    assert "--" not in help_text.replace("--system", "")  # the REPL's commands, not the options


def _piped(data: bytes):
    """A real pipe holding `data` (closed for writing), as `echo ... |` gives a process."""
    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    return os.fdopen(r, "r")


def test_piped_input_without_prompt_file_is_noted_and_greedy_shows_no_seed(run_dir, capsys, monkeypatch):
    # `echo abc | difftrain generate RUN` generated from nothing and said nothing of the input
    with monkeypatch.context() as m:
        m.setattr("sys.stdin", _piped(b"abc\n"))
        code, _, err = gen(capsys, run_dir, "-n", 3, "-t", 0)
    assert code == 0
    assert "warning: standard input is not read without --prompt-file -" in " ".join(err.split())
    assert "· greedy" in err and "seed" not in err  # greedy decoding draws no random numbers
    with monkeypatch.context() as m:  # nothing piped (end of input at once): nothing to say
        m.setattr("sys.stdin", _piped(b""))
        code, _, err = gen(capsys, run_dir, "-n", 3, "--seed", 4)
    assert code == 0 and "warning" not in err and "seed 4" in err
    code, _, err = gen(capsys, run_dir, "-n", 0)
    assert code == 2 and "e.g. --max-new-tokens 256" in err
