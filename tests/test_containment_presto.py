"""PRESTO's part of issue 49 (one request never takes the engine down; see tests/test_containment.py): a
drafting failure costs no request (they step without a tree, so every output is the target's own greedy
decoding); a tree walk that raises for one request fails that request alone; the plugin's reserved
``extra_args`` keys are refused on the PRESTO path too."""

import pytest

from psd_plugin import DEFAULT_AR, DEFAULT_DRAFTER

vllm = pytest.importorskip("vllm")
from vllm.exceptions import VLLMValidationError  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("in_process_vllm")]

POISON = 2


def _run(llm, prompts, **kw):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(**{"max_tokens": 32, "temperature": 0, **kw}), use_tqdm=False)
    return [(o.outputs[0].finish_reason, list(o.outputs[0].token_ids)) for o in outs]


@pytest.fixture(scope="module")
def ar_prompts():
    from psd_plugin.evaluate import encode, load
    from psd_plugin.train.tasks import load_heldout

    _, tok = load(DEFAULT_AR)
    return [encode(tok, r["prompt"]) for r in load_heldout()[::311][:6]]


def test_presto_failures_are_contained(monkeypatch, ar_prompts):
    from model_executor.presto_round import TreeDrafter
    from model_executor.ar_engine import AREngine
    from psd_plugin.vllm import compat, presto_runner

    greedy = [r.token_ids for r in AREngine.from_pretrained(DEFAULT_AR).generate(ar_prompts, max_tokens=32)]
    from vllm import LLM

    llm = LLM(model=str(DEFAULT_AR), dtype="float32", enforce_eager=True, seed=0, max_model_len=512, max_num_seqs=8,
              speculative_config={"method": "psd", "mode": "presto", "model": str(DEFAULT_DRAFTER), "search": "beam",
                                  "tree_budget": 32})
    try:
        with pytest.raises(VLLMValidationError, match="psd_grammar"):
            _run(llm, ar_prompts[:1], extra_args={"psd_grammar": "junk"})
        with pytest.raises(VLLMValidationError, match="logprob_token_ids"):
            _run(llm, ar_prompts[:1], logprob_token_ids=[5])
        # drafting raises every step: no request is lost, every one is the target's greedy decoding
        with monkeypatch.context() as m:
            m.setattr(TreeDrafter, "draft", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
            got = _run(llm, ar_prompts)
        assert [g for _, g in got] == greedy and {r for r, _ in got} <= {"stop", "length"}
        stats = llm.collective_rpc("presto_stats")[0]
        assert stats["drafting_failures"] > 0 and stats["failed"] == 0
        # a tree walk that raises for one request: that one fails, the others are the target's tokens
        poison, poisoned = list(ar_prompts[POISON]), set()
        original_accept, original_prepare = presto_runner.accept_all, presto_runner.PrestoRunnerMixin._prepare_inputs

        def prepare(self, *args, **kwargs):  # the poisoned request's tree this step
            out = original_prepare(self, *args, **kwargs)
            poisoned.clear()
            poisoned.update(id(t) for rid, t in self._verifying.items() if compat.request_tokens(self, rid)[0] == poison)
            return out

        def accept(trees, *args, **kwargs):
            if any(id(t) in poisoned for t in trees):
                raise RuntimeError("injected failure in the tree walk")
            return original_accept(trees, *args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(presto_runner, "accept_all", accept)
            m.setattr(presto_runner.PrestoRunnerMixin, "_prepare_inputs", prepare)
            got = _run(llm, ar_prompts)
        assert got[POISON][0] == "error"
        assert [g for i, (_, g) in enumerate(got) if i != POISON] == [g for i, g in enumerate(greedy) if i != POISON]
        assert _run(llm, [ar_prompts[POISON]])[0][1] == greedy[POISON]
        # ... also in the step that finishes its prompt, asking for prompt logprobs: vLLM computed them in that
        # step, and its scheduler asserts that a request emitting nothing has none (the engine ended there)
        original_walk = presto_runner.PrestoRunnerMixin._accept

        def walk(self, live, trees, logits, argmax, req_ids):
            out = original_walk(self, live, trees, logits, argmax, req_ids)
            for k, i in enumerate(live):
                if compat.request_tokens(self, req_ids[i])[0] == poison:
                    self._fail(req_ids[i], "verifying its tree", RuntimeError("injected failure in the tree walk"))
                    out[k] = None
            return out

        with monkeypatch.context() as m:
            m.setattr(presto_runner.PrestoRunnerMixin, "_accept", walk)
            got = _run(llm, ar_prompts, prompt_logprobs=1)
        assert got[POISON][0] == "error"
        assert [g for i, (_, g) in enumerate(got) if i != POISON] == [g for i, g in enumerate(greedy) if i != POISON]
    finally:
        compat.shutdown(llm)
