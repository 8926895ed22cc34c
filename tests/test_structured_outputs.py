"""Structured outputs on the dLLM path: the grammar frontier rule (:mod:`model_executor.grammar`).

- Every method (``joint_threshold`` excepted: it edits committed tokens) on the embedded model and on random
  checkpoints of every family: every output parses and validates against a JSON schema, over held-out
  prompts and random prompts the models answer badly; regex and choice hold.
- The lossless methods stay lossless under the rule: FreeDave and Spiffy equal their base policy under the
  same grammar, token for token, in float64 and float32, in batches mixing requests with and without a grammar
  (and the free ones equal their runs without any grammar in the batch).
- A grammar request with temperature > 0 samples valid outputs (both engines); 2 tensor-parallel ranks equal the
  reference engine under the grammar (``test_parallel.py``).
- The rule's invariant is checked at every commit: a decoder committing out of order fails loudly.
- vLLM equals the reference engine under each kind of constraint and method; the OpenAI client's
  ``response_format={"type": "json_schema"}`` works on ``psd serve`` (in ``test_server.py``).
"""

import json
import os
import re

import pytest
import torch

from model_executor.engine import ReferenceEngine
from model_executor.grammar import build_grammar, compile_grammar, tokenizer_info
from psd_plugin import DEFAULT_DLLM, default_graph

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "unit", "ok", "note"],
          "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999},
                         "unit": {"enum": ["cm", "kg", "s"]}, "ok": {"type": "boolean"},
                         "note": {"type": "string", "maxLength": 6}}}
REGEX = r"[0-9]{2}-[a-z]{3}( ok)?"
CHOICE = ["yes", "no", "maybe not"]
METHODS = ("static", "confidence", "localleap", "lopa", "freedave", "spiffy", "psd")
MAX_TOKENS = 96  # the longest answer the schema allows is under 70 tokens


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEFAULT_DLLM))


def _compiled(tok, vocab, kind, value):
    return compile_grammar(build_grammar(kind, value, any_whitespace=False), tokenizer_info(tok, vocab))


def _knobs(method, path=DEFAULT_DLLM, policy="static"):
    if method != "spiffy":
        return {}
    from model_executor.decoding import load_graph

    return {"policy": policy, "graph": load_graph(default_graph(path, policy))}


def _check_json(tok, results):
    for r in results:
        text = tok.decode(r.token_ids, skip_special_tokens=True)
        assert r.finish_reason == "stop", f"did not close within max_tokens: {text!r}"
        # strict: no raw control character in a string (the grammars exclude them: test_json_strings_exclude_...)
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def engine():
    return ReferenceEngine.from_pretrained(DEFAULT_DLLM)


@pytest.mark.parametrize("method", [  # PSD in the default suite, every method in -m slow
    m if m == "psd" else pytest.param(m, marks=pytest.mark.slow) for m in METHODS])
def test_every_output_follows_the_schema(engine, tok, mixed_prompts, method):
    g = _compiled(tok, engine.spec.vocab_size, "json", SCHEMA)
    res = engine.generate(mixed_prompts, max_tokens=MAX_TOKENS, method=method, grammar=g, **_knobs(method))
    _check_json(tok, res)


@pytest.mark.slow
@pytest.mark.parametrize("method", ("confidence", "psd", "freedave"))
def test_regex_and_choice_hold(engine, tok, mixed_prompts, method):
    V = engine.spec.vocab_size
    res = engine.generate(mixed_prompts, max_tokens=32, method=method, grammar=_compiled(tok, V, "regex", REGEX))
    for r in res:
        assert re.fullmatch(REGEX, tok.decode(r.token_ids, skip_special_tokens=True)), r.token_ids
    res = engine.generate(mixed_prompts, max_tokens=32, method=method, grammar=_compiled(tok, V, "choice", CHOICE))
    assert all(tok.decode(r.token_ids, skip_special_tokens=True) in CHOICE for r in res)


@pytest.mark.slow
@pytest.mark.parametrize("family", ("llada", "dream", "sdar", "llada2"))
@pytest.mark.parametrize("method", ("static", "confidence", "localleap", "psd", "lopa", "freedave"))
def test_random_models_follow_the_schema(tiny_checkpoints, tok, family, method):
    """Random weights answer everything badly: the grammar alone makes the outputs valid."""
    eng = ReferenceEngine.from_pretrained(tiny_checkpoints[family])
    g = torch.Generator().manual_seed(3)
    prompts = [[1, 3] + torch.randint(5, 500, (n,), generator=g).tolist() + [4] for n in (3, 9, 17, 30)]
    block = eng.spec.attention_block or 8
    res = eng.generate(prompts, max_tokens=MAX_TOKENS, block_size=block, method=method,
                       grammar=_compiled(tok, eng.spec.vocab_size, "json", SCHEMA))
    _check_json(tok, res)


@pytest.mark.slow
# CI: float32 (what vLLM serves here); float64 too with PSD_FULL_MATRIX=1 (40 s of CI's time)
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32) if os.environ.get("PSD_FULL_MATRIX") else
                         (torch.float32,))
@pytest.mark.parametrize("lossless,base", (("freedave", "static"), ("spiffy", "static"),
                                           ("spiffy", "confidence")))
def test_lossless_methods_equal_their_base_policy_under_the_grammar(tok, mixed_prompts, dtype, lossless, base):
    """FreeDave and Spiffy reproduce their base policy under the same grammar, token for token, in a batch where
    every other request is free (no grammar): those equal the free base policy too."""
    eng = ReferenceEngine.from_pretrained(DEFAULT_DLLM, dtype=dtype)
    g = _compiled(tok, eng.spec.vocab_size, "json", SCHEMA)
    grammars = [g if i % 2 == 0 else None for i in range(len(mixed_prompts))]
    kw = dict(max_tokens=MAX_TOKENS, grammar=grammars)
    want = eng.generate(mixed_prompts, method=base, **kw)
    got = eng.generate(mixed_prompts, method=lossless, **kw, **_knobs(lossless, policy=base))
    free = eng.generate(mixed_prompts, method=base, max_tokens=MAX_TOKENS)
    for i, (w, o, f) in enumerate(zip(want, got, free)):
        assert o.token_ids == w.token_ids, f"{lossless} prompt {i}"
        if grammars[i] is None:
            assert w.token_ids == f.token_ids, f"free prompt {i} changed by its batch's grammars"
    _check_json(tok, [w for w, gr in zip(want, grammars) if gr is not None])
    fast = sum(o.nfe for o, gr in zip(got, grammars) if gr) < sum(w.nfe for w, gr in zip(want, grammars) if gr)
    assert fast, f"{lossless} took no fewer forwards than {base} under the grammar"


@pytest.mark.slow
def test_sampling_under_a_grammar(engine, tok, mixed_prompts):
    g = _compiled(tok, engine.spec.vocab_size, "json", SCHEMA)
    for seed in range(3):
        res = engine.generate(mixed_prompts[:8], max_tokens=MAX_TOKENS, method="confidence", grammar=g,
                              temperature=1.0, seed=seed)
        _check_json(tok, res)


def test_a_commit_out_of_order_fails_loudly(engine, tok, mixed_prompts, monkeypatch):
    """The frontier rule is enforced where it is stated (the predictions), and checked where tokens are committed:
    with the running minimum of the confidences removed, a threshold commits past the frontier and the commit
    check raises instead of emitting invalid text."""
    from model_executor.grammar import GrammarFrontier

    original = GrammarFrontier.constrain

    def no_cap(self, canvas, tokens, conf):
        tokens, out = original(self, canvas, tokens, conf)
        return tokens, torch.where(torch.isfinite(out) | (canvas != self.mask_id), out, conf)  # rejected ones back

    monkeypatch.setattr(GrammarFrontier, "constrain", no_cap)
    g = _compiled(tok, engine.spec.vocab_size, "json", SCHEMA)
    with pytest.raises(RuntimeError, match="grammar frontier"):
        engine.generate(mixed_prompts, max_tokens=MAX_TOKENS, method="confidence", grammar=g, threshold=0.5)


def test_an_unmasked_frontier_fails_loudly(engine, tok, mixed_prompts, monkeypatch):
    """Without the frontier's mask its prediction can be one the grammar rejects: that is an error, never a
    request that stops making progress."""
    import sys

    from model_executor.dllm_request import step_predictions

    # both engines mask the frontiers through dllm_request.step_predictions; the module is taken from
    # sys.modules (vLLM's loader may have aliased the name `model_executor` by now)
    monkeypatch.setattr(sys.modules[step_predictions.__module__], "mask_frontiers", lambda *a: None)
    g = _compiled(tok, engine.spec.vocab_size, "json", SCHEMA)
    with pytest.raises(RuntimeError, match="not allowed by the grammar"):
        engine.generate(mixed_prompts, max_tokens=MAX_TOKENS, method="confidence", grammar=g)


def test_refusals(engine, tok):
    """joint_threshold, logits rules that ban tokens, and bad constraints: clear errors."""
    with pytest.raises(ValueError, match="edits committed tokens"):
        engine.generate([[1, 3, 4]], max_tokens=8, method="joint_threshold",
                        grammar=_compiled(tok, engine.spec.vocab_size, "regex", "[a-z]+"))
    from model_executor.decoding import LogitsRules

    with pytest.raises(ValueError, match="allowed_token_ids with a grammar"):
        engine.generate([[1, 3, 4]], max_tokens=8, rules=LogitsRules(allowed_token_ids=(5, 6)),
                        grammar=_compiled(tok, engine.spec.vocab_size, "regex", "[a-z]+"))
    with pytest.raises(ValueError, match="structured output json"):
        build_grammar("json", "{not json")
    with pytest.raises(ValueError, match="allowed: json, json_object, regex, choice, grammar"):
        build_grammar("yaml", "a: 1")
    with pytest.raises(ValueError, match="non-empty list of strings"):
        build_grammar("choice", [])


# ----------------------------------------------------------------------------------------- through vLLM
def _vllm_llm(method, **spec):
    from vllm import LLM

    knobs = {"policy": "static", "graph": str(default_graph(DEFAULT_DLLM, "static"))} if method == "spiffy" else {}
    return LLM(model=str(DEFAULT_DLLM), dtype="float32", enforce_eager=True, seed=0, max_model_len=512,
               structured_outputs_config={"backend": "xgrammar"},  # JSON compact: json_whitespace's default
               speculative_config={"method": "psd", "decoding": method, **knobs, **spec})


@pytest.mark.parametrize("free", (False, True))
def test_json_strings_exclude_control_characters(tok, free):
    """RFC 8259 forbids raw U+0000-U+001F in a string: every string of a schema's grammar, length-bounded ones too
    (xgrammar 0.2.8 lets them through there; a sampled small model draws them), refuses a raw control byte and
    takes the rest; the bound holds."""
    import xgrammar as xgr

    schema = {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "string", "maxLength": 4}, "b": {"type": "array", "items": {"type": "string", "minLength": 1}},
        "c": {"type": "string"}}}
    grammar = compile_grammar(build_grammar("json", schema, any_whitespace=free), tokenizer_info(tok, len(tok)))

    def takes(text):
        m = xgr.GrammarMatcher(grammar)
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False))

    comma, colon = (", ", ": ") if free else (",", ":")
    ok = '{"a"%s"x y"%s"b"%s["z"]%s"c"%s"w"}' % (colon, comma, colon, comma, colon)
    assert takes(ok) and json.loads(ok)
    for bad in ('{"a"%s"x\x14' % colon, '{"a"%s"abcde' % colon, '{"a"%s"x"%s"b"%s["\x1c' % (colon, comma, colon),
                '{"a"%s"x"%s"b"%s["z"]%s"c"%s"\x01' % (colon, comma, colon, comma, colon)):
        assert not takes(bad.encode().decode("unicode_escape")), bad


@pytest.mark.parametrize("json_whitespace, disable, free", [("compact", False, False), ("any", False, True),
                                                           ("any", True, False)])
def test_dllm_json_is_compact_unless_asked(json_whitespace, disable, free):
    """The grammar a dLLM request carries: compact JSON by default (the frontier rule would let free whitespace win
    at every position), vLLM's free-whitespace grammar with ``json_whitespace: any``, compact again when the server
    sets vLLM's ``disable_any_whitespace``."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from psd_plugin.vllm.validation import GRAMMAR_ARG, take_structured_outputs

    vc = SimpleNamespace(structured_outputs_config=SimpleNamespace(disable_any_whitespace=disable))
    cfg = SimpleNamespace(method="psd")
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    take_structured_outputs(vc, cfg, params, 1 << 16, json_whitespace)
    assert params.structured_outputs is None
    assert params.extra_args[GRAMMAR_ARG] == build_grammar("json", SCHEMA, any_whitespace=free).serialize_json()


@pytest.mark.engine
# CI: static and localleap commit through the confidence policy's code (PolicyDecoder); PSD_FULL_MATRIX=1 runs them
# and under async scheduling (a request's next step scheduled before its grammar saw the last one's commits)
@pytest.mark.parametrize("method, overlap", [(m, False) for m in (METHODS if os.environ.get("PSD_FULL_MATRIX") else
                                                                  ("confidence", "lopa", "freedave", "spiffy", "psd"))]
                         + [("confidence", True), ("psd", True)])
def test_vllm_equals_the_reference_engine_under_each_constraint(in_process_vllm, tok, mixed_prompts, method, overlap):
    """One batch mixing JSON-schema, regex, choice and free requests: each request's tokens and forwards are the
    reference engine's, and each constraint holds."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams as SO

    from psd_plugin.vllm import compat

    prompts = mixed_prompts[:12]
    cons = [("json", SCHEMA), ("regex", REGEX), ("choice", CHOICE), (None, None)] * 3
    eng = ReferenceEngine.from_pretrained(DEFAULT_DLLM)
    V = eng.spec.vocab_size
    grammars = [None if k is None else _compiled(tok, V, k, v) for k, v in cons]
    ref = eng.generate(prompts, max_tokens=MAX_TOKENS, method=method, grammar=grammars, **_knobs(method))
    llm = _vllm_llm(method, **({"async_scheduling": True} if overlap else {}))
    try:
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                 structured_outputs=None if k is None else SO(**{k: v})) for k, v in cons]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = compat.request_stats(llm)
    finally:
        compat.shutdown(llm)
    for i, (o, r, (k, v)) in enumerate(zip(outs, ref, cons)):
        got = list(o.outputs[0].token_ids)
        assert got == r.token_ids, f"{method} prompt {i} ({k}): vLLM {got} != reference {r.token_ids}"
        assert stats[o.request_id]["nfe"] == r.nfe, f"{method} prompt {i} ({k}): forwards differ"
        text = o.outputs[0].text
        if k == "json":
            assert o.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
        elif k == "regex":
            assert re.fullmatch(REGEX, text), text
        elif k == "choice":
            assert text in CHOICE, text


@pytest.mark.engine
def test_vllm_refuses_what_the_rule_cannot_serve(in_process_vllm, mixed_prompts):
    """A 400 naming the field, and the engine keeps serving: joint_threshold edits committed tokens, structural
    tags are not supported, a grammar xgrammar cannot build is refused by vLLM's own check; then sampled
    requests under a schema are valid."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams as SO

    from psd_plugin.vllm import compat

    p = [{"prompt_token_ids": mixed_prompts[0]}]
    llm = _vllm_llm("joint_threshold")
    try:
        with pytest.raises(VLLMValidationError, match="structured_outputs: decoding 'joint_threshold' edits"):
            llm.generate(p, SamplingParams(max_tokens=8, temperature=0, structured_outputs=SO(regex="[a-z]+")),
                         use_tqdm=False)
        assert llm.generate(p, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    finally:
        compat.shutdown(llm)
    llm = _vllm_llm("confidence")
    try:
        tag = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}})
        with pytest.raises(VLLMValidationError, match="structural_tag is not supported"):
            llm.generate(p, SamplingParams(max_tokens=8, structured_outputs=SO(structural_tag=tag)), use_tqdm=False)
        with pytest.raises(VLLMValidationError):
            llm.generate(p, SamplingParams(max_tokens=8, structured_outputs=SO(grammar="root ::= (")), use_tqdm=False)
        with pytest.raises(VLLMValidationError, match="min_tokens with structured outputs"):
            llm.generate(p, SamplingParams(max_tokens=8, min_tokens=2, structured_outputs=SO(choice=CHOICE)),
                         use_tqdm=False)
        out = llm.generate(p, SamplingParams(max_tokens=32, temperature=0, structured_outputs=SO(choice=CHOICE)),
                           use_tqdm=False)
        assert out[0].outputs[0].text in CHOICE
        many = [{"prompt_token_ids": q} for q in mixed_prompts[:8]]  # sampled under the grammar: still valid
        for o in llm.generate(many, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
                                                   structured_outputs=SO(json=SCHEMA)), use_tqdm=False):
            assert o.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    finally:
        compat.shutdown(llm)
