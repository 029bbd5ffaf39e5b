"""Parallel encoding: read several documents in parallel branches, then answer over all of them.

    python examples/parallel_encoding.py

Each branch of `s.fork(n)` reads one document and writes a one-line note about it; the
branches run concurrently (the engine batches their prefills and decodes).
`forks.join(mode="concate_and_append")` then appends every branch's text, in order, to the
parent, which answers a question over the whole context.

In SGLang this mode concatenates the branches' KV caches; sgl's engine has no KV
concatenation, so the parent re-encodes the appended text (see docs/language.md).
"""

from __future__ import annotations

import sgl

DOCUMENTS = [
    "The Eiffel Tower is in Paris. It was finished in 1889 and is 330 metres tall.",
    "The Colosseum is in Rome. It was finished in 80 AD and could hold 50,000 people.",
    "The Golden Gate Bridge is in San Francisco. It opened in 1937 and is painted orange.",
]


@sgl.function
def answer_over_documents(s, documents, question):
    s += "Read the documents, then answer the question.\n\n"
    forks = s.fork(len(documents))
    forks += lambda i: f"Document {i + 1}: {documents[i]}\nNote: this document is about"
    forks += sgl.gen("note", max_tokens=12, stop=["\n", "."])
    forks += ".\n\n"
    forks.join(mode="concate_and_append")
    s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=16, stop="\n")


def main(engine: sgl.Engine | None = None) -> sgl.ProgramState:
    own = engine is None
    engine = engine or sgl.Engine()
    sgl.set_default_backend(engine)
    try:
        state = answer_over_documents.run(
            documents=DOCUMENTS, question="Which of these was finished first?", temperature=0)
        print(state.text())
        return state
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    main()
