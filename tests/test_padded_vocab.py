"""A model whose vocabulary is padded past its tokenizer (embedding rows that are no token).

The grammar engine sees only the tokenizer's ids: telling xgrammar the padded width makes every
padding id a "special token" it checks on each mask fill and accept (12-13x slower at a
128k-wide model with a 49k tokenizer). The padding ids are never sampled, constrained or not.
"""

from __future__ import annotations

import asyncio

from tiny_engines import TOKENIZED_TINY

import sgl

PADDED = dict(TOKENIZED_TINY, vocab_size=49152 + 3000)


def _engine() -> sgl.Engine:
    from sgl.backend.model_loader import resolve_model_path

    return sgl.Engine(model_config=PADDED, load_format="dummy", device="cpu", max_total_tokens=4096,
                      tokenizer=str(resolve_model_path(None)), random_seed=3)


def test_padding_ids_are_never_sampled_and_masks_are_tokenizer_wide() -> None:
    engine = _engine()
    try:
        tokenizer_vocab = len(engine.tokenizer)

        async def go() -> list[sgl.GenerateOutput]:
            free = [engine.generate(f"text {i}", max_new_tokens=24, temperature=1.5, ignore_eos=True)
                    for i in range(6)]
            json = [engine.generate(f"json {i}", max_new_tokens=24, temperature=1.5,
                                    json_schema='{"type": "object", "properties": {"a": {"type": "string"}}}')
                    for i in range(6)]
            return list(await asyncio.gather(*free, *json))

        outs = asyncio.run(go())
        assert all(t < tokenizer_vocab for o in outs for t in o.token_ids)
        grammar = engine._rt.grammar
        assert grammar.mask_vocab_size == tokenizer_vocab < grammar.vocab_size
        assert grammar.allocate_bitmask(1).shape[1] == -(-tokenizer_vocab // 32)
        assert len(grammar.tokenizer_info.special_token_ids) < 100  # no padding ids among them
    finally:
        engine.close()
