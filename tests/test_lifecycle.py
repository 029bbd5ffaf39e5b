"""Process lifecycle of the sync API, as a script experiences it (issue 12), in subprocesses.

- A script that uses `generate_sync` / `stream_sync` and never calls `close()` exits, also
  after `generate_sync` raised `EngineClosedError` (it used to hang forever: the sync portal's
  thread was not a daemon).
- Ctrl-C (SIGINT) during `generate_sync`, `stream_sync` or a program's `f.run()` aborts the
  request and ends the script with a short KeyboardInterrupt traceback and exit status 130
  (killed by SIGINT), never `terminate called without an active exception` / exit 134.

The child scripts run a random-weight model large enough that the interrupted generation
would take about a minute, so exiting within seconds proves it was aborted, not finished.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sgl.backend.model_loader import resolve_model_path

PRELUDE = textwrap.dedent("""
    import sys, time
    import sgl
    CONFIG = dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1024, vocab_size=49152, max_position_embeddings=8192, eos_token_id=0)
    engine = sgl.Engine(model_config=CONFIG, load_format="dummy", device="cpu", max_total_tokens=16384,
                        tokenizer=sys.argv[1])
    LONG = dict(max_new_tokens=4000, ignore_eos=True, temperature=0)

    def report_idle():
        # After Ctrl-C the request must be gone from the engine (aborted), not running on.
        deadline = time.time() + 10
        while time.time() < deadline:
            s = engine.stats()
            if s.running == 0 and s.waiting == 0:
                break
            time.sleep(0.05)
        s = engine.stats()
        print(f"after interrupt: running={s.running} waiting={s.waiting}", flush=True)
""")

EXIT_LIMIT_S = 120  # model load on a busy 2-core machine included
INTERRUPT_LIMIT_S = 20  # from SIGINT to exit; the interrupted request would run ~60 s


def _script(body: str) -> list[str]:
    code = PRELUDE + textwrap.dedent(body)
    return [sys.executable, "-c", code, str(resolve_model_path(None))]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _run_to_end(body: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(_script(body), capture_output=True, text=True, timeout=EXIT_LIMIT_S, env=_env())
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the script did not exit within {EXIT_LIMIT_S} s; stdout: {exc.stdout!r}")


def _sigint_default() -> None:
    # A test run started in the background of a non-interactive shell (`pytest ... &`, as a CI
    # script may) inherits SIGINT as ignored, and Python installs its KeyboardInterrupt handler
    # only where SIGINT is not ignored: the child would never see the Ctrl-C this test sends.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(body: str, ready: str = "ready") -> tuple[int, str, str, float]:
    """Run `body`, send SIGINT 1.5 s after it prints `ready`; (status, stdout, stderr, s to exit)."""
    proc = subprocess.Popen(_script(body), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            preexec_fn=_sigint_default)
    try:
        lines = []
        start = time.monotonic()
        while time.monotonic() - start < EXIT_LIMIT_S:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.strip() == ready:
                break
        assert lines and lines[-1].strip() == ready, (lines, proc.stderr.read() if proc.poll() is not None else "")
        time.sleep(1.5)  # the request is now mid-generation
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        try:
            out, err = proc.communicate(timeout=INTERRUPT_LIMIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"no exit within {INTERRUPT_LIMIT_S} s of Ctrl-C; stdout {out!r}; stderr {err[-2000:]!r}")
        return proc.returncode, "".join(lines) + out, err, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _assert_clean_interrupt(status: int, out: str, err: str) -> None:
    assert "terminate called" not in err and status != -signal.SIGABRT, err[-2000:]
    # Python ends an uncaught KeyboardInterrupt by re-raising SIGINT: a shell shows 130.
    assert status in (-signal.SIGINT, 130), (status, err[-2000:])
    assert "after interrupt: running=0 waiting=0" in out, out
    assert err.rstrip().endswith("KeyboardInterrupt"), err[-2000:]
    assert len(err.strip().splitlines()) <= 30, f"a long traceback:\n{err}"


def test_script_without_close_exits() -> None:
    res = _run_to_end("""
        out = engine.generate_sync("Hello", max_new_tokens=4, temperature=0)
        chunks = list(engine.stream_sync("Hello", max_new_tokens=4, temperature=0))
        for chunk in engine.stream_sync("Hello", max_new_tokens=50, temperature=0):
            break  # left early: the rest of that stream is aborted
        print("done", len(out.token_ids), chunks[-1].finish_reason, flush=True)
    """)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "done 4 length" in res.stdout
    assert "Traceback" not in res.stderr, res.stderr[-2000:]


def test_script_exits_after_engine_closed_error() -> None:
    res = _run_to_end("""
        engine.generate_sync("Hello", max_new_tokens=2, temperature=0)  # starts the sync loop
        engine.close()
        try:
            engine.generate_sync("Hello", max_new_tokens=2)
        except sgl.EngineClosedError:
            print("closed error", flush=True)
        try:
            next(iter(engine.stream_sync("Hello", max_new_tokens=2)))
        except sgl.EngineClosedError:
            print("closed error again", flush=True)
    """)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "closed error\nclosed error again" in res.stdout


def test_ctrl_c_during_generate_sync_aborts_and_exits_130() -> None:
    status, out, err, took = _interrupt("""
        print("ready", flush=True)
        try:
            engine.generate_sync("Hello", **LONG)
        except KeyboardInterrupt:
            report_idle()
            raise
        print("finished instead of being interrupted", flush=True)
    """)
    _assert_clean_interrupt(status, out, err)


def test_ctrl_c_during_stream_sync_aborts_and_exits_130() -> None:
    status, out, err, took = _interrupt("""
        try:
            for i, chunk in enumerate(engine.stream_sync("Hello", **LONG)):
                if i == 0:
                    print("ready", flush=True)
        except KeyboardInterrupt:
            report_idle()
            raise
        print("finished instead of being interrupted", flush=True)
    """)
    _assert_clean_interrupt(status, out, err)


def test_ctrl_c_during_program_run_aborts_and_exits_130() -> None:
    status, out, err, took = _interrupt("""
        @sgl.function
        def story(s):
            s += "Once upon a time" + sgl.gen("rest", max_tokens=4000, ignore_eos=True, temperature=0)

        sgl.set_default_backend(engine)
        print("ready", flush=True)
        try:
            state = story.run()
            state["rest"]
        except KeyboardInterrupt:
            report_idle()
            raise
        print("finished instead of being interrupted", flush=True)
    """)
    _assert_clean_interrupt(status, out, err)


def test_engine_dropped_without_close_stops_its_threads() -> None:
    import gc
    import weakref

    from test_engine_core import make_engine

    eng = make_engine()
    eng.generate_sync(input_ids=[1, 2, 3], max_new_tokens=2)
    threads = [eng._rt.core._thread, eng._sync.get()._thread]
    runtime = weakref.ref(eng._rt)
    del eng
    gc.collect()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    assert not any(t.is_alive() for t in threads), "an unreferenced engine kept its threads running"
    gc.collect()
    assert runtime() is None, "an unreferenced engine's runtime (model, KV pool) was not freed"
