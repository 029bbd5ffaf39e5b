"""The collector's full passes skip what an open engine loaded (backend/gc_freeze.py): frozen
while any engine is open, unfrozen when the last one closes."""

from __future__ import annotations

import gc

import sgl
from sgl.backend import gc_freeze

TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, max_position_embeddings=1024, eos_token_id=0,
)  # fmt: skip


def make_engine() -> sgl.Engine:
    return sgl.Engine(model_config=TINY, load_format="dummy", device="cpu", max_total_tokens=1024)


def test_an_open_engine_keeps_the_loaded_objects_out_of_full_collections() -> None:
    gc.unfreeze()  # (whatever an earlier test left: this test counts from none)
    engine = make_engine()
    try:
        frozen = gc.get_freeze_count()
        # The engine's own module tree is among the frozen objects: a full collection, which
        # walks the oldest generation, no longer visits it.
        assert frozen > 1000
        model = engine._rt.runner.model
        assert all(m is not model for m in gc.get_objects(generation=2))
        assert engine.generate_sync([1, 2, 3], max_new_tokens=4, ignore_eos=True).token_ids
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0  # the last engine closed: back to normal collection


def test_the_freeze_lasts_until_the_last_open_engine_closes() -> None:
    gc.unfreeze()
    first, second = make_engine(), make_engine()
    first.close()
    first.close()  # (closing twice releases once)
    assert gc.get_freeze_count() > 0
    second.close()
    assert gc.get_freeze_count() == 0
    gc_freeze.release()  # more releases than holds change nothing
    assert gc.get_freeze_count() == 0
