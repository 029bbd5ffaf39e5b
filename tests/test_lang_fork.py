"""fork / join / copy on FakeBackend."""

from __future__ import annotations

import sgl.lang as sgl
from sgl.lang import FakeBackend


def tip_backend() -> FakeBackend:
    return FakeBackend(responder=lambda req: f" tip-for-{req.text.rsplit('#', 1)[-1]}\n\nmore")


def test_fork_join_gathers_variables_and_shares_prefix() -> None:
    backend = tip_backend()

    @sgl.function
    def tips(s, topic):
        s += "Tips about " + topic + ":\n"
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f"Tip #{i}"
            forks[i] += sgl.gen("detail", max_tokens=32, stop="\n\n")
        forks.join()
        s += "Summary:" + "".join(forks[i]["detail"] for i in range(3))

    state = tips.run(topic="tea", backend=backend)
    assert state["detail"] == [" tip-for-0", " tip-for-1", " tip-for-2"]
    assert state.text() == "Tips about tea:\nSummary: tip-for-0 tip-for-1 tip-for-2"
    gens = backend.requests_of("generate")
    assert sorted(r.text for r in gens) == [f"Tips about tea:\nTip #{i}" for i in range(3)]
    # Children extend the parent's token prefix (so the radix cache reuses its KV) ...
    prefix = [ord(c) for c in "Tips about tea:\n"]
    assert all(r.token_ids[: len(prefix)] == prefix for r in gens)
    # ... which was cached once before the children started.
    (cached,) = backend.requests_of("cache_prefix")
    assert cached.token_ids == prefix
    assert backend.requests.index(cached) < backend.requests.index(gens[0])


def test_fork_iadd_forms_and_concate_and_append() -> None:
    backend = FakeBackend()

    @sgl.function
    def encode(s, contexts):
        s += "Memorize:\n"
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks += "."
        forks += [str(i) for i in range(len(contexts))]
        forks.join(mode="concate_and_append")
        s += "Q:" + sgl.gen("answer", max_tokens=2)

    state = encode.run(contexts=["a", "b"], backend=backend)
    assert state.text() == "Memorize:\nStatement 0: a\n.0Statement 1: b\n.1Q: 0"
    (gen,) = backend.requests_of("generate")
    assert gen.text == "Memorize:\nStatement 0: a\n.0Statement 1: b\n.1Q:"
    assert gen.token_ids == [ord(c) for c in gen.text]


def test_fork_children_see_parent_variables_and_are_independent() -> None:
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("parent_var", max_tokens=2)
        forks = s.fork(2)
        forks[0] += "A" + sgl.gen("child", max_tokens=2)
        forks[1] += "B"
        s += "after-fork"
        assert forks[0]["parent_var"] == " 0"
        assert forks[1].text() == "x 0B" and forks[0].text() == "x 0A 0"
        forks.join()

    state = prog.run(backend=backend)
    assert state.text() == "x 0after-fork"
    assert state["child"] == [" 0"]  # only the child that defined it


def test_copy_context_manager() -> None:
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += "base"
        with s.copy() as c:
            c += "+draft" + sgl.gen("draft", max_tokens=2)
        s += "|" + s["draft"][0]

    state = prog.run(backend=backend)
    assert state.text() == "base| 0"
    assert backend.requests_of("cache_prefix") == []  # a single fork needs no warm-up


def test_error_in_fork_child_surfaces_at_join() -> None:
    import pytest

    from sgl.errors import ProgramError

    backend = FakeBackend(fail_on="bad child", error=RuntimeError("child failed"))

    @sgl.function
    def prog(s):
        s += "p"
        forks = s.fork(2)
        forks += lambda i: ("bad child" if i else "good") + sgl.gen("g", max_tokens=1)
        forks.join()
        s += "joined" + sgl.gen("after", max_tokens=1)

    with pytest.raises(ProgramError, match="child failed"):
        prog.run(backend=backend)
