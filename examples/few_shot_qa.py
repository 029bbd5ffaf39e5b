"""Few-shot question answering: a constant prompt of worked examples, then one gen per question.

    python examples/few_shot_qa.py

The examples are the same for every question, so after the first program the engine's radix
cache holds them: later programs prefill only their own question (see `cached_tokens`).
"""

from __future__ import annotations

import sgl

EXAMPLES = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the largest planet in the solar system?", "Jupiter"),
]

QUESTIONS = [
    "What is the capital of Italy?",
    "What is the capital of Japan?",
    "What color is the sky on a clear day?",
]


@sgl.function
def few_shot_qa(s, question):
    s += "Answer each question in a few words.\n\n"
    for q, a in EXAMPLES:
        s += "Q: " + q + "\nA: " + a + "\n\n"
    s += "Q: " + question + "\n"
    # stop at the end of the line: the model would otherwise invent the next "Q:" itself.
    s += "A:" + sgl.gen("answer", max_tokens=12, stop="\n", temperature=0)


def main(engine: sgl.Engine | None = None) -> list[sgl.ProgramState]:
    """Answer QUESTIONS one program at a time; pass `engine` to reuse a loaded one."""
    own = engine is None
    engine = engine or sgl.Engine()
    sgl.set_default_backend(engine)
    try:
        states = []
        for question in QUESTIONS:
            state = few_shot_qa.run(question=question)
            meta = state.get_meta_info("answer")
            print(f"Q: {question}\nA:{state['answer']}   "
                  f"(prompt {meta['prompt_tokens']} tokens, {meta['cached_tokens']} from cache)")
            states.append(state)
        return states
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    main()
