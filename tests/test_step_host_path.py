"""The engine step's host path (issue 14): event delivery off the engine thread, step inputs
packed and unpacked, and request ids sliced without copying the sequence."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sgl
from sgl._seq import common_prefix_len
from sgl.backend.event_delivery import EventDelivery
from sgl.backend.req import Req
from sgl.backend.scheduler import _InFlightPrompts
from sgl.backend.step_io import ALIGN, SMALL_PACK, StepInputs, _INPUT_FIELDS
from sgl.sampling import SamplingParams

TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, max_position_embeddings=1024, eos_token_id=0,
)  # fmt: skip


def test_delivery_keeps_order_survives_a_broken_sink_and_drains_on_close() -> None:
    delivery = EventDelivery()
    got: list[tuple[str, Any, str]] = []

    def sink(kind: str, payload: Any) -> None:
        time.sleep(0.001)  # a slow consumer: events queue up behind it
        got.append((kind, payload, threading.current_thread().name))

    def broken(kind: str, payload: Any) -> None:
        raise RuntimeError("consumer bug")

    a, b = delivery.wrap(sink), delivery.wrap(broken)
    assert delivery.wrap(None) is None
    for i in range(50):
        a("chunk", i)
        b("chunk", i)  # logged, and the next events are still delivered
    a("done", 50)
    delivery.close()  # returns once everything queued before it was delivered
    assert [p for _, p, _ in got] == list(range(51))
    assert got[-1][0] == "done"
    assert {name for _, _, name in got} == {"sgl-events"}


def test_engine_sinks_run_off_the_engine_thread_and_get_every_event() -> None:
    """The caller's handling of a streamed token must not run on the engine thread (it held
    the engine's critical path); every chunk and the final output still arrive, in order."""
    engine = sgl.Engine(model_config=TINY, load_format="dummy", device="cpu", max_total_tokens=2048)
    delivery_thread = engine._rt.core._delivery._thread
    try:
        seen: list[tuple[str, str]] = []
        done = threading.Event()

        def sink(kind: str, payload: Any) -> None:
            seen.append((kind, threading.current_thread().name))
            if kind == "done":
                done.set()

        params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
        engine._rt.core.submit([Req(rid="r", prompt_ids=[1, 2, 3], params=params, stream=True, sink=sink)])
        assert done.wait(30)
        kinds = [k for k, _ in seen]
        assert kinds == ["chunk"] * 7 + ["done"]  # six tokens, the final chunk, the output
        assert {name for _, name in seen} == {"sgl-events"}
    finally:
        engine.close()
    assert not delivery_thread.is_alive()  # close() ended it (no thread left per engine)


@pytest.mark.parametrize("align", [1, ALIGN])
@pytest.mark.parametrize("size", [1, 5, SMALL_PACK])  # the list path and the numpy path
def test_pack_then_unpack_gives_every_field_back(align: int, size: int) -> None:
    rng = np.random.default_rng(size)
    values: dict[str, Any] = {}
    for k, name in enumerate(_INPUT_FIELDS):
        n = (size + k) % 7 if size < 8 else size + k  # odd, even and empty fields
        arr = rng.integers(-5, 1 << 40, n)
        values[name] = arr if k % 3 == 0 else arr.tolist()  # arrays and lists
    packed, lengths = StepInputs(**values).pack(pin=False, align=align)
    assert packed.dtype == torch.int64
    assert packed.numel() == sum(-(-n // align) * align for n in lengths)
    back = StepInputs.unpack(packed, lengths, align)
    for name in _INPUT_FIELDS:
        assert getattr(back, name).tolist() == list(np.asarray(values[name]).tolist()), name


def test_known_ids_is_a_slice_of_prompt_plus_outputs() -> None:
    r = Req(rid="r", prompt_ids=list(range(100, 105)), params=SamplingParams())
    for outputs in ([], [7, 8, 9]):
        r.output_ids = list(outputs)
        for start in range(0, 10):
            for stop in range(0, 10):
                assert r.known_ids(start, stop) == r.fill_ids()[start:stop], (outputs, start, stop)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), max_size=8), st.integers(0, 9)),
                max_size=30))
def test_in_flight_heads_answer_as_the_prefix_comparison_they_replace(ops: list[Any]) -> None:
    """The scheduler's in-batch prefix deferral asks whether a prompt being prefilled shares at
    least k tokens with a waiting one: the k-head sets must answer as max(common_prefix_len)
    did, whatever order prompts join and k values are asked in."""
    prompts: list[list[int]] = []
    in_flight = _InFlightPrompts(prompts)
    for is_add, tokens, k in ops:  # (tiny alphabet: long shared prefixes are common)
        if is_add:
            prompts.append(tokens)
            in_flight.add(tokens)
        else:
            want = max((common_prefix_len(tokens, p) for p in prompts), default=-1) >= k
            assert in_flight.shares_head(tokens, k) == want, (prompts, tokens, k)
        assert bool(in_flight) == bool(prompts)
