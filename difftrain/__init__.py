"""difftrain: pretrain, fine-tune, evaluate and sample Differential Transformers from YAML recipes.

The command line is the main interface (`difftrain --help`); a run directory is also usable from
Python, through the names below (imported on first use: `import difftrain` loads no torch):

    import difftrain

    run = difftrain.load_run("runs/quickstart")           # model (eval mode), config, tokenizer
    ids = difftrain.prompt_ids(run.tokenizer, "def add(a, b):")   # as `difftrain generate` starts it
    cfg = difftrain.GenerationConfig(max_new_tokens=32, sampling=difftrain.SamplingConfig(greedy=True))
    (done,) = difftrain.generate_all(run.model, [ids], cfg, tokenizer=run.tokenizer)
    print(done.text)
    logits = run.model(torch.tensor([ids])).logits         # (1, len(ids), vocab_size)

    config = difftrain.ModelConfig(arch="diff", d_model=256, n_layers=4, n_heads=8, vocab_size=4096)
    model = difftrain.Transformer(config)
    recipe = difftrain.load_recipe("quickstart", ["train.max_steps=100"])   # a validated Recipe
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it (imported lazily: the CLI's startup stays free of torch)
_EXPORTS = {
    name: f"difftrain.{module}"
    for module, names in {
        "rundir": "load_run Run",
        "model": "Transformer ModelConfig",
        "data.tokenizer": "load_tokenizer Tokenizer",
        "infer.generate": "prompt_ids generate generate_all Completion",
        "infer.settings": "GenerationConfig SamplingConfig",
        "recipe": "load_recipe Recipe",
    }.items()
    for name in names.split()
}

__all__ = [  # (spelled out for linters and editors; the same names as _EXPORTS)
    "Completion",
    "GenerationConfig",
    "ModelConfig",
    "Recipe",
    "Run",
    "SamplingConfig",
    "Tokenizer",
    "Transformer",
    "__version__",
    "generate",
    "generate_all",
    "load_recipe",
    "load_run",
    "load_tokenizer",
    "prompt_ids",
]

if TYPE_CHECKING:  # for type checkers and editors; at run time `__getattr__` imports on first use
    from difftrain.data.tokenizer import Tokenizer, load_tokenizer
    from difftrain.infer.generate import Completion, generate, generate_all, prompt_ids
    from difftrain.infer.settings import GenerationConfig, SamplingConfig
    from difftrain.model import ModelConfig, Transformer
    from difftrain.recipe import Recipe, load_recipe
    from difftrain.rundir import Run, load_run


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'difftrain' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
