"""Parallel tips with `fork`: expand several tips at once, then summarize them.

    python examples/parallel_tips.py

`s.fork(n)` makes n copies of the state that share its prefix: the prefix is cached once and
every branch's gen starts from the cached KV, and the engine batches the branches together.
"""

from __future__ import annotations

import sgl

TIPS = ["Balanced diet", "Regular exercise", "Enough sleep"]


@sgl.function
def tip_suggestion(s, topic="staying healthy"):
    s += f"Here are {len(TIPS)} tips for {topic}: "
    s += " ".join(f"{i + 1}. {tip}." for i, tip in enumerate(TIPS)) + "\n\n"
    forks = s.fork(len(TIPS))
    # A callable is applied to every branch with its index.
    forks += lambda i: f"{TIPS[i]} matters because"
    forks += sgl.gen("detail", max_tokens=32, stop=["\n", ". "])
    # Reading a branch's variable waits for that branch only.
    for i, fork in enumerate(forks):
        s += f"Tip {i + 1}: {TIPS[i]} matters because" + fork["detail"] + ".\n"
    forks.join()  # gathers the branches' variables: s["detail"] is now a list
    s += "\nIn summary," + sgl.gen("summary", max_tokens=32, stop="\n")


def main(engine: sgl.Engine | None = None) -> sgl.ProgramState:
    own = engine is None
    engine = engine or sgl.Engine()
    sgl.set_default_backend(engine)
    try:
        state = tip_suggestion.run(temperature=0)
        print(state.text())
        for meta in state.get_meta_info("detail"):
            print(f"branch prompt: {meta['prompt_tokens']} tokens, {meta['cached_tokens']} from cache")
        return state
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    main()
