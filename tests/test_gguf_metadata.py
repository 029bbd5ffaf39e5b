"""backend/gguf_metadata.py: a GGUF file's config and tokenizer read through transformers'
fast metadata reader give exactly what transformers' own (slow) GGUF path gives, on the real
default model (the file every first `sgl.Engine()` loads from a cold cache)."""

from __future__ import annotations

import time

import pytest

from sgl.backend.gguf_metadata import config_from_gguf, gguf_config_dict, tokenizer_from_gguf
from sgl.backend.model_loader import resolve_model_path

pytestmark = pytest.mark.slow

TEXT = "Hello world! <|im_start|>user\n  ÄÖ 12345 \t code()\n日本語<|im_end|>"


def _default_gguf():  # type: ignore[no-untyped-def]
    path = resolve_model_path(None)
    if path.suffix != ".gguf":
        pytest.skip("the default model is not a GGUF file here")
    return path


def test_config_equals_transformers_gguf_config() -> None:
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _default_gguf()
    start = time.perf_counter()
    fields = gguf_config_dict(path)
    fast_seconds = time.perf_counter() - start
    assert fields is not None and fields["model_type"] == "llama"  # the shortcut applies
    assert fields == load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    slow = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert config_from_gguf(path).to_dict() == slow.to_dict()
    assert fast_seconds < 2.0  # (the slow path: 6-9 s on a 2-core VM)


def test_tokenizer_equals_autotokenizer() -> None:
    from transformers import AutoTokenizer

    path = _default_gguf()
    fast, slow = tokenizer_from_gguf(path), AutoTokenizer.from_pretrained(path.parent,
                                                                        gguf_file=path.name)
    assert type(fast) is type(slow)
    assert fast.encode(TEXT) == slow.encode(TEXT) and len(fast) == len(slow)
    assert fast.decode(fast.encode(TEXT)) == slow.decode(slow.encode(TEXT))
    assert fast.all_special_tokens == slow.all_special_tokens
    assert (fast.bos_token, fast.eos_token, fast.pad_token) == (slow.bos_token, slow.eos_token,
                                                                slow.pad_token)
    assert fast.chat_template == slow.chat_template
    assert fast.init_kwargs.keys() == slow.init_kwargs.keys()
