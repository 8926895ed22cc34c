"""A whole vLLM step reads device memory on the host only where a reviewed allow-list says, and as often.

Every device tensor of vLLM's runner (the ``.gpu`` side of its ``CpuGpuBuffer``s, its device-only buffers, the
input batch's and block tables' device twins) is made a stand-in for a device tensor (``sync_audit.on_device``,
sharing the host storage the CPU runner uses for both sides), so the model's hidden states and logits, which
are computed from them, are stand-ins too. A ``SyncAudit(device_only=True)`` (a ``TorchFunctionMode``) runs
around each ``execute_model`` and ``sample_tokens`` of the worker and records, per call site in the project's
packages, every host read of a stand-in (``item``, ``tolist``, ``__bool__``, ``__int__``, ``nonzero``,
``.cpu()``, ``.to(cpu)``, mask indexing, ...) and every blocking copy to a device. On a GPU each of those is a
stall of the host on the device.

On this CPU the runner's device is the host, so a stand-in's ``device`` is the CPU and an upload to it is no
copy: the audit could not see one. The dLLM runner's decoding of a step (``_decode``: the requests' rules, the
grammar, the predictions, the decoders' updates, logprobs) therefore runs inside a ``device_proxy.DeviceProxy``
with the step's logits on its device (``cuda:0``): there a blocking upload to the logits' device, and any
operation that mixes the device with the host (``DeviceMixing``), shows as it would on a GPU.

The allow-list is each method's budget of such reads *per step*: what a step cannot do without (the one copy
of every row's top token and confidence, the decoders' inputs) and nothing else. A new ``.item()``, a
``.tolist()`` of a device tensor or a blocking upload in the hot path fails here with its file and line.
"""

from __future__ import annotations

import collections

import pytest
import torch

vllm = pytest.importorskip("vllm")

from device_proxy import DeviceProxy, mark  # noqa: E402
from sync_audit import DeviceStandIn, SyncAudit, on_device  # noqa: E402

from psd_plugin import DEFAULT_AR, DEFAULT_DLLM  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("in_process_vllm")]

# site ("path:function op") -> reads per step at most. Reviewed: each is the single device-to-host copy its
# step needs, and is asynchronous-safe only where it is the last thing the host waits for.
# Where the host and the device are one (``device.type == "cpu"``), the attention builder checks the slots it
# derived from the host block tables against vLLM's slot mapping: a consistency check no GPU step runs.
CPU_ONLY = {"attention_backends/vllm_backend.py:build equal": 1}
DLLM_ALLOWED = {
    # every canvas row's top token and confidence, packed in one tensor: the decoders' only input
    "model_executor/decoding/base.py:predict_rows cpu": 1,
    **CPU_ONLY,
}
# every method decides where the logits are: its one copy is the decisions (next states and each block's count of
# non-finite predictions; Spiffy's top tokens at the positions its next drafts read too), from the method's update;
# a sampled request's draws need none (they are drawn where the logits are)
DEVICE_DECIDED = {m: {"model_executor/decoding/base.py:read_back cpu": 1, **CPU_ONLY}
                  for m in ("static", "confidence", "localleap", "psd", "lopa", "freedave", "spiffy")}
PRESTO_ALLOWED = {
    **CPU_ONLY,
    # the tree rows' argmax of every request, one batched copy (acceptance walks it on the host)
    "psd_plugin/vllm/presto_runner.py:_sample cpu": 1,
}


def _mark_device_tensors(runner) -> None:
    """Make the runner's device tensors stand-ins (module docstring); the CPU runner shares their storage with
    the host copies, which stay plain host tensors."""
    from vllm.v1.utils import CpuGpuBuffer

    def buffers(obj):
        for v in vars(obj).values():
            if isinstance(v, CpuGpuBuffer):
                v.gpu = on_device(v.gpu)

    buffers(runner)
    for t in runner.input_batch.block_table.block_tables:
        buffers(t)
    for name in ("positions", "seq_lens", "num_computed_tokens", "is_padding"):
        if isinstance(getattr(runner, name, None), torch.Tensor):
            setattr(runner, name, on_device(getattr(runner, name)))
    batch = runner.input_batch
    for k in list(vars(batch)):
        if k.endswith("_cpu_tensor") and isinstance(getattr(batch, k[:-11], None), torch.Tensor):
            setattr(batch, k[:-11], on_device(getattr(batch, k[:-11])))


class _StepAudit:
    """The audits of every step the worker runs."""

    def __init__(self):
        self.steps = 0
        self.calls: collections.Counter = collections.Counter()  # (site, step) -> count
        self.reports: list[str] = []
        self.logits_on_device: list[bool] = []
        self.failed: dict[str, str] = {}  # requests the runner failed (a DeviceMixing under the proxy fails one)

    def run(self, fn, *args, new_step: bool):
        audit = SyncAudit(device_only=True)
        with audit:
            out = fn(*args)
        if new_step:
            self.steps += 1
        self.add(audit)
        return out

    def add(self, audit: SyncAudit) -> None:
        """``audit``'s calls, counted in the current step."""
        for (path, func, _, op), n in audit.calls.items():
            self.calls[(f"{path}:{func} {op}", self.steps)] += n
        if audit.calls:
            self.reports.append(audit.report())

    def per_step_max(self) -> dict[str, int]:
        most: dict[str, int] = {}
        for (site, _), n in self.calls.items():
            most[site] = max(most.get(site, 0), n)
        return most


@pytest.fixture
def step_audit(monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    from model_executor.models.vllm_models import DLLMForVLLM
    from psd_plugin.vllm.dllm_runner import DLLMRunnerMixin
    from psd_plugin.vllm.runner import PSDRunnerMixin

    audit = _StepAudit()
    init_kv = PSDRunnerMixin.initialize_kv_cache

    def initialize_kv_cache(self, *args, **kwargs):
        init_kv(self, *args, **kwargs)
        _mark_device_tensors(self)  # after vLLM (re)builds its input batch for the KV-cache groups

    execute, sample = Worker.execute_model, Worker.sample_tokens
    logits = DLLMForVLLM.compute_logits

    def compute_logits(self, hidden_states):  # vLLM's CPU GEMM returns a plain tensor: the logits are the device's
        out = logits(self, hidden_states)
        return on_device(out) if isinstance(hidden_states, DeviceStandIn) and out is not None else out

    decode = DLLMRunnerMixin._decode

    def on_a_device(self, logits, *args):  # the step's decoding with its logits on a device that is not the host
        with DeviceProxy(device_generators=True), SyncAudit(device_only=True) as inner:
            out = decode(self, mark(logits.as_subclass(torch.Tensor)), *args)
        audit.add(inner)  # the proxy hands the calls on as host tensors: the step's own audit sees none of them
        audit.failed.update(self.failed)
        return out

    monkeypatch.setattr(DLLMRunnerMixin, "_decode", on_a_device)
    monkeypatch.setattr(DLLMForVLLM, "compute_logits", compute_logits)
    monkeypatch.setattr(PSDRunnerMixin, "initialize_kv_cache", initialize_kv_cache)
    monkeypatch.setattr(Worker, "execute_model", lambda self, *a: audit.run(execute, self, *a, new_step=True))
    monkeypatch.setattr(Worker, "sample_tokens", lambda self, *a: audit.run(sample, self, *a, new_step=False))
    return audit


def _check(audit: _StepAudit, allowed: dict[str, int]) -> None:
    most = audit.per_step_max()
    assert audit.steps > 3
    assert not audit.failed, audit.failed  # the runner contains a request's exception: a failed one is a failure
    extra = {s: n for s, n in most.items() if n > allowed.get(s, 0)}
    assert not extra, "host reads of device tensors beyond the allow-list (site: most per step):\n" + \
        "\n".join(f"  {s}: {n}" for s, n in sorted(extra.items())) + "\n\n" + "\n".join(audit.reports[:3])
    # the allow-list is not stale: every allowed read happens (the stand-ins reached the decoders)
    assert set(allowed) <= set(most), (sorted(allowed), sorted(most))


# penalties (repetition, presence, frequency; the spatial policies only): each request's answer so far goes up to
# the logits' device as ids without waiting and is counted there with ``index_add_`` (a ``bincount`` would sync:
# its output size is the data's maximum); the prompt's tokens and the rules' constants go up once per request.
# Before (issue 49's finding) each penalized request cost two blocking uploads and a ``bincount`` every step.
PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)


@pytest.mark.parametrize("method,cache,temperature,options,allowed", [
    ("confidence", "prefix", 0.0, {}, {}), ("psd", "dual", 0.0, {}, {}), ("spiffy", "prefix", 0.0, {}, {}),
    ("freedave", "prefix", 0.0, {}, {}), ("lopa", "dual", 0.0, {}, {}), ("psd", "dual", 0.8, {}, {}),
    ("confidence", "prefix", 0.0, PENALTIES, {})], ids=lambda v: "penalties" if v is PENALTIES else None)
def test_dllm_step_reads_the_device_once(step_audit, mixed_prompts, method, cache, temperature, options, allowed):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(DEFAULT_DLLM), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=4,
              speculative_config={"method": "psd", "decoding": method, "cache": cache})
    try:
        prompts = [{"prompt_token_ids": p} for p in mixed_prompts[:6]]
        outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=temperature, seed=1, **options),
                            use_tqdm=False)
    finally:
        del llm
    assert all(o.outputs[0].token_ids for o in outs)
    _check(step_audit, {**DEVICE_DECIDED.get(method, DLLM_ALLOWED), **allowed})


@pytest.fixture(scope="module")
def presto_prompts():
    from transformers import AutoTokenizer

    from psd_plugin.evaluate import encode
    from psd_plugin.train.tasks import TASKS, load_heldout

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    return [encode(tok, load_heldout(t)[0]["prompt"]) for t in TASKS][:6]


@pytest.mark.parametrize("temperature,allowed", [
    (0.0, {}),
    # sampled: the walks' draws of every request in one copy, then their bonus tokens in one more; the draws
    # are made where the requests' generators are, and vLLM's CPU runner makes them on the host, so here the
    # step's probabilities move there, in one copy (on a GPU vLLM's generators are the device's: no copy)
    (0.8, {"model_executor/presto_round.py:accept_all cpu": 2, "model_executor/presto_round.py:accept_all to(cpu)": 1})])
def test_presto_step_reads_the_device_once(step_audit, presto_prompts, temperature, allowed):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(DEFAULT_AR), dtype="float32", enforce_eager=True, seed=0, max_model_len=256,
              max_num_seqs=4, speculative_config={"method": "psd", "mode": "presto", "tree_budget": 16})
    try:
        prompts = [{"prompt_token_ids": p} for p in presto_prompts]
        outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=temperature, seed=1), use_tqdm=False)
    finally:
        del llm
    assert all(o.outputs[0].token_ids for o in outs)
    _check(step_audit, {**PRESTO_ALLOWED, **allowed})


def test_dllm_step_under_a_grammar_reads_the_device_once(step_audit, mixed_prompts):
    """Structured outputs add host work (the matcher, the bitmasks) and uploads, never a device read: the
    frontier rows' bitmasks go up in one copy, the rule runs on the host predictions."""
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "required": ["a"], "properties": {"a": {"enum": ["x", "yy", "zzz"]}}}
    llm = LLM(model=str(DEFAULT_DLLM), dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=4,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
              speculative_config={"method": "psd", "decoding": "psd", "cache": "prefix"})
    try:
        prompts = [{"prompt_token_ids": p} for p in mixed_prompts[:6]]
        outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0, structured_outputs=
                                                    StructuredOutputsParams(json=schema)), use_tqdm=False)
    finally:
        del llm
    assert all(o.outputs[0].text.startswith('{"a":') for o in outs)
    _check(step_audit, DLLM_ALLOWED)
