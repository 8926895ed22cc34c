"""Schema-driven fuzzing of a running ``psd serve`` (``tests/test_fuzz.py``): which endpoints, what is done to a
generated request before it is sent, and a recorder of every request and every server error.

Endpoints: ``FUZZED`` (in vLLM's ``/openapi.json``); ``EXCLUDED`` and ``STATEFUL`` are left out, with why;
:func:`disabled` finds the ones the served model does not support (vLLM answers 501 to every request there).

Before sending (:func:`prepare`; every choice is drawn from a hash of the generated body, so the same body always
becomes the same request):

- cost: a generated request may ask for thousands of tokens or sequences. Only a field holding a *valid* but
  expensive number changes: a token count (``TOKEN_FIELDS``) in ``(CAP_TOKENS, max_model_len]`` becomes
  ``CAP_TOKENS``, ``n`` / ``best_of`` in ``(CAP_N, VLLM_MAX_N_SEQUENCES]`` becomes ``CAP_N`` (and a
  ``min_tokens`` that was past ``max_tokens`` stays past it). Invalid values stay as generated (negative,
  zero, a float, a string, null, a list, past ``max_model_len`` or vLLM's ``n`` limit), so each validation path
  the generator reaches is still taken, and a valid value stays valid: only the cost changes;
- reach: most generated requests would be refused before any plugin code runs (an unknown model name, no
  prompt, a schema template's ``tools: []``). So a string ``model`` becomes the served name 7 times in 8 (an
  absent one 3 in 4), a non-negative or absent ``temperature`` becomes 0 with probability ``p_greedy`` (greedy
  outputs are the ones checked against the reference), and an absent or empty field
  of ``BASE`` (a prompt, messages, a small ``max_tokens``) is filled 3 times in 4. A coverage-phase case varies
  one field of a template (schemathesis' metadata says which, :func:`varied_field`): 3 times in 4 it is sent
  as that field alone on the ``BASE`` request, so the variation is what the server judges. The varied field,
  non-string models and negative temperatures are never changed.

Properties (:class:`Recorder`, which sends from ``concurrency`` threads, as concurrent clients would): no
response has a 5xx status, no streamed response carries an error event with a 5xx code (vLLM reports an error
inside a stream that already answered 200 that way), no request times out or loses its connection. Every
failure is kept with its request; ``KNOWN_VLLM`` lists vLLM's own (reproduced without the plugin), which are
reported and not failed on. :func:`minimise` shrinks a failing body, :func:`server_tracebacks` reads the server's
log.
"""

from __future__ import annotations

import collections
import http.client
import json
import re
import threading
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field

CAP_TOKENS = 8
CAP_N = 2
MAX_N_SEQUENCES = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default: a larger n is refused, so it stays
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")
SEQUENCE_FIELDS = ("n", "best_of")

# (method, path) fuzzed: the generation endpoints, the ones that tokenize or score through the served model, and
# the cheap reads. Each also gets schemathesis' unexpected-method probes (a 405 is the right answer).
FUZZED = {
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
    ("POST", "/v1/chat/completions/batch"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
    ("POST", "/v1/systemone"), ("POST", "/generative_scoring"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("GET", "/v1/responses/{response_id}"), ("POST", "/invocations"),
    ("GET", "/health"), ("GET", "/v1/models"), ("GET", "/version"), ("GET", "/ping"), ("POST", "/ping"),
    ("GET", "/load"), ("GET", "/metrics"), ("GET", "/kv_event_sources"),
}
EXCLUDED = {  # (method, path): why it is not fuzzed
    ("POST", "/scale_elastic_ep"): "admin: rescales elastic expert parallelism (mutates the deployment)",
    ("POST", "/is_scaling_elastic_ep"): "admin: elastic expert parallelism state, irrelevant without it",
    ("POST", "/v1/responses/{response_id}/cancel"): "mutates server state (cancels a stored background response)",
}
# Never fuzzed even if a later vLLM serves them: they change server state or are admin/dev-mode endpoints.
STATEFUL = re.compile(r"^/(sleep|wake_up|is_sleeping|reset_\w+|pause|resume|scale\w*|is_scaling\w*|start_profile|"
                      r"stop_profile|collective_rpc|update_weights?\w*|load_lora_adapter|unload_lora_adapter|"
                      r"server_info|v1/load_lora_adapter|v1/unload_lora_adapter|abort_requests|shutdown)")
# Unexpected-method probes (schemathesis' coverage phase sends each operation's path with these; a 405 is right)
PROBE_METHODS = ["get", "put", "patch", "delete", "options", "trace"]


def selected(method: str, path: str) -> bool:
    return (method.upper(), path) in FUZZED and not STATEFUL.match(path)


def unlisted(raw_schema: dict) -> list[tuple[str, str]]:
    """Operations of the served schema that are neither fuzzed nor excluded with a reason (a new vLLM endpoint:
    decide about it)."""
    ops = [(m.upper(), p) for p, item in raw_schema.get("paths", {}).items() for m in item
           if m in ("get", "post", "put", "patch", "delete")]
    return sorted(o for o in ops if o not in FUZZED and o not in EXCLUDED and not STATEFUL.match(o[1]))


def _draw(body: dict, salt: str, denominator: int) -> int:
    """A number in ``range(denominator)`` fixed by the body (reproducible with the body alone)."""
    return zlib.crc32((salt + json.dumps(body, sort_keys=True, default=repr)).encode()) % denominator


def _valid_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


PROMPT = "Reverse the list: a b c d"
_USER = {"role": "user", "content": PROMPT}
BASE = {  # per endpoint: valid values for the fields a request needs to get past the first checks
    "/v1/completions": {"prompt": PROMPT, "max_tokens": 4},
    "/v1/chat/completions": {"messages": [_USER], "max_tokens": 4},
    "/v1/chat/completions/batch": {"messages": [[_USER], [{"role": "user", "content": "a b"}]], "max_tokens": 4},
    "/v1/messages": {"messages": [_USER], "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": [_USER]},
    "/v1/responses": {"input": PROMPT, "max_output_tokens": 4},
    "/generative_scoring": {"query": PROMPT, "items": [" d c b a", " a b c d"], "label_token_ids": [5, 6]},
    "/tokenize": {"prompt": PROMPT},
    "/detokenize": {"tokens": [5, 6, 7]},
}


def _empty(v) -> bool:
    return v is None or (isinstance(v, (list, dict, str)) and not v)


def varied_field(case) -> str | None:
    """The top-level body property a coverage-phase case varies (its one deliberate difference from a
    template), from schemathesis' metadata; None for other cases or when it is not one property."""
    meta = getattr(case, "meta", None)
    data = getattr(getattr(meta, "phase", None), "data", None)
    if data is None or str(meta.phase.name) != "coverage":
        return None
    m = re.match(r"/properties/([^/]+)", getattr(data, "location", None) or "")
    if m:
        return m.group(1).replace("~1", "/").replace("~0", "~")
    desc = getattr(data, "description", None) or ""
    m = re.match(r"(?:Missing required property: |Object with (?:valid|all required properties and) ')([^']+)",
                 desc)
    return m.group(1) if m else None


def prepare(body, *, path: str, varied: str | None, required: set, served: str, max_model_len: int,
            p_greedy: float):
    """The body to send instead of the generated ``body`` (not changed in place); see the module's docstring.
    Every choice is drawn from a hash of the generated body: the same body always gives the same request."""
    if not isinstance(body, dict):
        return body
    base = BASE.get(path, {})
    out = dict(body)
    focused = varied is not None and _draw(body, "focus", 4) != 0
    if focused:  # the varied field alone on a valid base: the template's other fields dropped or replaced
        out = {k: v for k, v in out.items() if k in required or k == varied}
    for k, v in base.items():
        if k != varied and (focused or (_empty(out.get(k)) and _draw(body, "base:" + k, 4) != 0)):
            out[k] = json.loads(json.dumps(v))
    for name in TOKEN_FIELDS:
        v = out.get(name)
        if _valid_int(v) and CAP_TOKENS < v <= max_model_len:
            out[name] = CAP_TOKENS
    lo, hi = body.get("min_tokens"), body.get("max_tokens")
    if _valid_int(lo) and _valid_int(hi) and 0 <= hi < lo <= max_model_len:  # refused as generated: stays refused
        out["min_tokens"] = out["max_tokens"] + 1
    for name in SEQUENCE_FIELDS:
        v = out.get(name)
        if _valid_int(v) and CAP_N < v <= MAX_N_SEQUENCES:
            out[name] = CAP_N
    if varied != "model":
        if focused or (isinstance(out.get("model"), str) and _draw(body, "model", 8) != 0):
            out["model"] = served
        elif out.get("model") is None and _draw(body, "model", 4) != 0:
            out["model"] = served
    t = out.get("temperature")
    if varied != "temperature" and (t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0)) \
            and _draw(body, "temperature", 1000) < p_greedy * 1000:
        out["temperature"] = 0.0
    return out


def required_fields(raw_schema: dict) -> dict[tuple[str, str], set]:
    """(method, path) -> the top-level properties its JSON request body requires (any of its alternatives)."""
    comps = raw_schema.get("components", {}).get("schemas", {})

    def resolve(s):
        while isinstance(s, dict) and "$ref" in s:
            s = comps.get(s["$ref"].rsplit("/", 1)[-1], {})
        return s if isinstance(s, dict) else {}

    out = {}
    for path, item in raw_schema.get("paths", {}).items():
        for method, op in item.items():
            if not isinstance(op, dict):
                continue
            s = resolve(op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema"))
            alts = [resolve(a) for a in s.get("anyOf", s.get("oneOf", []))] or [s]
            out[(method.upper(), path)] = {k for a in alts for k in a.get("required", [])}
    return out


def status_class(status: int | None) -> str:
    return "no response" if status is None else f"{status // 100}xx"


_STREAM_ERROR = re.compile(r'^data: (\{"error".*)$', re.M)


def stream_server_errors(text: str) -> list[str]:
    """The error events with a 5xx code in a server-sent-events body."""
    found = []
    for m in _STREAM_ERROR.finditer(text):
        try:
            code = json.loads(m.group(1))["error"].get("code")
        except (ValueError, KeyError, AttributeError, TypeError):
            continue
        if isinstance(code, int) and code >= 500:
            found.append(m.group(1)[:2000])
    return found


@dataclass
class Failure:
    method: str
    path: str  # with query string
    body: object  # what was sent (JSON value, or None)
    status: int | None
    text: str  # the response (or the transport error)
    kind: str  # "5xx", "5xx in stream", "timeout/connection"

    def signature(self) -> tuple:
        """Failures with the same signature are the same bug, most likely (for minimising once per bug)."""
        msg = re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", self.text))[:160]
        return self.method, self.path.split("?")[0], self.kind, msg

    def describe(self, limit: int = 1500) -> str:
        body = json.dumps(self.body)
        body = body if len(body) <= limit else body[:limit] + f"... ({len(body)} chars)"
        return f"{self.kind}: {self.method} {self.path} -> {self.status}\n  body: {body}\n  response: {self.text[:600]}"


def _assistant_message_input(body) -> bool:
    items = body.get("input") if isinstance(body, dict) else None
    return isinstance(items, list) and any(isinstance(i, dict) and i.get("type") == "message"
                                           and i.get("role") == "assistant" for i in items)


# Server errors of vLLM 0.32.0 itself, reproduced on plain vLLM (``server.start(..., plain=True)`` on the AR model,
# no speculative config): (what, where in vLLM, does this failure match). A failure matching one is reported as
# known, not failed on; the match looks at both the request and the answer, so that a plugin failure with the same
# symptom on another request still fails. Delete an entry once vLLM fixes it.
KNOWN_VLLM = (
    ("structured_outputs that is not an object: 500 \"'<type>' object has no attribute 'get'\"",
     "vllm/entrypoints/openai/{chat_completion,completion}/protocol.py: check_structured_outputs_count (a "
     "mode='before' model validator) calls .get on the raw value",
     lambda f: f.kind == "5xx" and f.path in ("/v1/chat/completions", "/v1/completions")
     and isinstance(f.body, dict) and not isinstance(f.body.get("structured_outputs"), (dict, type(None)))
     and "object has no attribute 'get'" in f.text),
    ("Responses API input with an assistant message whose content is a refusal or empty: 500",
     "vllm/entrypoints/openai/responses/utils.py:399 _construct_message_from_response_item: item.content[0].text",
     lambda f: f.kind == "5xx" and f.path == "/v1/responses" and _assistant_message_input(f.body)
     and ("'ResponseOutputRefusal' object has no attribute 'text'" in f.text or "list index out of range" in f.text)),
    ("streamed Responses API request with \"background\": null: 200, then the connection drops",
     "vllm/entrypoints/openai/responses/serving.py:1358 responses_stream_generator: ResponsesResponse.from_request "
     "fails validation (background must be a bool) after the stream started",
     lambda f: f.kind == "timeout/connection" and f.path == "/v1/responses" and isinstance(f.body, dict)
     and f.body.get("stream") is True and "background" in f.body and f.body["background"] is None
     and "ChunkedEncodingError" in f.text),
)


def known_vllm(failure) -> str | None:
    """The ``KNOWN_VLLM`` entry a failure matches (its description), or None."""
    for what, where, match in KNOWN_VLLM:
        try:
            if match(failure):
                return f"{what} ({where})"
        except Exception:  # noqa: BLE001 - a body of an unexpected shape: not this entry
            continue
    return None


@dataclass
class Recorder:
    """Sends cases to a server and keeps the counts (per endpoint and status class) and every failure."""
    url: str
    served: str
    max_model_len: int
    p_greedy: float
    time_budget_s: float
    request_timeout_s: float = 60.0
    counts: collections.Counter = field(default_factory=collections.Counter)  # (method, path, class) -> n
    failures: list[Failure] = field(default_factory=list)
    skipped: int = 0  # cases generated after the time budget ran out (not sent)
    disabled: dict = field(default_factory=dict)  # (method, path) -> why: left out (``disabled``)
    reasons: collections.Counter = field(default_factory=collections.Counter)  # (endpoint, 4xx message) -> n
    required: dict = field(default_factory=dict)  # (method, path) -> required body properties
    notes: list = field(default_factory=list)  # generator limitations met (not server failures)
    seconds: collections.Counter = field(default_factory=collections.Counter)  # (method, path) -> time answering
    slowest: list = field(default_factory=list)  # the slowest requests: (seconds, method, path, body)
    started: float | None = None
    finished: float | None = None

    concurrency: int = 4  # requests in flight at once (the engine batches them, as it would real clients)
    _pool: object = None
    _slots: object = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def sent(self) -> int:
        return sum(self.counts.values())

    def send(self, case) -> None:
        """Prepare a schemathesis case's body (``prepare``) and send it from a worker thread, which records the
        outcome (``drain`` waits for them all); at most ``2 * concurrency`` cases wait or run at once."""
        from concurrent.futures import ThreadPoolExecutor

        now = time.monotonic()
        if self.started is None:
            self.started = now
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="fuzz")
            self._slots = threading.BoundedSemaphore(2 * self.concurrency)
        if now - self.started > self.time_budget_s:
            self.skipped += 1
            return
        method, path = case.method.upper(), case.operation.path
        if case.body is not None and not _is_not_set(case.body):
            case.body = prepare(case.body, path=path, varied=varied_field(case),
                                required=self.required.get((method, path), set()), served=self.served,
                                max_model_len=self.max_model_len, p_greedy=self.p_greedy)
        if method != case.operation.method.upper():  # an unexpected-method probe
            path = "(probe of each fuzzed path)"
        self._slots.acquire()
        self._pool.submit(self._send, case, method, path)

    def drain(self) -> None:
        """Wait for every request sent so far to be answered and recorded."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _send(self, case, method: str, path: str) -> None:
        import requests

        try:
            t0 = time.monotonic()
            try:
                resp = case.call(base_url=self.url, timeout=self.request_timeout_s)
                status, text = resp.status_code, resp.text
            except requests.RequestException as e:  # a hang (timeout) or a dropped connection
                status, text = None, f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - the client could not send it: not the server's doing
                with self._lock:
                    self.notes.append(f"{method} {path}: not sent: {type(e).__name__}: {e}"[:300])
                return
            t1 = time.monotonic()
            sent_body = None if _is_not_set(case.body) else case.body
            where = case.formatted_path + (("?" + _query(case.query)) if case.query else "")
            with self._lock:
                self.finished = t1
                self.seconds[(method, path)] += t1 - t0
                self.slowest = sorted([*self.slowest, (t1 - t0, method, path, sent_body)], key=lambda r: -r[0])[:3]
                self.counts[(method, path, status_class(status))] += 1
                if status is None:
                    self.failures.append(Failure(method, where, sent_body, None, text, "timeout/connection"))
                elif status >= 500:
                    self.failures.append(Failure(method, where, sent_body, status, text, "5xx"))
                elif status >= 400:
                    self.reasons[(method, path, _refusal(text))] += 1
                elif "text/event-stream" in resp.headers.get("content-type", ""):
                    for err in stream_server_errors(text):
                        self.failures.append(Failure(method, where, sent_body, status, err, "5xx in stream"))
        finally:
            self._slots.release()

    def table(self) -> str:
        """Requests per endpoint (method and path) and status class."""
        classes = sorted({c for _, _, c in self.counts})
        rows = collections.defaultdict(collections.Counter)
        for (m, p, c), n in self.counts.items():
            rows[(m, p)][c] = n
        head = f"{'endpoint':48s}" + "".join(f"{c:>12s}" for c in classes) + f"{'total':>8s}{'sum s':>9s}"
        lines = [head]
        for (m, p), row in sorted(rows.items(), key=lambda kv: (-sum(kv[1].values()), kv[0])):
            lines.append(f"{m + ' ' + p:48s}" + "".join(f"{row[c]:12d}" for c in classes)
                         + f"{sum(row.values()):8d}{self.seconds[(m, p)]:9.1f}")
        total = collections.Counter()
        for row in rows.values():
            total.update(row)
        lines.append(f"{'all':48s}" + "".join(f"{total[c]:12d}" for c in classes) + f"{self.sent:8d}"
                     f"{sum(self.seconds.values()):9.1f}")
        dur = (self.finished or 0) - (self.started or 0)
        lines.append(f"{self.sent} requests in {dur:.0f} s ({self.concurrency} at a time); {self.skipped} generated "
                     f"after the {self.time_budget_s:.0f} s budget, not sent; {len(self.failures)} failures")
        lines += [f"not fuzzed, disabled for this model: {m} {p}: {why}" for (m, p), why in self.disabled.items()]
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"slow: {t:.1f} s {m} {p} {json.dumps(b, default=repr)[:300]}" for t, m, p, b in self.slowest]
        return "\n".join(lines)

    def top_refusals(self, per_endpoint: int = 3) -> str:
        """The most frequent 4xx messages of each endpoint."""
        by = collections.defaultdict(list)
        for (m, p, msg), n in self.reasons.most_common():
            if len(by[(m, p)]) < per_endpoint:
                by[(m, p)].append(f"    {n:5d}  {msg}")
        return "\n".join(f"{m} {p}:\n" + "\n".join(rows) for (m, p), rows in sorted(by.items()))

    def new_failures(self) -> list[Failure]:
        """The failures that are not known vLLM bugs (``KNOWN_VLLM``)."""
        return [f for f in self.failures if known_vllm(f) is None]

    def known(self) -> str:
        """The failures that are known vLLM bugs, counted by bug."""
        c = collections.Counter(known_vllm(f) for f in self.failures)
        return "\n".join(f"  {n:4d} x {what}" for what, n in c.items() if what is not None)

    def distinct(self, failures: list[Failure] | None = None) -> list[Failure]:
        """The first failure of each signature."""
        seen, out = set(), []
        for f in self.failures if failures is None else failures:
            if f.signature() not in seen:
                seen.add(f.signature())
                out.append(f)
        return out


def _refusal(text: str) -> str:
    """A 4xx answer's reason, numbers blurred (to count refusals by kind): its message, or for a request
    validation error the first field and complaint."""
    try:
        err = json.loads(text)
        msg = str(err["error"]["message"] if "error" in err else err.get("detail", text))
    except (ValueError, KeyError, TypeError, AttributeError):
        msg = text
    m = re.search(r"'loc': '([^']*)', 'msg': ('[^']*'|\"[^\"]*\")", msg)
    if m:
        msg = f"invalid {m.group(1)}: {m.group(2)[1:-1]}"
    return re.sub(r"\d+(\.\d+)?", "N", msg.splitlines()[0] if msg else msg)[:110]


def _is_not_set(value) -> bool:
    from schemathesis.core import NotSet

    return isinstance(value, NotSet)


def _query(q: dict) -> str:
    from urllib.parse import urlencode

    return urlencode(q, doseq=True)


def post(url: str, body, timeout: float = 120) -> tuple[int | None, str]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:  # no answer, or one cut off (IncompleteRead)
        return None, f"{type(e).__name__}: {e}"


def get_status(url: str, timeout: float = 30) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def minimise(url: str, failure: Failure, budget: int = 150) -> object:
    """A smaller JSON body that still gets a server error of the same kind (at most ``budget`` requests): object
    keys dropped, a list cut to one of its elements, strings emptied, recursively, each kept while the failure
    stays. The failing body itself when it is not a JSON object; None when the failure does not reproduce alone."""
    body = failure.body
    if failure.method != "POST" or not isinstance(body, dict):
        return body
    spent = 0

    def fails(b) -> bool:
        nonlocal spent
        spent += 1
        status, text = post(url + failure.path, b)
        if failure.kind == "5xx in stream":
            return status is not None and bool(stream_server_errors(text))
        if failure.kind == "5xx":
            return status is not None and status >= 500
        return status is None

    def shrink(value, rebuild):
        """``value`` made smaller while ``rebuild(smaller)`` still fails."""
        if spent >= budget:
            return value
        if isinstance(value, dict):
            for key in list(value):
                if spent >= budget:
                    break
                trial = {k: v for k, v in value.items() if k != key}
                if fails(rebuild(trial)):
                    value = trial
            for key in list(value):
                value = {**value, key: shrink(value[key], lambda v, k=key, cur=value: rebuild({**cur, k: v}))}
        elif isinstance(value, list):
            if len(value) > 1:
                for item in value[:8]:
                    if spent >= budget:
                        break
                    if fails(rebuild([item])):
                        value = [item]
                        break
            for i in range(len(value)):
                value = [*value[:i], shrink(value[i], lambda v, i=i, cur=value: rebuild([*cur[:i], v, *cur[i + 1:]])),
                         *value[i + 1:]]
        elif isinstance(value, str) and value and fails(rebuild("")):
            value = ""
        return value

    if not fails(body):
        return None
    return shrink(body, lambda b: b)


_LOG_PREFIX = re.compile(r"^\(\w+ pid=\d+\) \w+ [\d-]+ [\d:]+ \[[^\]]+\] ?", re.M)  # vLLM's logger prefix
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):\n(?:[ \t].*\n|\n)*?\S.*(?:\n|$)")


def server_tracebacks(log_path: str, limit: int = 8) -> list[str]:
    """The distinct tracebacks in a server log that are not request refusals (a chain ending in vLLM's
    ``VLLMValidationError`` is a 400), by their last frames and exception line (digits ignored): each with its
    count, last frames and exception line; at most ``limit``, the most frequent first."""
    try:
        text = _LOG_PREFIX.sub("", open(log_path, errors="replace").read())
    except OSError:
        return []
    counts, first, chain = collections.Counter(), {}, []
    for m in _TRACEBACK.finditer(text):
        chain.append(m.group(0).rstrip("\n").splitlines())
        if re.match(r"\s*The above exception was the direct cause|\s*During handling of the above exception",
                    text[m.end():m.end() + 200]):
            continue  # the next traceback is the same failure's
        block, chain = chain[-1], []
        if block[-1].startswith(("vllm.exceptions.VLLMValidationError", "vllm.exceptions.VLLMClientError")):
            continue
        frames = [ln.strip() for ln in block if ln.strip().startswith("File ")]
        key = (tuple(frames[-2:]), re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", block[-1]))[:100])
        counts[key] += 1
        first.setdefault(key, block)
    out = []
    for key, n in counts.most_common(limit):
        block = first[key]
        frames = [i for i, ln in enumerate(block) if ln.strip().startswith("File ")]
        start = frames[-3] if len(frames) >= 3 else 0
        out.append(f"[{n}x]\n" + "\n".join(block[start:]))
    return out


def disabled(url: str) -> dict[tuple[str, str], str]:
    """Endpoints the served model does not support, which vLLM answers with 501 to every request (left out of
    the fuzz: the answer is by design): (method, path) -> why."""
    out = {}
    status, text = post(url + "/v1/systemone", {"state": "x", "questions": {}})  # a valid request
    if status == 501:
        out[("POST", "/v1/systemone")] = f"501 to a valid request: {text[:200]}"
    return out
