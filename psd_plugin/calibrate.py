"""``psd calibrate``: build a Spiffy draft graph for a model from recorded vanilla trajectories (Alg. 2)."""

from __future__ import annotations

from pathlib import Path


from model_executor.decoding import GRAPH_FORMAT_VERSION, DraftGraph, calibrate, make_policy
from model_executor.decoding.policies import PolicyDecoder


class TrajectoryRecorder(PolicyDecoder):
    """The base policy, recording (state, prediction with full probabilities, next state) per step into
    ``steps`` (:class:`~model_executor.decoding.policies.PolicyDecoder`'s ``record``)."""

    def __init__(self, block, mask_id, policy, sink: list):
        super().__init__(block, mask_id, policy, record=[])
        self.steps: list = self.record
        sink.append(self.steps)


def calibrate_graph(engine, prompts: list[list[int]], *, model_name: str, policy: str = "static",
                    threshold: float = 0.9, lookahead: int = 4, budget: int = 10, block_size: int = 8,
                    max_tokens: int = 32, batch_size: int = 16, progress: bool = True) -> DraftGraph:
    """Decode ``prompts`` with the base policy, record every block's trajectory, and run Spiffy Alg. 2."""
    from tqdm import tqdm

    rule = make_policy(policy, threshold=threshold)
    mask = engine.spec.mask_token_id
    trajectories: list = []
    for s in tqdm(range(0, len(prompts), batch_size), desc="calibrate: vanilla trajectories", disable=not progress):
        engine.generate(prompts[s: s + batch_size], max_tokens=max_tokens, block_size=block_size, method=policy,
                        decoder_factory=lambda blk: TrajectoryRecorder(blk, mask, rule, trajectories))
    nodes = calibrate([t for t in trajectories if t], lookahead=lookahead, budget=budget)
    if not nodes:
        raise ValueError("calibration found no multi-step windows; use more prompts or a larger --lookahead")
    return DraftGraph(format_version=GRAPH_FORMAT_VERSION, model=model_name, block_size=block_size,
                      base_policy=policy, threshold=threshold, lookahead=lookahead, nodes=nodes)


def default_calibration_prompts(n: int, seed: int = 12345) -> list[str]:
    """``n`` prompts of the short tasks from the training distribution (never the held-out split), tasks
    interleaved (the draft graphs are calibrated at the short tasks' 32-token budget)."""
    from .train.tasks import TASKS, load_heldout, training_stream

    held = {r["prompt"] for r in load_heldout()}
    stream = training_stream(seed, held, TASKS)
    return [next(stream).prompt for _ in range(n)]


def model_name(path: str | Path) -> str:
    return Path(path).resolve().name
