"""Structured-output grammars of served dLLM requests, compiled off the step.

The front end builds a request's grammar (:func:`.validation.take_structured_outputs`: a constraint over
``max_grammar_bytes`` is a 400) and ships its serialized text in ``SamplingParams.extra_args``. Compiling it
for the tokenizer is the slow part (xgrammar's token-mask cache: milliseconds for a small schema and a small
vocabulary, seconds for a large schema over a 150k vocabulary), and used to happen inside the worker's step, where
one heavy schema stalled every request. Now, as vLLM's own structured-output manager does:

- :class:`GrammarCompiles` (the scheduler's, in the engine-core process): a request with a grammar is added to
  vLLM's waiting queue held (:func:`~.compat.hold_for_grammar`: vLLM's scheduler skips it) and its grammar goes
  to a small thread pool; the scheduler releases it when the grammar is compiled, or fails it (finish reason
  ``error``) when compiling raised or took longer than ``grammar_compile_timeout`` seconds. Plain requests are
  scheduled meanwhile.
- :func:`compiled` (the worker's): the compiled grammar of a request, from the same process-wide compiler,
  whose cache holds what the scheduler's thread compiled (the worker runs in the engine-core process with one
  rank). Its cache is bounded in bytes by vLLM's ``VLLM_XGRAMMAR_CACHE_MB`` (default 512), as vLLM's own
  xgrammar backend is. Under tensor parallelism the workers are processes of their own and compile a request's
  grammar once more, in the step that admits it (documented limitation).

CPU: a compile releases the GIL, but it is CPU work beside the step's. xgrammar compiles one grammar on up to 8
threads by default, which on a small host takes every core; and on vLLM's CPU backend the forward's OpenMP threads
take every core too, so any thread that competes with them stalls the forward (measured on the 2-core CI machine:
32 requests decoded in 0.38 s alone, 1.6-4.5 s beside one busy thread, 0.52 s beside grammar compiles at the
lowest priority, which still finished in 2.3 s against 2.1 s alone). So each compile here runs on one thread,
at most ``cpu_count // 4`` (at least 1) at once, at the lowest scheduling priority (``nice`` 19: Linux threads
have their own); it takes the cores the step leaves idle. While nothing else can be scheduled the scheduler waits
for a compile to finish (up to 10 ms) instead of spinning through empty steps.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from model_executor.grammar import compiler_for, deserialize_grammar, tokenizer_info

from . import compat

_SERVED: dict[tuple, tuple] = {}  # (tokenizer, revision, vocab size) -> (xgrammar tokenizer info, compiler)


def served_compiler(model_config):
    """This process's xgrammar compiler for the served model's tokenizer (one per process, shared by the
    scheduler's compile threads and the worker), with its tokenizer info; its cache is bounded in bytes."""
    key = (str(model_config.tokenizer), getattr(model_config, "tokenizer_revision", None),
           model_config.get_vocab_size())
    hit = _SERVED.get(key)
    if hit is None:
        info = tokenizer_info(compat.worker_tokenizer(model_config), model_config.get_vocab_size())
        hit = _SERVED[key] = (info, compiler_for(info, cache_limit_bytes=compat.grammar_cache_bytes(), max_threads=1))
    return hit


def compiled(model_config, text: str):
    """The compiled grammar of a request's grammar ``text`` (``extra_args[GRAMMAR_ARG]``): a cache hit when the
    scheduler compiled it in this process."""
    _, compiler = served_compiler(model_config)
    return compiler.compile_grammar(deserialize_grammar(text))


def _lowest_priority() -> None:
    """A compile thread yields the CPU to everything else in the process (the step's threads): ``nice`` 19 for
    this thread (Linux: a thread has its own nice value; elsewhere, nothing)."""
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class GrammarCompiles:
    """The scheduler's grammar compiles (module docstring): at most ``threads`` at once (default a quarter of the
    host's cores, at least one), each allowed ``timeout`` seconds."""

    def __init__(self, model_config, timeout: float, threads: int | None = None):
        self.model_config = model_config
        self.timeout = timeout
        self.pool: ThreadPoolExecutor | None = None
        self.threads = threads or max(1, (os.cpu_count() or 1) // 4)
        self.pending: dict[str, tuple[object, Future, float]] = {}  # request id -> (request, compile, started)

    def hold(self, request, text: str) -> None:
        """Hold ``request`` (about to be added to vLLM's waiting queue) until its grammar ``text`` compiles."""
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="psd-grammar", initializer=_lowest_priority)
        compat.hold_for_grammar(request)
        self.pending[request.request_id] = (request, self.pool.submit(compiled, self.model_config, text),
                                            time.monotonic())

    def poll(self, live) -> list[tuple[str, str]]:
        """Release the held requests whose grammar compiled (vLLM schedules them from now on); returns the ones
        that failed, ``(request id, why)``. Requests no longer in ``live`` (aborted) are dropped."""
        failed, now = [], time.monotonic()
        for rid, (request, future, started) in list(self.pending.items()):
            if rid not in live:
                future.cancel()
                del self.pending[rid]
            elif future.done():
                del self.pending[rid]
                err = future.exception()
                if err is None:
                    compat.release_from_grammar_hold(request)
                else:
                    failed.append((rid, f"compiling its grammar raised {type(err).__name__}: {err}"))
            elif now - started > self.timeout:
                del self.pending[rid]  # the thread finishes on its own; its result is dropped
                failed.append((rid, f"its grammar did not compile in {self.timeout:g} s (grammar_compile_timeout)"))
        return failed

    def wait(self, seconds: float) -> None:
        """Block until a held request's grammar compiles, at most ``seconds`` (the scheduler has nothing else to
        schedule)."""
        if self.pending:
            wait([f for _, f, _ in self.pending.values()], timeout=seconds, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
