"""``VLLMEngine``: the ``psd generate/eval --engine vllm`` path, with the reference engine's interface.

It builds one ``vllm.LLM`` per (model, decoding config) with ``speculative_config={"method": "psd", ...}``
and returns :class:`~model_executor.outputs.GenerationResult` objects (tokens up to and including EOS,
NFE from the runner's counters), so :func:`psd_plugin.evaluate.evaluate` and the benchmarks drive both
engines the same way.
"""

from __future__ import annotations

import os
import time

import msgspec

from model_executor.decode_config import DecodeConfig
from model_executor.outputs import GenerationResult

from . import compat
from .config import PSDSpeculativeConfig


class VLLMEngine:
    def __init__(self, path, dtype: str = "auto", **llm_kwargs):
        """``dtype`` "auto": float32 on CPU (the reference engine's exactness; a quantized checkpoint bfloat16, what
        vLLM's CPU kernels for it take), bfloat16 on CUDA."""
        from model_executor.models.configs import ArchSpec, register_configs
        from model_executor.models.reference import read_config

        from .config import GPU_DTYPE

        register_configs()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        self.path = str(path)
        from model_executor.models.quantization import quantization_config

        cpu = "bfloat16" if quantization_config(path) else "float32"
        self.dtype = dtype if dtype != "auto" else cpu if compat.platform_is_cpu() else GPU_DTYPE
        self.spec = ArchSpec.from_hf_config(read_config(path))
        # vLLM's defaults otherwise: on CPU the model's decoder layers are compiled (``enforce_eager=True`` to skip)
        self.llm_kwargs = {"max_model_len": min(self.spec.max_position, 4096), **llm_kwargs}
        self._llm = None
        self._key = None

    def _engine(self, spec_config: dict):
        key = repr(sorted(spec_config.items()))
        if self._key != key:
            from vllm import LLM

            self.close()
            self._llm = LLM(model=self.path, dtype=self.dtype, speculative_config=spec_config, **self.llm_kwargs)
            self._key = key
        return self._llm

    def close(self) -> None:
        if self._llm is not None:
            compat.shutdown(self._llm)
            self._llm = None

    def step_time(self) -> dict:
        """The runner's step counter and model-forward seconds so far (``{}`` before the first request)."""
        return compat.psd_stats(self._llm)["step_time"] if self._llm is not None else {}

    def generate(self, prompts: list[list[int]], *, max_tokens: int = 32, block_size: int = 8,
                 method: str = "psd", cache: str | None = None, seed: int = 0, temperature: float = 0.0,
                 batch_size: int = 64, graph=None, config: DecodeConfig | None = None,
                 ignore_eos: bool = False, **knobs) -> list[GenerationResult]:
        """Decode every prompt through vLLM, as the reference engine's ``generate`` does: with a resolved
        ``config`` (:class:`~model_executor.decode_config.DecodeConfig`), or ``method``, ``block_size``,
        ``cache``, ``graph`` (a path) and ``knobs`` (:class:`PSDSpeculativeConfig` fields); ``ignore_eos``: every request
        decodes ``max_tokens`` (for timing steady steps)."""
        from vllm import SamplingParams

        if config is not None:
            method, block_size, cache = config.method, config.block_size, config.cache
            knobs = {k: v for k, v in msgspec.structs.asdict(config.knobs).items() if k != "cache"}
            graph = knobs.pop("graph", None)

        for p in prompts:
            if len(p) + max_tokens > self.spec.max_position:
                raise ValueError(f"prompt of {len(p)} tokens + max_tokens {max_tokens} exceeds the model's "
                                 f"context of {self.spec.max_position} tokens")
        fields = set(PSDSpeculativeConfig.__struct_fields__)
        spec_config = {"method": "psd", "decoding": method, "cache": cache,
                       **{k: v for k, v in knobs.items() if k in fields and v is not None}}
        if self.spec.attention != "block_causal":
            spec_config["block_size"] = block_size
        if graph is not None:
            spec_config["graph"] = str(graph)  # a path; the runner loads and checks it
        llm = self._engine({k: v for k, v in spec_config.items() if v is not None})
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                                 seed=(seed * 1_000_003 + i) if temperature > 0 else None)
                  for i in range(len(prompts))]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        stats = compat.request_stats(llm)
        results = []
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            st = stats.get(o.request_id, {})
            extra = {k: v for k, v in st.items() if k not in ("nfe", "model_calls", "emitted", "seconds")}
            results.append(GenerationResult(list(p), list(c.token_ids), st.get("nfe", 0), st.get("seconds", seconds),
                                            "stop" if c.finish_reason == "stop" else "length", extra))
        return results
