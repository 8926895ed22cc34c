import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("MP", "0")

PROMPTS = [[1, 3, 17, 45, 99, 120, 7, 8, 9, 300, 301, 2, 2, 5, 60, 61, 62], [1, 3, 50, 60],
           [1, 4, 200, 201, 202, 203, 204, 205, 206, 207]]
MAXTOK = int(os.environ.get("MAXTOK", "24"))

if __name__ == "__main__":
    import torch
    from psd_plugin import DEFAULT_DLLM
    from model_executor.engine import ReferenceEngine

    fam = os.environ.get("FAMILY", "llada")
    from model_executor.models.tiny import make_tiny_checkpoint
    ck = make_tiny_checkpoint(fam, f"/tmp/proto/ckpt_{fam}", DEFAULT_DLLM, seed=3)
    eng = ReferenceEngine.from_pretrained(ck)
    import dataclasses; eng.spec = dataclasses.replace(eng.spec, eos_token_id=int(os.environ.get("FAKE_EOS", "511")))
    ref = eng.generate(PROMPTS, max_tokens=MAXTOK, block_size=8,
                                                                 method="confidence", cache="prefix")
    from vllm import LLM, SamplingParams
    llm = LLM(model=str(ck), dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
              speculative_config={"method": "custom_class", "model": "dllm_proto.StubProposer",
                                  "num_speculative_tokens": 8},
              scheduler_cls="dllm_proto.ProtoScheduler", worker_cls="dllm_proto.ProtoWorker")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=MAXTOK, temperature=0, ignore_eos=True), use_tqdm=False)
    nfe = llm.collective_rpc("dllm_nfe")
    ok = True
    for r, o in zip(ref, outs):
        got = list(o.outputs[0].token_ids)
        print("ref", r.token_ids, r.nfe, r.finish_reason)
        print("vll", got, o.outputs[0].finish_reason)
        ok &= got == r.token_ids
    print("nfe", nfe)
    import dllm_proto
    for x in dllm_proto.LOG[:12]:
        print(x)
    print("MATCH" if ok else "MISMATCH")
