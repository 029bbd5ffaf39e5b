"""EngineConfig validation read from the annotations, and the environment read in one place
(issue 11 item 4, issue 12 limits). No model is loaded: every case fails or passes in
`EngineConfig` itself."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

import sgl
from sgl.config import ENV_OPTIONS, EngineConfig


@dataclasses.dataclass(frozen=True)
class _WithNewFields(EngineConfig):
    # Fields a future change might add: validated with no table edited anywhere.
    flavour: Literal["plain", "fancy"] = "plain"
    budget: int | None = None
    ratio: float = 0.5
    verbose: bool = False


@pytest.mark.parametrize("field,value,words", [
    ("flavour", "odd", "must be one of 'plain' or 'fancy'"),
    ("flavour", 1, "must be one of"),
    ("budget", "10", "must be an integer (or None)"),
    ("budget", True, "must be an integer"),
    ("ratio", "0.5", "must be a number"),
    ("verbose", 1, "must be True or False"),
])
def test_a_new_field_is_validated_from_its_annotation(field: str, value: object, words: str) -> None:
    with pytest.raises(sgl.InvalidConfigError, match=f"{field}=") as info:
        _WithNewFields(**{field: value})
    assert words in str(info.value)


def test_a_new_field_accepts_what_its_annotation_says() -> None:
    cfg = _WithNewFields(flavour="fancy", budget=None, ratio=1, verbose=True)
    assert (cfg.flavour, cfg.budget, cfg.ratio, cfg.verbose) == ("fancy", None, 1, True)


@pytest.mark.parametrize("options,words", [
    (dict(kernels="fast"), "'reference'"),
    (dict(num_threads=0), "positive integer or None"),
    (dict(num_threads=True), "integer"),
    (dict(cache_dir=3), "string"),
    (dict(max_n=0), "positive integer"),
    (dict(max_n="4"), "integer"),
    (dict(max_top_logprobs_num=-1), "positive integer"),
    (dict(max_stop_strings=0), "positive integer"),
    (dict(max_stop_string_len=1.5), "integer"),
    (dict(max_stop_token_ids=None), "integer"),
    (dict(dtype="float8"), "must be one of"),
])
def test_new_options_are_validated(options: dict[str, object], words: str) -> None:
    with pytest.raises(sgl.InvalidConfigError) as info:
        EngineConfig(**options)
    assert words in str(info.value) and next(iter(options)) in str(info.value)


def test_unknown_option_suggests_the_close_name() -> None:
    with pytest.raises(sgl.InvalidConfigError, match="did you mean 'max_total_tokens'"):
        EngineConfig.from_kwargs(None, max_total_token=4096)


def test_environment_is_parsed_by_each_options_type(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_OPTIONS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SGL_KERNELS", " Reference ")
    monkeypatch.setenv("SGL_NUM_THREADS", "3")
    monkeypatch.setenv("SGL_DEBUG_INTEGRITY", "1")
    monkeypatch.setenv("SGL_CACHE_DIR", "/tmp/sgl-cache")
    monkeypatch.setenv("SGL_DEVICE", "")  # empty: unset
    env = EngineConfig.from_env_defaults()
    assert env == {"kernels": "reference", "num_threads": 3, "debug_integrity": True,
                   "cache_dir": "/tmp/sgl-cache"}
    assert EngineConfig(**env).kernels == "reference"
    monkeypatch.setenv("SGL_DEBUG_INTEGRITY", "0")
    assert EngineConfig.from_env_defaults()["debug_integrity"] is False


@pytest.mark.parametrize("var,value,words", [
    ("SGL_NUM_THREADS", "many", "must be an integer"),
    ("SGL_KERNELS", "fast", "must be one of"),
    ("SGL_DEBUG_INTEGRITY", "maybe", "must be 1 or 0"),
    ("SGL_DTYPE", "float8", "must be one of"),
])
def test_malformed_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str,
                                                  words: str) -> None:
    for name in ENV_OPTIONS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(var, value)
    with pytest.raises(sgl.InvalidConfigError) as info:
        EngineConfig.from_env_defaults()
    assert var in str(info.value) and words in str(info.value) and ENV_OPTIONS[var] in str(info.value)


def test_every_env_option_is_a_field() -> None:
    assert set(ENV_OPTIONS.values()) <= EngineConfig.option_names()
