"""Property-based fuzzing of ``psd serve``'s HTTP endpoints, generated from vLLM's own OpenAPI schema (slow: two real
servers on loopback, one after the other).

For the dLLM server (the embedded LLaDA model, default ``psd`` decoding) and, with ``PSD_FUZZ_PRESTO=1``, the
AR + PRESTO server on its generation endpoints,
schemathesis reads the schema the server serves (``/openapi.json``) and sends, for each endpoint in
``fuzz_support.FUZZED`` (completions, chat, batch chat, the Anthropic messages API and its token count,
generative scoring, tokenize / detokenize, a stored response's GET, the cheap GETs; ``fuzz_support.EXCLUDED``
says what is left out and why):

- the schema's examples and schemathesis' coverage cases (each field at its boundaries and with each kind of
  wrong value, one field at a time, plus unexpected-method probes), then ``MAX_EXAMPLES`` Hypothesis-generated
  requests, valid and invalid (``mode = all``);
- for POST /v1/responses, ``MAX_EXAMPLES_RESPONSES`` generated requests only (its coverage cases number ~14000).

Deterministic: Hypothesis derandomized with a fixed seed, no example database, schemathesis' feedback from
responses off, so the requests depend on the schema alone. Each body goes through ``fuzz_support.prepare``
before it is sent (costly valid token / sequence counts capped, invalid values kept as generated; the served
model name, greedy decoding and a valid prompt made likely; see its module docstring).

Properties: no request gets a 5xx, nor a 5xx error event inside a 200 stream, nor no answer (a timeout or a
dropped connection); every such request is recorded with its body and all are reported at the end. Then: the
server process is alive, ``/health`` answers 200, greedy completions are still the reference's (the reference
engine's for the dLLM, plain AR greedy decoding for PRESTO), and at least ``MIN_REQUESTS`` requests were sent.
The failure message has the requests per endpoint and status class, each distinct failure with a minimised
body, and the server log's tracebacks; ``-s`` prints the table and the most frequent 4xx reasons on success too.

Bounds: the coverage cases are fixed by the schema, the generated ones by ``MAX_EXAMPLES``; sending stops after
``TIME_BUDGET_S`` per server (later cases are counted as not sent, and the request-count check says so).
"""

import json
import os

import pytest

from psd_plugin import DEFAULT_AR, DEFAULT_DLLM

pytest.importorskip("vllm")
schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from fuzz_support import (PROBE_METHODS, Recorder, disabled, get_status, minimise, post,  # noqa: E402
                          required_fields, selected, server_tracebacks, unlisted)

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
SEED = 49
# Hypothesis-generated requests per endpoint, besides the examples and coverage cases (CI: 3, for its time)
MAX_EXAMPLES = 6 if os.environ.get("PSD_FULL_MATRIX") else 3
MAX_EXAMPLES_RESPONSES = 50  # POST /v1/responses: generated requests only
MIN_REQUESTS = 2000  # per server (the PRESTO server's fewer endpoints: PRESTO_MIN_REQUESTS)
# the PRESTO server is fuzzed where its path differs from the dLLM server's (its request checks and tree decoding:
# the generation endpoints); tokenize, the GETs and the rest run the same code on both and are fuzzed once
PRESTO_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/messages",
                "/generative_scoring", "/invocations"}
PRESTO_MIN_REQUESTS = 1000
TIME_BUDGET_S = 170  # per server, for sending

SETTINGS = hypothesis.settings(deadline=None, derandomize=True, database=None,
                               suppress_health_check=list(hypothesis.HealthCheck),
                               phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])


def _main_ops(ctx) -> bool:
    op = ctx.operation
    return selected(op.method, op.path) and (op.method.upper(), op.path) != ("POST", "/v1/responses")


def _config(url: str, *, coverage: bool, max_examples: int):
    return schemathesis.Config.from_dict({
        "seed": SEED,
        "base-url": url,
        "generation": {"mode": "all", "deterministic": True, "database": "none", "max-examples": max_examples},
        # no feedback from responses: the requests depend on the schema and the seed alone, not on what the
        # server answered before
        "phases": {"coverage": {"enabled": coverage, "unexpected-methods": PROBE_METHODS,
                                "extra-data-sources": {"responses": False}},
                   "fuzzing": {"error-feedback": {"enabled": False}, "extra-data-sources": {"responses": False}},
                   "examples": {"extra-data-sources": {"responses": False}},
                   "stateful": {"enabled": False}},
    })


def _load_schema(recorder: Recorder, *, coverage: bool = True, max_examples: int = MAX_EXAMPLES):
    """The server's OpenAPI schema, less the endpoints it disables for this model."""
    raw = json.loads(_get(recorder.url + "/openapi.json"))
    new = unlisted(raw)
    assert not new, f"endpoints neither fuzzed nor excluded (decide in tests/fuzz_support.py): {new}"
    recorder.disabled = disabled(recorder.url)
    for method, path in recorder.disabled:
        raw["paths"].get(path, {}).pop(method.lower(), None)
    recorder.required = required_fields(raw)
    return schemathesis.openapi.from_dict(raw, config=_config(recorder.url, coverage=coverage,
                                                             max_examples=max_examples))


def _fuzz_responses(recorder: Recorder) -> None:
    """POST /v1/responses: ``MAX_EXAMPLES_RESPONSES`` generated requests, valid and invalid. (Driven here, not by
    the pytest integration: its coverage cases are too many, and schemathesis 4.32 can meet a negated subschema
    it cannot generate from there; that ends the run with a note, not a failure.)"""
    from hypothesis import strategies as st

    operation = _load_schema(recorder, coverage=False)["/v1/responses"]["POST"]
    strategy = st.one_of([operation.as_strategy(generation_mode=m) for m in schemathesis.GenerationMode])

    @hypothesis.settings(SETTINGS, max_examples=MAX_EXAMPLES_RESPONSES)
    @hypothesis.given(case=strategy)
    def run(case):
        recorder.send(case)

    try:
        run()
    except schemathesis.errors.UnsupportedSchema as e:
        recorder.notes.append(f"POST /v1/responses: generation stopped early: {e}")


def _get(url: str) -> str:
    import urllib.request

    return urllib.request.urlopen(url, timeout=30).read().decode()


def _prompts():
    from transformers import AutoTokenizer

    from psd_plugin.evaluate import encode
    from psd_plugin.train.tasks import TASKS, load_heldout

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_DLLM))
    return [encode(tok, load_heldout(t)[0]["prompt"]) for t in TASKS][:3]


def _served_ids(url: str, model: str, prompt: list[int]) -> list[int] | str:
    status, text = post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 32,
                                                  "temperature": 0, "return_token_ids": True})
    return json.loads(text)["choices"][0]["token_ids"] if status == 200 else f"{status}: {text[:500]}"


def _settle(server, recorder: Recorder, expected: list[tuple[list[int], list[int]]], model: str) -> None:
    """The checks after a fuzz run, all of them, then one assertion with everything that failed."""
    recorder.drain()
    problems = []
    if server.proc.poll() is not None:
        problems.append(f"the server process exited with {server.proc.returncode}")
    health = get_status(server.url + "/health")
    if health != 200:
        problems.append(f"GET /health answered {health} after the run")
    for i, (prompt, answer) in enumerate(expected):
        got = _served_ids(server.url, model, prompt)
        if got != answer:
            problems.append(f"known-good greedy completion {i}: served {got} != reference {answer}")
    least = PRESTO_MIN_REQUESTS if model == "ar-tiny" else MIN_REQUESTS
    if recorder.sent < least:
        problems.append(f"only {recorder.sent} requests sent (< {least}); {recorder.skipped} generated "
                        f"after the {recorder.time_budget_s:.0f} s budget")
    new = recorder.new_failures()
    if new:
        alive = not problems and server.proc.poll() is None
        lines = [f"{len(new)} failures, {len(recorder.distinct(new))} distinct:"]
        for f in recorder.distinct(new):
            lines.append(f.describe())
            if alive:
                small = minimise(server.url, f)
                lines.append(f"  minimised body: {json.dumps(small)[:1500]}" if small is not None
                             else "  (does not fail when sent alone)")
        problems.append("\n".join(lines))
    known = f"known vLLM server errors (fuzz_support.KNOWN_VLLM; not failed on):\n{recorder.known() or '  none'}"
    print(f"\n{model}: requests per endpoint and status class\n{recorder.table()}\n{known}\n"
          f"most frequent refusals (4xx):\n{recorder.top_refusals()}")
    if problems:
        tbs = server_tracebacks(server.log)
        raise AssertionError("\n\n".join([f"{model}: {recorder.table()}", *problems, known,
                                          f"server log: {server.log}; its tracebacks ({len(tbs)} distinct, "
                                          "refusals left out):", *tbs]))


@pytest.fixture(autouse=True)
def _schemathesis_node_id(request):
    """schemathesis 4.32's lazy loading (``from_fixture``) reads and rewrites ``Node._nodeid``, which pytest 9.2's
    nodes no longer have (``nodeid`` is a property there): give the node one to read."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


class _FuzzedServer:
    """One server fuzzed (a subclass says which): its schema-driven cases, the Responses API's generated ones,
    then the checks after the run. The server and its recorder live for the class."""

    ARGS: list[str]
    SERVED: str
    P_GREEDY: float

    def expected(self) -> list[tuple[list[int], list[int]]]:
        """(prompt, the reference's greedy 32 tokens) for a few known-good prompts."""
        raise NotImplementedError

    @pytest.fixture(scope="class")
    @classmethod
    def served(cls):
        from psd_plugin.vllm.server import start

        # eager: the fuzz is about the front end (the compiled model is test_server's and the engine tests'); in a
        # fresh checkout a compiled start costs about 20 s more than its faster decoding saves here
        srv = start([*cls.ARGS, "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32", "--enforce-eager"])
        yield srv, Recorder(srv.url, served=cls.SERVED, max_model_len=MAX_MODEL_LEN, p_greedy=cls.P_GREEDY,
                            time_budget_s=TIME_BUDGET_S)
        srv.stop()

    @pytest.fixture(scope="class")
    @classmethod
    def schema(cls, served):
        return _load_schema(served[1])

    def test_fuzz_responses(self, served):
        _fuzz_responses(served[1])

    @schemathesis.pytest.from_fixture("schema").include(_main_ops).parametrize()
    @SETTINGS
    def test_fuzz(self, case, served):
        served[1].send(case)

    def test_no_server_errors_and_still_serving(self, served):
        _settle(served[0], served[1], self.expected(), self.SERVED)


class TestDLLMServer(_FuzzedServer):
    """``psd serve`` on the embedded dLLM (default ``psd`` decoding: greedy)."""

    ARGS = ["--max-num-seqs", "32"]
    SERVED = "llada-tiny"
    P_GREEDY = 0.75

    def expected(self):
        from model_executor.engine import ReferenceEngine

        engine = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
        return [(p, engine.generate([p], max_tokens=32, method="psd")[0].token_ids) for p in _prompts()]


@pytest.mark.skipif(not os.environ.get("PSD_FUZZ_PRESTO"), reason="PSD_FUZZ_PRESTO=1 fuzzes the PRESTO server too "
                    "(about 4 minutes here; CI fuzzes the shared front end on the dLLM server, PRESTO's own request "
                    "checks are tested in test_vllm_presto.py and its serving in test_reliability.py)")
class TestPrestoServer(_FuzzedServer):
    """``psd serve`` on the AR model: PRESTO tree drafting with the embedded drafter (``PSD_FUZZ_PRESTO=1``)."""

    ARGS = [str(DEFAULT_AR), "--served-model-name", "ar-tiny"]
    SERVED = "ar-tiny"
    P_GREEDY = 0.5

    @pytest.fixture(scope="class")
    @classmethod
    def schema(cls, served):
        return _load_schema(served[1]).include(lambda ctx: ctx.operation.path in PRESTO_PATHS)

    def expected(self):
        from model_executor.ar_engine import AREngine

        engine = AREngine.from_pretrained(DEFAULT_AR)
        prompts = _prompts()
        return list(zip(prompts, [r.token_ids for r in engine.generate(prompts, max_tokens=32)]))
