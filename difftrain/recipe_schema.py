"""The recipe schema: every setting, its type, default and documentation (a field's `description`
is its documentation everywhere). Extra keys are errors; machine-dependent `auto` values stay
`auto` here (`difftrain.recipe.resolve_auto` fixes them).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from difftrain.data.config import DataConfig, TokenizerConfig, absolute_path, absolute_source
from difftrain.errors import RecipeError
from difftrain.model.config import ModelConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class FSDPConfig(_Section):
    sharding_strategy: Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"] = Field(
        "full_shard",
        description="What FSDP shards over the devices. full_shard: weights, gradients and optimizer state "
        "(ZeRO-3, least memory). shard_grad_op: gradients and optimizer state; weights stay gathered between "
        "forward and backward (ZeRO-2, less communication). no_shard: nothing (like ddp). hybrid_shard: "
        "full_shard within each node, replicated across nodes.",
    )
    auto_wrap: bool = Field(
        True,
        description="Make each Transformer block its own FSDP unit, gathered just before it runs and freed "
        "after: peak weight memory is about one block's full weights. false: one unit for the whole model "
        "(simpler, no memory saving for weights).",
    )
    param_dtype: Literal["compute", "float32"] = Field(
        "compute",
        description="dtype of the weights FSDP gathers for forward and backward. compute: that of "
        "train.precision (bf16 under bf16-mixed: half the all-gather traffic; the master copy stays fp32). "
        "float32: gather full-precision weights (autocast still runs matmuls in bf16). Buffers stay fp32.",
    )
    reduce_dtype: Literal["float32", "compute"] = Field(
        "float32",
        description="dtype of the gradient reduce-scatter. float32: exact sums over devices. compute: "
        "the dtype of train.precision (half the traffic, rounding in the sums).",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep the parameter shards and their gradients in CPU memory between uses (and step "
        "the optimizer there): fits bigger models, much slower.",
    )
    checkpoint: Literal["full", "sharded"] = Field(
        "full",
        description="Format of the resume checkpoints. full: one file gathered on rank 0 (resumable on any "
        "number of devices, and by ddp or a single device). sharded: a folder with one shard per rank (no "
        "rank-0 memory peak; resumable by fsdp only, on any number of devices). model.safetensors always "
        "holds the full weights.",
    )


class TrainConfig(_Section):
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps to train for. Exactly one of max_steps / max_tokens is set: a recipe "
        "(or override) that sets one drops the other it inherits.",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens to train on (1e9 and 1_000_000_000 both read as numbers); converted to steps as "
        "ceil(max_tokens / tokens per step). Set instead of max_steps.",
    )
    seq_len: int | None = Field(
        None, ge=2, description="Tokens per training sequence. Default: model.max_seq_len; may not exceed it."
    )
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward pass on one device.")
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per optimizer step over all devices; gradient accumulation = global / (micro x devices x nodes). Default: micro_batch_size x devices x nodes.",
    )
    log_every: int = Field(10, ge=1, description="Log training metrics every N optimizer steps.")
    val_every: int = Field(
        100, ge=1, description="Compute the validation loss every N optimizer steps (and at the end)."
    )
    save_every: int = Field(
        500,
        ge=1,
        description="Write a checkpoint and model.safetensors every N optimizer steps (and at the end).",
    )
    keep_checkpoints: int = Field(
        3,
        ge=1,
        description="Keep the last K step checkpoints (last.ckpt is kept too; the only good one is never deleted).",
    )
    precision: Literal["auto", "32-true", "bf16-mixed", "16-mixed", "bf16-true"] = Field(
        "auto",
        description="Numeric precision. auto: bf16-mixed on CUDA with bf16, 16-mixed on older CUDA, 32-true on CPU.",
    )
    compile: Literal["auto", True, False] = Field(
        "auto", description="torch.compile the model. auto: on for CUDA, off for CPU."
    )
    grad_clip: float | None = Field(
        1.0, description="Clip the global gradient norm to this value, > 0 (null: no clipping)."
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each block's activations in the backward pass: less memory, ~30% more compute. Under fsdp it is applied inside each block's FSDP unit.",
    )
    resume: Literal["auto", True, False] = Field(
        False,
        description="Continue from the run directory's last good checkpoint. auto: resume if one exists, else start fresh.",
    )
    accelerator: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="Device type. auto: CUDA when present, else CPU."
    )
    devices: int | Literal["auto"] = Field(1, description="Devices per node (int or auto = all visible).")
    num_nodes: int = Field(
        1, ge=1, description="Machines taking part (multi-node runs are launched with torchrun or SLURM)."
    )

    @field_validator("grad_clip")
    @classmethod
    def _clip_positive(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(
                f"must be greater than 0 (a gradient norm to clip to); to train without clipping set "
                f"train.grad_clip: null (got {v:g})"
            )
        return v

    @field_validator("devices")
    @classmethod
    def _some_devices(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"{v} devices: need at least 1 (or auto)")
        return v

    strategy: Literal["auto", "ddp", "fsdp"] = Field(
        "auto",
        description="Distribution strategy (Lightning). auto: single device, or ddp for several. ddp: a full "
        "replica per device, gradients averaged. fsdp: weights, gradients and optimizer state sharded over "
        "the devices (CUDA only; see train.fsdp). DeepSpeed ZeRO-2 is fsdp with fsdp.sharding_strategy=shard_grad_op.",
    )
    fsdp: FSDPConfig = Field(
        default_factory=FSDPConfig, description="FSDP settings (used when strategy=fsdp)."
    )
    nan_skip_limit: int = Field(
        3,
        ge=0,
        description="Optimizer steps with a non-finite loss or gradient skipped in a row before training stops with a diagnosis.",
    )
    spike_factor: float | None = Field(
        2.0,
        gt=1,
        description="A step whose loss exceeds spike_factor x the running mean of recent losses (an exponential average over about 10 steps, checked from 10 steps after warmup) is a loss spike: a warning, a train/spike row in metrics.csv, a count in summary.json. null: no spike detection.",
    )
    spike_rollback: bool = Field(
        False,
        description="On a loss spike, restore the weights and optimizer state of the last checkpoint, scale the learning rate by spike_lr_factor from then on, and go on with the next batches (the spike's batches are not replayed).",
    )
    spike_lr_factor: float = Field(
        0.5, gt=0, le=1, description="Factor on the learning rate at each spike rollback."
    )
    seed_offset_per_rank: bool = Field(
        True,
        description="Give each rank its own dropout/sampling RNG stream (seed + rank); data is always rank-disjoint.",
    )

    @model_validator(mode="after")
    def _batch_sizes(self) -> TrainConfig:
        if self.max_steps is None and self.max_tokens is None:
            raise ValueError("set train.max_steps or train.max_tokens")
        if self.max_steps is not None and self.max_tokens is not None:
            raise ValueError(
                f"max_steps={self.max_steps} and max_tokens={self.max_tokens} are both set; give the run's "
                "length one way (set the other to null)"
            )
        return self


_Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimConfig(_Section):
    name: Literal["auto", "adamw", "adamw8bit", "paged_adamw8bit", "lion8bit"] = Field(
        "auto",
        description="Optimizer. adamw: torch (fused/foreach). adamw8bit, paged_adamw8bit, lion8bit: bitsandbytes 8-bit states (not under train.strategy=fsdp). auto: adamw8bit on CUDA (adamw under fsdp), adamw on CPU.",
    )
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(
        0.1,
        ge=0,
        description="Decoupled weight decay, applied only to >=2-D weights (not norms, lambdas or biases).",
    )
    decay_embeddings: bool = Field(
        False, description="Also apply weight decay to the embedding (and untied output head)."
    )
    betas: tuple[_Beta, _Beta] = Field((0.9, 0.95), description="Adam/Lion beta1, beta2 (each in [0, 1)).")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    warmup_steps: int = Field(
        100,
        ge=0,
        description="Linear warmup over this many steps: step i (from 0) uses lr·(i+1)/(warmup_steps+1), "
        "so the peak lr comes at step warmup_steps + 1.",
    )
    schedule: Literal["cosine", "linear", "constant", "wsd"] = Field(
        "cosine",
        description="After warmup: cosine or linear decay towards min_lr_ratio x lr, constant, or "
        "warmup-stable-decay (wsd: constant, then linear decay over the last decay_fraction of the steps "
        "after warmup). The decay's progress at step i is (i - warmup_steps) / (max_steps - warmup_steps), "
        "as transformers' schedules count it: the last step is one step short of the floor.",
    )
    min_lr_ratio: float = Field(
        0.1,
        ge=0,
        le=1,
        description="The learning rate the decay ends at, as a fraction of lr (see schedule).",
    )
    decay_fraction: float = Field(
        0.2, gt=0, le=1, description="wsd only: fraction of the steps after warmup spent in the final decay."
    )
    stable_embedding: bool = Field(
        False,
        description="With an 8-bit optimizer, keep the embedding's optimizer state in 32 bits (the stabilising half of bitsandbytes' StableEmbedding; its extra LayerNorm is not added, so the architecture stays the same). No effect with adamw, whose state is 32-bit anyway.",
    )


class LoggingConfig(_Section):
    tensorboard: Literal["auto", True, False] = Field(
        "auto",
        description="Write TensorBoard logs to <run>/tensorboard. auto: when tensorboard is installed.",
    )
    wandb_project: str | None = Field(
        None, description="Weights & Biases project to log to (needs `pip install wandb`)."
    )
    wandb_entity: str | None = Field(None, description="Weights & Biases entity (team or user).")
    progress: bool = Field(
        True,
        description="Show the rich progress bar on a terminal. Without a terminal (a log file, a batch job) or with the bar off: one plain line every train.log_every steps and after each validation.",
    )


class LoRAConfig(_Section):
    rank: int = Field(8, ge=1, description="LoRA rank r: each adapted layer learns B·A with A r×in, B out×r.")
    alpha: float = Field(
        16.0, gt=0, description="LoRA scale α: the update is (α/r)·B·A (α = 2r is a common choice)."
    )
    dropout: float = Field(
        0.05, ge=0, lt=1, description="Dropout on the input of the LoRA path (not the frozen layer)."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Linear layers to adapt, as fnmatch patterns matched against a full module name "
        "(model.layers.0.self_attn.q_proj) or a dotted suffix of it: q_proj, mlp.*, layers.1[01].*. "
        "Default: every attention and MLP projection.",
    )


class ChatTemplateConfig(_Section):
    roles: dict[str, str] = Field(
        default_factory=lambda: {
            "system": "<|system|>\n{content}<|end|>\n",
            "user": "<|user|>\n{content}<|end|>\n",
            "assistant": "<|assistant|>\n{content}<|end|>\n",
        },
        description="How a `messages` record is rendered: for each role, a format holding {content} "
        "once; the messages are concatenated in order. A message of a role not listed is an error. "
        "Roles given replace these defaults as a whole.",
    )
    trained_roles: list[str] = Field(
        default_factory=lambda: ["assistant"],
        description="Roles whose messages are learned: the loss covers their {content} and what follows "
        "it in the format (the <|end|>), not the role header before it.",
    )
    special_tokens: list[str] = Field(
        default_factory=lambda: ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        description="Tokens the formats use that must be single special tokens. Ones the base "
        "tokenizer lacks are added, growing the embedding and output head (new rows start at the "
        "mean of the old ones, and are trained: with LoRA the embedding and head become trainable).",
    )

    @model_validator(mode="after")
    def _formats(self) -> ChatTemplateConfig:
        for role, fmt in self.roles.items():
            if fmt.count("{content}") != 1:
                raise ValueError(f"roles.{role} must contain {{content}} exactly once, got {fmt!r}")
        unknown = [r for r in self.trained_roles if r not in self.roles]
        if unknown:
            defaults = ChatTemplateConfig.model_fields["roles"].default_factory()  # type: ignore[misc,call-arg]
            replaced = (
                f"; roles replaces the default roles ({', '.join(defaults)}) as a whole: list every role, "
                "or set trained_roles"
                if any(r in defaults and r not in self.roles for r in unknown)
                else ""
            )
            raise ValueError(
                f"trained_roles {unknown} are not among roles ({', '.join(self.roles)}){replaced}"
            )
        return self


class FinetuneConfig(_Section):
    base: str = Field(
        description="The run directory to start from (relative to the current folder, like out_dir), "
        "e.g. runs/quickstart. Its config.json gives the model and its tokenizer.json the tokenizer."
    )

    @field_validator("base")
    @classmethod
    def _named(cls, v: str) -> str:
        if not v.strip():  # it read as "no fine-tune": "a pretraining recipe needs a model: section"
            raise ValueError(
                "finetune.base is empty; name the run directory to start from, e.g. runs/quickstart"
            )
        return v

    method: Literal["full", "lora", "qlora"] = Field(
        "lora",
        description="full: train every weight. lora: freeze the base, train low-rank adapters (saved "
        "alone as adapter.safetensors). qlora: lora over base weights stored in 4-bit NF4 "
        "(bitsandbytes): about 4x less memory for the frozen weights.",
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA settings (lora and qlora).")
    train_lambdas: bool = Field(
        True,
        description="lora/qlora: also train the differential-attention lambdas in full (diff: "
        "lambda_q1, k1, q2, k2; diff2: lambda_proj) — few parameters that set how much noise each "
        "layer cancels. false: freeze them.",
    )
    data_format: Literal["auto", "instruction", "text"] = Field(
        "auto",
        description="instruction: prompt/response or messages records, loss on responses only. text: "
        "plain documents (continued pretraining). auto: instruction for builtin:python-docstrings "
        "and .jsonl/.json/.parquet/hf: sources, text for everything else.",
    )
    train_on_prompt: bool = Field(
        False,
        description="Instruction data: compute the loss on prompt tokens too (default: responses only).",
    )
    prompt_format: str = Field(
        "{prompt}",
        description="How a prompt/response record's prompt is written ({field} = any record field); "
        "not trained.",
    )
    response_format: str = Field(
        "{response}",
        description="How the response is written after the prompt; trained, followed by <|eos|>.",
    )
    chat_template: ChatTemplateConfig = Field(
        default_factory=ChatTemplateConfig,
        description="Rendering of `messages: [{role, content}, ...]` records.",
    )


class Recipe(_Section):
    """A whole recipe: `name`, `train` and, to pretrain, `model` are required."""

    name: str = Field(description="Run name; the run directory is out_dir/name.")
    description: str = Field(
        "", description="One line saying what this recipe is (shown by `difftrain recipes list`)."
    )
    seed: int = Field(
        1337,
        ge=0,
        le=2**32 - 1,
        description="Seed for initialisation, data order and sampling: same seed, same run.",
    )
    out_dir: str = Field(
        "runs", description="Folder that holds run directories (relative to the current directory)."
    )
    model: ModelConfig | None = Field(
        None,
        description="The model (see `difftrain recipes explain model`). Required for pretraining; a "
        "fine-tune takes it from finetune.base (settings given here must match, except "
        "attn_impl and max_seq_len).",
    )
    data: DataConfig = Field(
        default_factory=DataConfig,
        description="Training data sources and splits (default: the Python standard library).",
    )
    tokenizer: TokenizerConfig = Field(
        default_factory=TokenizerConfig, description="Tokenizer: trained on the data, or loaded."
    )
    train: TrainConfig = Field(
        description="Training loop settings; required, with train.max_steps or train.max_tokens."
    )
    optim: OptimConfig = Field(
        default_factory=OptimConfig, description="Optimizer and learning-rate schedule."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Metrics logging.")
    finetune: FinetuneConfig | None = Field(
        None,
        description="Fine-tuning from an existing run (`difftrain finetune`); see "
        "`difftrain recipes explain finetune`.",
    )

    _recipe_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _source: str = PrivateAttr(default="")
    _model_keys: frozenset[str] = PrivateAttr(default=frozenset())
    _own_run_dir: Path | None = PrivateAttr(default=None)
    _overrides: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _model_section(cls, data: Any, handler: Any) -> Recipe:
        """A recipe without `model:` must be a fine-tune; remember which model keys were given."""
        if isinstance(data, dict) and data.get("model") is None:
            ft = data.get("finetune")
            if not (isinstance(ft, dict) and "base" in ft):  # (an empty base is its own message)
                raise ValueError(
                    "missing key `model`: a pretraining recipe needs a model: section "
                    "(a fine-tune takes it from finetune.base)"
                )
        recipe = handler(data)
        if isinstance(data, dict) and isinstance(data.get("model"), dict):
            recipe._model_keys = frozenset(data["model"])
        return recipe

    @property
    def model_keys(self) -> frozenset[str]:
        """The `model:` keys the recipe itself set (the rest are defaults)."""
        return self._model_keys

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not v or v in (".", "..") or "/" in v or "\\" in v or "\x00" in v:
            raise ValueError("name must be a plain folder name (no '/', '..' or empty)")
        if v.startswith("~"):  # a folder `runs/~`, which every shell command would read as home
            raise ValueError(
                f"name '{v}' starts with '~', which a shell reads as your home folder; choose another"
            )
        bad = next((c for c in v if ord(c) < 32 or ord(c) == 127), None)
        if bad is not None:  # a folder name no terminal shows as written (a tab, a newline, an escape)
            raise ValueError(
                f"name {v!r} holds the control character {bad!r}; use letters, digits, '-', '_' or '.'"
            )
        if len(v.encode("utf-8")) > 255:  # it names the run's folder
            raise ValueError(
                f"name is {len(v.encode('utf-8'))} bytes long, more than a folder name may be (255 bytes); shorten it"
            )
        return v

    @property
    def recipe_dir(self) -> Path:
        """Folder that relative paths in the recipe are resolved against."""
        return self._recipe_dir

    @property
    def source(self) -> str:
        """A file path or `shipped:NAME`."""
        return self._source

    @property
    def command_arg(self) -> str:
        """The recipe as a command line names it (a shipped name, a quoted path, else RECIPE)."""
        if not self._source:
            return "RECIPE"
        if self._source.startswith("shipped:"):
            return self._source.removeprefix("shipped:")
        return shlex.quote(self._source)

    @property
    def command_args(self) -> str:
        """`command_arg` and the overrides, quoted: e.g. `difftrain plan {command_args}`."""
        return " ".join([self.command_arg, *(shlex.quote(o) for o in self._overrides)])

    @property
    def run_dir(self) -> Path:
        """out_dir/name; for a run directory's own recipe.yaml (name and out_dir not overridden),
        that directory."""
        return self._own_run_dir or run_dir_for(self.out_dir, self.name)

    def with_absolute_paths(self) -> Recipe:
        """A copy with its relative local paths absolute (against `recipe_dir`; finetune.base
        against the current folder): a run's recipe.yaml, resumable from any folder."""
        data = self.model_dump()
        rebase_paths(data, self.recipe_dir)
        tok_file = self.tokenizer.file(self.recipe_dir)
        if tok_file is not None:  # (~ expanded)
            data["tokenizer"]["path"] = str(tok_file.absolute())
        if data.get("finetune") and data["finetune"].get("base"):
            data["finetune"]["base"] = absolute_path(data["finetune"]["base"], Path.cwd())
        out = type(self).model_validate(data)
        out._recipe_dir, out._source, out._model_keys = self._recipe_dir, self._source, self._model_keys
        out._own_run_dir = self._own_run_dir
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            self.model_dump(mode="json"), sort_keys=False, allow_unicode=True, default_flow_style=None
        )


def run_dir_for(out_dir: str, name: str) -> Path:
    """out_dir/name. A relative out_dir may not climb out of the current folder through '..'."""
    out = Path(out_dir).expanduser()
    if not out.is_absolute() and ".." in out.parts:
        raise RecipeError(
            f"out_dir `{out_dir}` climbs out of the current folder through '..'; give an absolute path if you mean it"
        )
    return out / name


def rebase_paths(data: dict[str, Any], folder: Path) -> None:
    """Make the paths a recipe resolves against its own folder (data sources, data_files,
    data.cache_dir, tokenizer.path) absolute against `folder` (an extended recipe's, or the
    current folder for overrides)."""
    d = data.get("data")
    sources = d.get("sources") if isinstance(d, dict) else None
    if isinstance(sources, (str, list)):
        out = [_rebase_source(s, folder) for s in ([sources] if isinstance(sources, str) else sources)]
        d["sources"] = out[0] if isinstance(sources, str) else out  # type: ignore[index]
    for section, key in (("data", "cache_dir"), ("tokenizer", "path")):
        m = data.get(section)
        if isinstance(m, dict) and isinstance(m.get(key), str) and m[key]:
            m[key] = absolute_path(m[key], folder)


def _rebase_source(item: Any, folder: Path) -> Any:
    if isinstance(item, str):
        return absolute_source(item, folder)
    if not isinstance(item, dict):
        return item
    item = dict(item)
    if isinstance(item.get("source"), str):
        item["source"] = absolute_source(item["source"], folder)
    if isinstance(item.get("data_files"), list):
        item["data_files"] = [
            absolute_path(f, folder) if isinstance(f, str) and f else f for f in item["data_files"]
        ]
    return item


def resolve_data_format(recipe: Recipe) -> str:
    """finetune.data_format with `auto` decided by the first source."""
    assert recipe.finetune is not None
    fmt = recipe.finetune.data_format
    if fmt != "auto":
        return fmt
    src = recipe.data.sources[0]
    if src.kind in ("builtin", "hf"):
        return "instruction" if src.kind == "hf" or src.source == "builtin:python-docstrings" else "text"
    name = src.source.lower().removesuffix(".gz")
    return "instruction" if name.endswith((".jsonl", ".json", ".parquet")) else "text"


def check_record_fields(recipe: Recipe) -> None:
    """RecipeError for a source's prompt_field/response_field where the data is read as text."""
    if recipe.finetune is not None and resolve_data_format(recipe) != "text":
        return
    reads = "pretraining" if recipe.finetune is None else "a text fine-tune (finetune.data_format: text)"
    for i, src in enumerate(recipe.data.sources):
        # (a run's recipe.yaml spells every default out: only a changed field is refused)
        given = [
            k
            for k in ("prompt_field", "response_field")
            if getattr(src, k) != type(src).model_fields[k].default
        ]
        if given:
            raise RecipeError(
                f"data.sources[{i}] ({src.source}) sets {' and '.join(given)}, which only instruction records "
                f"of a fine-tune use; {reads} reads each record's text_field ('{src.text_field}'): remove "
                f"{' and '.join(given)}, or set text_field: <field> to read another field"
            )


def require_finetuning(recipe: Recipe) -> FinetuneConfig:
    """The recipe's finetune: section; RecipeError saying what to add when it has none."""
    if recipe.finetune is None:
        raise RecipeError(
            f"{recipe.source or recipe.name} has no finetune: section; add one with at least "
            "`finetune: {base: runs/NAME}`, or train from scratch with `difftrain pretrain`"
        )
    return recipe.finetune
