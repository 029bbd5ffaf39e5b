"""Many programs at once with `run_batch` and a progress bar.

    python examples/run_batch.py

`run_batch` runs every program concurrently (at most `num_threads` at a time), so the engine
batches their gens. It first traces the program to find its constant prefix (the instructions
and examples below) and caches it once, so every program starts from the cached KV.
"""

from __future__ import annotations

import sgl

LABELS = ["positive", "negative"]

REVIEWS = [
    "I loved this film, the acting was wonderful.",
    "Terrible service, I will never come back.",
    "The food was delicious and the staff were friendly.",
    "The battery died after two days. Very disappointing.",
    "Best purchase I have made all year!",
    "The hotel room was dirty and smelled bad.",
    "A beautiful, moving story. Highly recommended.",
    "It broke the first time I used it.",
]


@sgl.function
def classify(s, review):
    s += ("Classify the sentiment of each review as positive or negative.\n\n"
          "Review: The concert was amazing and the crowd was great.\nSentiment: positive\n\n"
          "Review: The package arrived broken and support ignored me.\nSentiment: negative\n\n")
    s += "Review: " + review + "\nSentiment: " + sgl.select("label", LABELS)
    s += "\nReason: the review" + sgl.gen("reason", max_tokens=16, stop="\n")


def main(engine: sgl.Engine | None = None) -> list[sgl.ProgramState]:
    own = engine is None
    engine = engine or sgl.Engine()
    sgl.set_default_backend(engine)
    try:
        states = classify.run_batch([{"review": r} for r in REVIEWS], progress_bar=True,
                                    temperature=0)
        for review, state in zip(REVIEWS, states):
            if state.error() is not None:  # run_batch keeps failures on the state
                print(f"{review[:40]:<42} error: {state.error()}")
                continue
            print(f"{review[:40]:<42} {state['label']:<9} the review{state['reason']}")
        stats = engine.stats()
        print(f"cache hit rate so far: {stats.cache_hit_rate:.0%}")
        return states
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    main()
