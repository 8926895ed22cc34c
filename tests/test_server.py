"""``psd serve``: vLLM's OpenAI-compatible server with PSD on the embedded model, driven by the ``openai`` client.

One server on a free loopback port for the module: completions (token-id prompt), chat (the model's chat
template), streaming (a block's tokens arrive when it commits, several chunks for a multi-block answer; the
stream joins to the same text), a stream aborted mid-way while another request runs (that one is unaffected, the
server keeps serving), bad requests (400, not a crash: the plugin's own ``vllm_xargs`` keys on every endpoint),
then a clean shutdown on SIGTERM.
"""

import threading

import pytest

from model_executor.engine import ReferenceEngine
from psd_plugin import DEFAULT_DLLM

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    from psd_plugin.vllm.server import start

    # the defaults (JSON for a dLLM is compact: test_response_format_json_schema)
    srv = start(["--max-model-len", "512"])
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none"), srv.proc
    assert srv.stop() == 0, f"SIGTERM did not shut the server down cleanly; log: {srv.log}"


def test_server_logs_go_to_the_directory_the_suite_names(tmp_path, monkeypatch):
    """The suite's servers log into pytest's temporary directory (``conftest.py`` names it by the module's
    variable), not into ``/tmp``, where hundreds of 2 MB logs piled up."""
    import os

    from conftest import SERVER_LOG_DIR_ENV
    from psd_plugin.vllm import server as srv_mod

    assert SERVER_LOG_DIR_ENV == srv_mod.LOG_DIR_ENV and os.environ.get(srv_mod.LOG_DIR_ENV)
    monkeypatch.setenv(srv_mod.LOG_DIR_ENV, str(tmp_path))
    with srv_mod.log_file() as f:
        assert os.path.dirname(f.name) == str(tmp_path)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer

    return ReferenceEngine.from_pretrained(DEFAULT_DLLM), AutoTokenizer.from_pretrained(str(DEFAULT_DLLM))


def _ref_text(reference, ids, max_tokens=32):
    engine, tok = reference
    out = engine.generate([ids], max_tokens=max_tokens, method="psd")[0]
    return tok.decode(out.token_ids, skip_special_tokens=True)


def test_completion_chat_and_stream(server, reference):
    client, _ = server
    from psd_plugin.evaluate import encode

    _, tok = reference
    ids = encode(tok, "Reverse the list: a b c d")
    c = client.completions.create(model="llada-tiny", prompt=ids, max_tokens=32, temperature=0)
    assert c.choices[0].text == _ref_text(reference, ids)
    chat = client.chat.completions.create(model="llada-tiny", max_tokens=32, temperature=0,
                                          messages=[{"role": "user", "content": "Reverse the list: a b c d"}])
    assert chat.choices[0].message.content == c.choices[0].text  # the chat template gives the same ids
    chunks = [ch.choices[0].text for ch in client.completions.create(
        model="llada-tiny", prompt=ids, max_tokens=32, temperature=0, stream=True)]
    assert "".join(chunks) == c.choices[0].text


def test_a_multi_block_answer_streams_a_block_at_a_time(server, reference):
    """48 tokens past EOS are 6 blocks of 8: they arrive in several chunks, each whole blocks (a block is
    emitted when it commits; a slow reader may get two at once), joining to the whole answer."""
    client, _ = server
    from psd_plugin.evaluate import encode

    _, tok = reference
    ids = encode(tok, "Sort the list: 9 8 7 6 5 4 3 2 1")
    whole = client.completions.create(model="llada-tiny", prompt=ids, max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = [ch.choices[0].model_extra.get("token_ids") or [] for ch in client.completions.create(
        model="llada-tiny", prompt=ids, max_tokens=48, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})]
    chunks = [c for c in chunks if c]
    assert len(chunks) >= 2 and all(len(c) % 8 == 0 for c in chunks), [len(c) for c in chunks]
    assert [t for c in chunks for t in c] == whole.choices[0].model_extra["token_ids"]


def test_client_keys_and_bad_options_are_400_on_every_endpoint(server):
    """The plugin's own extra_args keys from a client (``vllm_xargs``) are refused on completions, chat and
    responses (a junk grammar there used to end the engine); the server keeps serving."""
    client, proc = server
    for call in (lambda x: client.completions.create(model="llada-tiny", prompt="hi", max_tokens=8, temperature=0,
                                                     extra_body={"vllm_xargs": x}),
                 lambda x: client.chat.completions.create(model="llada-tiny", max_tokens=8, temperature=0,
                                                          messages=[{"role": "user", "content": "hi"}],
                                                          extra_body={"vllm_xargs": x}),
                 lambda x: client.responses.create(model="llada-tiny", input="hi", max_output_tokens=8,
                                                   temperature=0, extra_body={"vllm_xargs": x})):
        with pytest.raises(openai.BadRequestError, match="psd_grammar"):
            call({"psd_grammar": "junk"})
        call({"my_key": 1})  # a client's own key is the client's
    # streamed Responses: vLLM adds the request after the stream has started; the refusal ends the stream with
    # the API's error event (the connection used to be cut mid-response: found by tests/test_fuzz.py)
    events = list(client.responses.create(model="llada-tiny", input="hi", max_output_tokens=8, temperature=0,
                                          stream=True, extra_body={"vllm_xargs": {"psd_grammar": "junk"}}))
    assert events[-1].type == "error" and "psd_grammar" in events[-1].message, events
    assert [e.sequence_number for e in events] == list(range(len(events)))
    ok = list(client.responses.create(model="llada-tiny", input="hi", max_output_tokens=8, temperature=0,
                                      stream=True))
    assert ok[-1].type == "response.completed", ok[-1]
    assert proc.poll() is None


def test_response_format_json_schema(server, reference):
    """The OpenAI client's ``response_format={"type": "json_schema", ...}`` (structured outputs): the answer
    follows the schema, and is the reference engine's under the same grammar; a bad schema is a 400."""
    import json

    from model_executor.grammar import build_grammar, compile_grammar, tokenizer_info
    from psd_plugin.evaluate import encode

    client, proc = server
    engine, tok = reference
    schema = {"type": "object", "additionalProperties": False, "required": ["answer", "unit"],
              "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99},
                             "unit": {"enum": ["cm", "kg"]}}}
    q = "What is 12 + 7?"
    chat = client.chat.completions.create(model="llada-tiny", max_tokens=64, temperature=0,
                                          messages=[{"role": "user", "content": q}],
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "answer", "schema": schema}})
    got = json.loads(chat.choices[0].message.content)
    assert set(got) == {"answer", "unit"} and 0 <= got["answer"] <= 99 and got["unit"] in ("cm", "kg")
    g = compile_grammar(build_grammar("json", schema, any_whitespace=False),
                        tokenizer_info(tok, engine.spec.vocab_size))
    ref = engine.generate([encode(tok, q)], max_tokens=64, method="psd", grammar=g)[0]
    assert chat.choices[0].message.content == tok.decode(ref.token_ids, skip_special_tokens=True)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="llada-tiny", max_tokens=8, messages=[{"role": "user", "content": q}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert proc.poll() is None  # still serving


def test_abort_mid_stream_leaves_others_alone(server, reference):
    client, proc = server
    from psd_plugin.evaluate import encode

    _, tok = reference
    ids = encode(tok, "Sort the list: 9 8 7 6 5 4 3 2 1")
    result = {}

    def other():
        r = client.completions.create(model="llada-tiny", prompt=ids, max_tokens=48, temperature=0)
        result["text"] = r.choices[0].text

    t = threading.Thread(target=other)
    t.start()
    stream = client.completions.create(model="llada-tiny", prompt=ids, max_tokens=48, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # abort mid-stream
    t.join(timeout=120)
    assert result["text"] == _ref_text(reference, ids, max_tokens=48)
    # the default method samples: a seeded request repeats, one without ``temperature`` (the clients' default 1.0)
    # is answered
    seeded = [client.completions.create(model="llada-tiny", prompt=ids, max_tokens=16, temperature=0.8, seed=3)
              for _ in range(2)]
    assert seeded[0].choices[0].text == seeded[1].choices[0].text and seeded[0].choices[0].text
    assert client.completions.create(model="llada-tiny", prompt=ids, max_tokens=16).choices[0].finish_reason
    again = client.completions.create(model="llada-tiny", prompt=ids, max_tokens=48, temperature=0)
    assert again.choices[0].text == result["text"]
    assert proc.poll() is None
