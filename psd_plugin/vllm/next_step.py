"""What the runner hands the scheduler after each step (the ticket of the two processes' one exchange): vLLM's
draft tokens plus, per request, a typed :class:`NextStep`, and the requests the runner failed."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.outputs import DraftTokenIds


@dataclass(frozen=True)
class NextStep:
    """What the runner tells the scheduler of one request's next step, beside its draft tokens."""

    recompute_from: int  # where its next forward starts: the scheduler rolls ``num_computed_tokens`` back to it
    extra_rows: int = 0  # rows the step adds beyond its scheduled tokens (a dLLM's further canvases)
    logits_rows: int = 0  # rows of logits the step computes
    planned: bool = False  # a step is planned (drafts, or a replay with none): never cut, it waits whole
    # under pipeline parallelism: the planned step itself (a DLLMStep without its proposal), which the scheduler
    # ships to the stages before the last (they lay out the step from it; only the last stage decodes)
    plan: object = None
    num_scheduled: int = 0  # rows vLLM schedules (from recompute_from: the first canvas, and a replay's tail)
    # under async scheduling: the step after this one if it does not complete its block (geometry only, no
    # drafts), which the scheduler schedules before this step's outcome is known (:mod:`.scheduler`); None: no
    # guess (a replay)
    then: "NextStep | None" = None

    def same_rows(self, w0: int, n: int) -> bool:
        """Whether a step vLLM scheduled as ``n`` rows from ``w0`` is this one."""
        return self.planned and (self.recompute_from, self.num_scheduled) == (w0, n)


@dataclass
class PSDDraftTokenIds(DraftTokenIds):
    """vLLM's draft tokens plus, per request (in ``req_ids`` order), its :class:`NextStep`, and the requests the
    runner failed (:meth:`PSDRunnerMixin._fail`), which the scheduler finishes with an error. Synchronous
    engines hand it over through ``take_draft_token_ids``; under async scheduling it rides on the step's
    ``ModelRunnerOutput`` (:func:`.compat.attach_ticket`)."""

    next_steps: list[NextStep] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
