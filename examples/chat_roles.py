"""Multi-turn chat with roles, rendered with the model's own chat template.

    python examples/chat_roles.py

Three ways to write a turn: `sgl.user(expr)`, `with s.user():`, and `sgl.assistant_begin()` /
`sgl.assistant_end()`. Each assistant gen continues the same token sequence, so the second
turn's prompt is mostly served from the KV cache of the first.
"""

from __future__ import annotations

import sgl


@sgl.function
def multi_turn(s, topic):
    s += sgl.system("You are a helpful assistant. Keep answers to one sentence.")
    s += sgl.user(f"Tell me one fact about {topic}.")
    s += sgl.assistant(sgl.gen("fact", max_tokens=32))
    with s.user():
        s += "Now say it again in at most five words."
    s += sgl.assistant_begin()
    s += sgl.gen("short", max_tokens=16)
    s += sgl.assistant_end()


def main(engine: sgl.Engine | None = None) -> sgl.ProgramState:
    own = engine is None
    engine = engine or sgl.Engine()
    sgl.set_default_backend(engine)
    try:
        state = multi_turn.run(topic="the moon", temperature=0)
        for message in state.messages():
            print(f"{message['role']:>9}: {message['content']}")
        second = state.get_meta_info("short")
        print(f"\nturn 2: {second['cached_tokens']} of {second['prompt_tokens']} prompt tokens "
              "came from the cache")
        return state
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    main()
