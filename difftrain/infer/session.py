"""A generation `Session`: a loaded run, how it reads prompts (`PromptStyle`) and the generation
settings; every prompt × sample is a `Row` with its own seed, so a sample does not depend on its batch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from difftrain.errors import DataError
from difftrain.infer.generate import Completion, Finished, Token, generate, generate_all, prompt_ids
from difftrain.infer.prompts import Prompt
from difftrain.infer.settings import GenerationConfig
from difftrain.rundir import PromptSettings, prompt_settings


@dataclass(frozen=True)
class PromptStyle(PromptSettings):
    """How a run reads a prompt: a pretrained run as a document (after <|eos|>); an
    instruction-tuned run as its `finetune.prompt_format` filled in, started as in fine-tuning."""

    def render(self, prompt: Prompt) -> str:
        if not self.instruction:
            return prompt.text
        try:
            return self.prompt_format.format_map({**prompt.record, "prompt": prompt.text})
        except KeyError as e:
            raise DataError(
                f"{prompt.where}: this run was fine-tuned with finetune.prompt_format={self.prompt_format!r}, "
                f"which needs the field {e}; give a .jsonl --prompt-file whose records have it"
            ) from None
        except (ValueError, IndexError) as e:
            raise DataError(
                f"finetune.prompt_format={self.prompt_format!r} of this run is not a format: {e}"
            ) from None

    def ids(self, tokenizer: Any, text: str) -> list[int]:
        """Token ids of rendered text (`prompt_ids`); an empty prompt starts a document."""
        return prompt_ids(tokenizer, text, document_start=not (self.instruction and text))


def prompt_style(run_path: Path) -> PromptStyle:
    return PromptStyle(**vars(prompt_settings(run_path)))


@dataclass
class Row:
    """One completion to produce: `text` is what the model reads (rendered prompt), `ids` its tokens."""

    seed: int
    sample: int
    prompt: Prompt
    text: str
    ids: list[int]


@dataclass
class Result:
    row: Row
    completion: Completion

    def to_json(self) -> dict[str, Any]:
        """The fields of `difftrain generate --json`'s results."""
        c, row = self.completion, self.row
        extra = {k: v for k, v in row.prompt.record.items() if k != "prompt"}
        return {
            "prompt": row.prompt.text,
            "source": row.prompt.where,
            "sample": row.sample,
            "seed": row.seed,
            "completion": c.text,
            "prompt_tokens": len(c.prompt_ids),
            "completion_tokens": len(c.token_ids),
            "finish_reason": c.finish_reason,
            "first_token_s": round(c.first_token_s, 6),
            "time_s": round(c.time_s, 6),
            "tokens_per_s": round(c.tokens_per_s, 3),
            "token_ids": c.token_ids,
            **({"record": extra} if extra else {}),
        }


def compiled_graphs() -> int:
    """How many graphs torch.compile has made in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


@dataclass
class Session:
    """A loaded run (`rundir.load_run`) and the generation settings. `rows_done` counts the rows
    generated (or interrupted) so far: seeds keep advancing across turns."""

    run: Any
    gen: GenerationConfig
    style: PromptStyle
    seed: int
    num_samples: int = 1
    batch_size: int = 1
    rows_done: int = 0
    graphs_seen: int = field(init=False)  # torch.compile's graphs counted by `compiled_anew`

    def __post_init__(self) -> None:
        self.graphs_seen = compiled_graphs() if self.gen.compile else 0

    def encode(self, prompt: Prompt) -> tuple[str, list[int]]:
        """(rendered text, ids), or a DataError if it does not fit the context."""
        text = self.style.render(prompt)
        ids = self.style.ids(self.run.tokenizer, text)
        limit = self.run.config.max_seq_len
        if len(ids) > limit:
            raise DataError(
                f"{prompt.where}: the prompt is {len(ids)} tokens but {self.run.path} has max_seq_len={limit}; "
                f"shorten it by at least {len(ids) - limit} tokens"
            )
        return text, ids

    def rows(self, prompts: list[Prompt]) -> list[Row]:
        """Every prompt × sample, in order; row k gets seed + k (counting earlier turns)."""
        encoded = [(p, *self.encode(p)) for p in prompts]
        flat = [(s, *e) for e in encoded for s in range(self.num_samples)]  # (sample, prompt, text, ids)
        return [Row(self.seed + self.rows_done + k, *f) for k, f in enumerate(flat)]

    def stream(self, rows: list[Row]) -> Iterator[Row | Token | Result]:
        """Generate row by row, yielding each `Row` as it starts, its `Token`s as they come and its
        `Result` (Ctrl-C propagates to the caller)."""
        for row in rows:
            yield row
            tok = self.run.tokenizer
            for ev in generate(self.run.model, [row.ids], self.gen, tokenizer=tok, seeds=[row.seed]):
                yield Result(row, ev.completion) if isinstance(ev, Finished) else ev
            self.rows_done += 1

    def batch(self, rows: list[Row]) -> Iterator[Result]:
        """Generate in batches of `batch_size` rows; each batch's results come when it is done."""
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            ids, seeds = [r.ids for r in chunk], [r.seed for r in chunk]
            completions = generate_all(
                self.run.model, ids, self.gen, tokenizer=self.run.tokenizer, seeds=seeds
            )
            self.rows_done += len(chunk)
            yield from (Result(row, c) for row, c in zip(chunk, completions, strict=True))

    def compiled_anew(self) -> bool:
        """Whether torch.compile made new graphs since the session started or this was last asked
        (a new prompt length or batch shape compiles the decode step again); False without compile."""
        graphs = compiled_graphs() if self.gen.compile else 0
        new, self.graphs_seen = graphs > self.graphs_seen, max(graphs, self.graphs_seen)
        return new
