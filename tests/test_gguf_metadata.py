"""backend/gguf_metadata.py: a GGUF file's config and tokenizer read through transformers'
fast metadata reader give exactly what transformers' own (slow) GGUF path gives, on the real
default model (the file every first `sgl.Engine()` loads from a cold cache)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from sgl.backend.gguf_metadata import (
    config_from_gguf,
    gguf_config_dict,
    light_config_from_gguf,
    tokenizer_from_gguf,
)
from sgl.backend.model_loader import ModelConfig, resolve_model_path

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
    fields = gguf_config_dict(path)
    assert fields is not None and fields["model_type"] == "llama"  # the shortcut applies
    assert fields == load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    slow = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert config_from_gguf(path).to_dict() == slow.to_dict()


def test_light_config_builds_what_the_config_class_builds() -> None:
    """The engine builds the default GGUF's model from a plain config: what it derives from
    it (the ModelConfig, rope parameters, head size, the layer variant) equals what it derives
    from transformers' LlamaConfig of the same file."""
    from sgl.backend.layers.rotary import rope_parameters
    from sgl.backend.models.llama import LlamaForCausalLM, head_dim_of

    path = _default_gguf()
    light, full = light_config_from_gguf(path), config_from_gguf(path)
    assert light is not None and type(light) is not type(full)  # (else this checks nothing)
    derived = [dataclasses.replace(ModelConfig.from_hf(c), hf_config=None) for c in (light, full)]
    assert derived[0] == derived[1]
    assert rope_parameters(light) == rope_parameters(full)
    assert head_dim_of(light) == head_dim_of(full)
    assert LlamaForCausalLM._variant(light) == LlamaForCausalLM._variant(full)


def test_loading_the_config_imports_no_config_class() -> None:
    """The engine's config of the default GGUF imports neither transformers' llama config
    module nor what its validators pull in (sympy, torch.distributed.tensor): seconds of a
    cold start on a small CPU. In a fresh interpreter, as a first `sgl.Engine()` runs."""
    code = ("import sys; from sgl.backend.model_loader import _gguf_config, resolve_model_path; "
            "_gguf_config(resolve_model_path(None), None); "
            "print([m for m in ('transformers.models.llama.configuration_llama', 'sympy', "
            "'torch.distributed.tensor') if m in sys.modules])")
    _default_gguf()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


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
