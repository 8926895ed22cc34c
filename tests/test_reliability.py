"""Reliability of the served paths (slow: one real server per module, on loopback).

- Load: 64 concurrent streaming clients on the dLLM (PSD) server and on the AR + PRESTO server; no request is
  lost and every greedy output equals the same prompt decoded alone by the reference engine.
- Faults: clients that disconnect mid-stream (during draft verification) next to clients that finish; the
  finishing ones are unaffected and the server keeps serving.
- Bad input: over a hundred generated malformed requests, each answered with a 4xx, the server alive and
  correct afterwards.
"""

import asyncio
import itertools
import json

import pytest

from psd_plugin import DEFAULT_AR, DEFAULT_DLLM

pytest.importorskip("vllm")
aiohttp = pytest.importorskip("aiohttp")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    from psd_plugin.evaluate import encode
    from psd_plugin.train.tasks import TASKS, load_heldout

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_DLLM))
    return [encode(tok, r["prompt"]) for t in TASKS for r in load_heldout(t)[:10]][:64]


@pytest.fixture(scope="module")
def dllm_server():
    from psd_plugin.vllm.server import start

    srv = start(["--max-model-len", "512", "--max-num-seqs", "64", "--dtype", "float32"])
    yield srv
    assert srv.stop() == 0, f"SIGTERM did not shut the server down cleanly; log: {srv.log}"


async def _stream(session, url, model, prompt, max_tokens=32, stop_after=None):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    ids = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
            if stop_after is not None and len(ids) >= stop_after:
                return ids  # leaving the context manager drops the connection mid-stream
    return ids


async def _all(url, model, prompts, **kw):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        return await asyncio.gather(*(_stream(s, url, model, p, **kw) for p in prompts))


def test_64_concurrent_streams_equal_single_runs(dllm_server, prompts):
    from model_executor.engine import ReferenceEngine

    engine = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    alone = [engine.generate([p], max_tokens=32, method="psd")[0].token_ids for p in prompts]
    got = asyncio.run(_all(dllm_server.url, "llada-tiny", prompts))
    assert len(got) == 64
    for i, (g, a) in enumerate(zip(got, alone)):
        assert g == a, f"request {i}: served {g} != alone {a}"


def test_disconnects_mid_stream_leave_the_rest_alone(dllm_server, prompts):
    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
            url = dllm_server.url
            quitters = [_stream(s, url, "llada-tiny", p, max_tokens=64, stop_after=1) for p in prompts[:16]]
            stayers = [_stream(s, url, "llada-tiny", p) for p in prompts[16:32]]
            res = await asyncio.gather(*quitters, *stayers)
            return res[16:], await _stream(s, url, "llada-tiny", prompts[0])
    stayed, after = asyncio.run(run())
    alone = asyncio.run(_all(dllm_server.url, "llada-tiny", prompts[16:32] + prompts[:1]))
    assert stayed == alone[:16] and after == alone[16]


def _malformed(prompt):
    """(description, raw body bytes) of requests a server must refuse with a 4xx."""
    good = {"model": "llada-tiny", "prompt": prompt, "max_tokens": 8}
    cases = [("not JSON", b"{not json"), ("truncated JSON", json.dumps(good).encode()[:-3]),
             ("empty body", b""), ("JSON list", b"[1, 2, 3]"), ("non-UTF-8 bytes", b"\xff\xfe\xfa{\"prompt\": 1}")]
    bad_values = {
        "max_tokens": [-1, -100, 0, "eight", 1.5, [8], {"n": 8}, 10**9, 600],
        "temperature": [-1.0, "hot", [0.5], {"t": 1}],
        "prompt": [[], "", [-1], [10**6], [1.5, 2.5], {"text": "x"}, [[1, 2], "a"], [3] * 600],
        "n": [0, -2, "two"],
        "top_p": [0.0, -0.5, 2.0, "p"],
        "top_k": [-5, "k", 1.5],
        "logprobs": [3, 5],
        "presence_penalty": [5.0, -3.0],  # outside vLLM's [-2, 2]
        "frequency_penalty": [5.0],
        "repetition_penalty": [0.0, -1.3],
        "min_tokens": [-1, 9],  # more than max_tokens
        "stop": [5, [1, 2]],
        "seed": ["s", 1.5],
        "model": ["no-such-model", 7],
        "stream": ["maybe", 7],
        "logit_bias": [{"999999": 1.0}, {"5": "big"}],  # outside the vocabulary; not a number
        "bad_words": [["alpha beta gamma delta"], [""]],  # several tokens (a dLLM bans one-token words)
    }
    for field, values in bad_values.items():
        for v in values:
            cases.append((f"{field}={v!r}"[:60], json.dumps({**good, field: v}).encode()))
    for a, b in itertools.combinations(["max_tokens", "temperature", "top_p", "n"], 2):  # two bad fields at once
        cases.append((f"{a}+{b}", json.dumps({**good, a: -7, b: -7}).encode()))
    missing = dict(good)
    missing.pop("prompt")
    cases.append(("no prompt", json.dumps(missing).encode()))
    return cases


def test_malformed_requests_get_4xx_and_the_server_lives(dllm_server, prompts):
    import urllib.error
    import urllib.request

    cases = _malformed(prompts[0])
    cases += [(f"{d} (chat)", body.replace(b'"prompt"', b'"messages"')) for d, body in cases[5:60]]
    assert len(cases) >= 100
    bad = []
    for desc, body in cases:
        req = urllib.request.Request(dllm_server.url + "/v1/completions" if "(chat)" not in desc else
                                     dllm_server.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                bad.append((desc, r.status))
        except urllib.error.HTTPError as e:
            if not 400 <= e.code < 500:
                bad.append((desc, e.code))
    assert not bad, f"not refused with a 4xx: {bad}"
    assert dllm_server.proc.poll() is None
    again = asyncio.run(_all(dllm_server.url, "llada-tiny", prompts[:2]))
    assert again == asyncio.run(_all(dllm_server.url, "llada-tiny", prompts[:2]))


def test_presto_server_under_load(prompts):
    """64 concurrent streams on the AR + PRESTO server equal plain AR greedy decoding."""
    from model_executor.ar_engine import AREngine
    from psd_plugin.vllm.server import start

    alone = [r.token_ids for r in AREngine.from_pretrained(DEFAULT_AR).generate(prompts, max_tokens=32)]
    srv = start([str(DEFAULT_AR), "--served-model-name", "ar-tiny", "--max-model-len", "512",
                 "--max-num-seqs", "64", "--dtype", "float32"])
    try:
        got = asyncio.run(_all(srv.url, "ar-tiny", prompts))
    finally:
        code = srv.stop()
    assert got == alone
    assert code == 0, f"SIGTERM did not shut the PRESTO server down cleanly; log: {srv.log}"
