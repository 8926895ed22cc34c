import os
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
if __name__ == "__main__":
    from vllm.engine.arg_utils import EngineArgs
    orig = EngineArgs.create_speculative_config
    def patched(self, target_model_config, target_parallel_config):
        sc = self.speculative_config
        if isinstance(sc, dict) and sc.get("method") == "psd":
            knobs = {k: v for k, v in sc.items() if k != "method"}
            self.additional_config = {**dict(self.additional_config or {}), "psd": knobs}
            self.speculative_config = {"method": "custom_class", "model": "dllm_proto.StubProposer",
                                       "num_speculative_tokens": int(knobs.get("block_size", 32))}
            if self.scheduler_cls is None:
                self.scheduler_cls = "dllm_proto.ProtoScheduler"
            if target_parallel_config.worker_cls == "auto":
                target_parallel_config.worker_cls = "dllm_proto.ProtoWorker"
        return orig(self, target_model_config, target_parallel_config)
    EngineArgs.create_speculative_config = patched
    from vllm import LLM, SamplingParams
    llm = LLM(model="/tmp/proto/ckpt_llada", dtype="float32", max_model_len=256, enforce_eager=True,
              speculative_config={"method": "psd", "block_size": 8, "threshold": 0.9})
    c = llm.llm_engine.vllm_config
    print("CFG", c.speculative_config, c.additional_config, c.scheduler_config.scheduler_cls, c.parallel_config.worker_cls)
    o = llm.generate([{"prompt_token_ids": [1, 3, 50, 60]}], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    print("OUT", o[0].outputs[0].token_ids)
