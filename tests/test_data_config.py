"""The `data:` / `tokenizer:` recipe schema: documented, strict, and forgiving where it should be."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from difftrain.data.config import (
    DataConfig,
    NeedlesSpec,
    SourceSpec,
    TokenizerConfig,
    TokenizerTrainConfig,
    default_cache_dir,
)


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    if model in seen:
        return
    seen.add(model)
    for f in model.model_fields.values():
        for arg in [f.annotation, *getattr(f.annotation, "__args__", ())]:
            for inner in [arg, *getattr(arg, "__args__", ())]:
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    _models(inner, seen)


def test_every_setting_has_a_description_and_unknown_keys_are_refused() -> None:
    seen: set[type[BaseModel]] = set()
    for m in (DataConfig, TokenizerConfig):
        _models(m, seen)
    assert {SourceSpec, NeedlesSpec, TokenizerTrainConfig} <= seen
    for model in seen:
        assert model.model_config.get("extra") == "forbid", model
        for name, f in model.model_fields.items():
            assert f.description and len(f.description) > 15, f"{model.__name__}.{name} has no description"
    with pytest.raises(ValidationError, match="val_fractio"):
        DataConfig.model_validate({"val_fractio": 0.1})


def test_string_sources_become_specs_and_mappings_keep_their_settings() -> None:
    cfg = DataConfig.model_validate(
        {"sources": ["corpus/", {"source": "dump.jsonl", "weight": 2.5, "text_field": "body"}]}
    )
    assert [s.source for s in cfg.sources] == ["corpus/", "dump.jsonl"]
    assert cfg.sources[0].weight == 1.0 and cfg.sources[0].text_field == "text"
    assert cfg.sources[1].weight == 2.5 and cfg.sources[1].text_field == "body"
    assert DataConfig.model_validate({"sources": "builtin:needles"}).sources[0].kind == "builtin"
    assert DataConfig().sources[0].source == "builtin:python-stdlib"


def test_source_settings_that_cannot_apply_are_refused_with_the_reason() -> None:
    with pytest.raises(ValidationError, match="unknown builtin source 'builtin:wiki'"):
        SourceSpec(source="builtin:wiki")
    with pytest.raises(ValidationError, match="only to source 'builtin:needles'"):
        SourceSpec(source="corpus/", needles={"n_needles": 2})
    with pytest.raises(ValidationError, match="only to hf: sources"):
        SourceSpec(source="corpus/", data_files=["a.jsonl"])
    with pytest.raises(ValidationError, match="larger than n_needles"):
        NeedlesSpec(n_needles=2, n_queries=3)
    with pytest.raises(ValidationError, match="one per needle"):
        NeedlesSpec(n_needles=3, depths=[0.1, 0.2])
    with pytest.raises(ValidationError, match="greater than 0"):
        SourceSpec(source="x", weight=0)
    assert SourceSpec(source="hf:json", data_files="a.jsonl").data_files == ["a.jsonl"]


def test_cache_dir_defaults_to_the_environment_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(tmp_path / "c"))
    assert DataConfig().resolved_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DIFFTRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "difftrain"
    assert DataConfig(cache_dir=str(tmp_path / "y")).resolved_cache_dir() == tmp_path / "y"


def test_tokenizer_section_defaults_to_training_8192_tokens() -> None:
    cfg = TokenizerConfig()
    assert cfg.path is None and cfg.train.vocab_size == 8192
    with pytest.raises(ValidationError, match="must be at least 264: the 7 special tokens and the 256 byte"):
        TokenizerTrainConfig(vocab_size=100)  # cannot hold the bytes and special tokens
    assert TokenizerTrainConfig(vocab_size=264).vocab_size == 264  # one merge
    # extra special tokens come before the merges: 264 with two leaves none (it gave 266, no merge)
    with pytest.raises(
        ValidationError, match="no room for a merge after the 2 extra_special_tokens: make it at least 266"
    ):
        TokenizerTrainConfig(vocab_size=264, extra_special_tokens=["<a>", "<b>"])
    with pytest.raises(ValidationError, match="duplicate"):
        TokenizerTrainConfig(extra_special_tokens=["<|eos|>"])
