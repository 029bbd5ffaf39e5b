"""An async web service that runs programs concurrently on one event loop (Starlette).

    python examples/async_web_app.py

`create_app(engine)` builds the app: `POST /ask {"question": ...}` runs an `async def`
program with `await program.arun(...)`. The program awaits a (simulated) lookup between its
two gens; while it waits, and while its gens run, the event loop serves the other requests,
and the engine batches the gens of all of them. No thread per request or per program.

`main()` starts the app with uvicorn on a free loopback port, sends N concurrent requests with
httpx, prints the answers and shuts the server down.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import sgl

FACTS = {"paris": "Paris is the capital of France.", "tokyo": "Tokyo is the capital of Japan.",
         "nile": "The Nile is a river in Africa.", "everest": "Everest is the highest mountain."}


async def lookup(topic: str) -> str:
    """A stand-in for an HTTP call or a database query: it awaits, it does not block."""
    await asyncio.sleep(0.05)
    words = topic.lower().replace("?", " ").split()
    return next((fact for key, fact in FACTS.items() if key in words), "No notes found.")


@sgl.function
async def ask(s, question):
    s += ("Answer the question. First name its main topic in one word.\n\n"
          "Question: How tall is the Eiffel Tower?\nTopic: Eiffel\n"
          "Notes: The Eiffel Tower is 330 metres tall.\nAnswer: It is 330 metres tall.\n\n")
    s += "Question: " + question + "\nTopic:" + sgl.gen("topic", max_tokens=6, stop=["\n", "."])
    notes = await lookup(await s.aget("topic"))
    s += "\nNotes: " + notes + "\nAnswer:" + sgl.gen("answer", max_tokens=20, stop="\n")


def create_app(engine: sgl.Engine) -> Starlette:
    stats = {"in_flight": 0, "max_in_flight": 0, "served": 0}

    async def ask_endpoint(request: Request) -> JSONResponse:
        body = await request.json()
        question = body.get("question")
        if not isinstance(question, str) or not question.strip():
            return JSONResponse({"error": "send {\"question\": \"...\"}"}, status_code=400)
        stats["in_flight"] += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        try:
            state = await ask.arun(question=question, backend=engine, temperature=0)
        except sgl.ProgramError as exc:
            return JSONResponse({"error": str(exc)}, status_code=500)
        finally:
            stats["in_flight"] -= 1
        stats["served"] += 1
        return JSONResponse({"question": question, "topic": await state.aget("topic"),
                             "answer": await state.aget("answer")})

    async def stats_endpoint(request: Request) -> JSONResponse:
        return JSONResponse({**stats, "cache_hit_rate": engine.stats().cache_hit_rate})

    return Starlette(routes=[Route("/ask", ask_endpoint, methods=["POST"]),
                             Route("/stats", stats_endpoint)])


QUESTIONS = ["What country is Paris the capital of?", "Which country has Tokyo as its capital?",
             "On which continent is the Nile?", "What is Everest?",
             "What is the capital of France?", "Where is Tokyo?"]


async def serve_and_query(engine: sgl.Engine, questions: list[str]) -> dict[str, Any]:
    """Start the app on a free loopback port, send all questions at once, shut down."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # port 0: the OS picks a free port
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            start = time.perf_counter()
            responses = await asyncio.gather(
                *(client.post("/ask", json={"question": q}) for q in questions))
            elapsed = time.perf_counter() - start
            stats = (await client.get("/stats")).json()
    finally:
        server.should_exit = True
        await serving
        sock.close()
    return {"responses": [(r.status_code, r.json()) for r in responses], "stats": stats,
            "seconds": elapsed}


def main(engine: sgl.Engine | None = None, questions: list[str] | None = None) -> dict[str, Any]:
    own = engine is None
    engine = engine or sgl.Engine()
    try:
        result = asyncio.run(serve_and_query(engine, questions or QUESTIONS))
        for status, body in result["responses"]:
            print(status, body)
        print(f"{len(result['responses'])} requests in {result['seconds']:.1f} s; server stats: "
              f"{result['stats']}")
        return result
    finally:
        if own:
            engine.close()


if __name__ == "__main__":
    main()
