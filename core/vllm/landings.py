"""A decode leg's landing, taken into vLLM's scheduler before it plans the next step.

Within vLLM's connector contract the scheduler hears that KV landed only from a
step's output, so the step after that one is the first to compute the request. Each
worker rank already rings the scheduler's doorbell the moment its share lands,
naming the transfer (kvpush.vllm.wake). Here, at the start of every schedule()
(kvpush.vllm.hooks.ScheduleHook), the scheduler half first waits on the doorbell if
the last steps were idle, then reads the landing notes rung since, and once every
rank has rung for a transfer, tells vLLM its request may run: the schedule() that
follows the landing computes it. The workers' own report of that landing, a step
later, is then dropped from the step's output before vLLM reads it.

Where the hook is off (a vLLM it was not verified on, KVPUSH_VLLM_HOOKS_OFF, a rank
on another host whose ring cannot reach us), nothing is taken here and the workers'
report does it all, a step later.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpush.engine.ledger import Ledger
from kvpush.vllm import hooks
from kvpush.vllm.spans import Spans
from kvpush.vllm.wake import IdleSteps, LandingNote

# Requests whose landing was taken here, until the workers' report of it is dropped.
# Every rank reports each landing, so entries leave; the bound only guards a report
# that never comes (an engine gone down mid-step).
_TAKEN_KEPT = 4096


class Landings:
    def __init__(self, ledger: Ledger, spans: Spans, idle: IdleSteps, ranks: int) -> None:
        self.ledger = ledger
        self.spans = spans
        self.idle = idle
        self.ranks = ranks  # worker ranks that each ring for their share of a landing
        self.hook: hooks.ScheduleHook | None = None
        self.taken = 0  # landings taken here, before a step reported them
        self.by_step = 0  # landings vLLM learnt of from a step's report
        self._taken: OrderedDict[str, None] = OrderedDict()

    def attach(self, pipeline_stages: int = 1, synchronous: bool = False) -> bool:
        """Hook vLLM's schedule() (the Scheduler making the connector is on the stack).
        `synchronous`: vLLM schedules a step only once the last one's output is in (no
        async scheduling), so an engine may wait right after a step that only claims."""
        if pipeline_stages > 1:
            # Stages share tensor-parallel ranks: a rank's ring would not say which
            # stage's layers landed.
            hooks.RECORD.missed("landings_before_schedule", "pipeline parallel")
        else:
            self.hook = hooks.ScheduleHook.attach(self.before_schedule)
        self.idle.wait_before_schedule = self.hook is not None
        self.idle.synchronous = synchronous
        return self.hook is not None

    def before_schedule(self) -> None:
        self.idle.before_schedule()
        for note in self.idle.doorbell.heard():
            self._heard(note)

    def _heard(self, note: LandingNote) -> None:
        request_id = self.ledger.rank_landed(note.transfer_id, note.rank, self.ranks)
        if request_id is None or self.hook is None or not self.hook.take_landed(request_id):
            return
        walls = {"kv_ready": note.ready_wall} if note.ready_wall else {}
        self.spans.noted(request_id, walls | {"landed": note.wall})
        self.ledger.loaded(request_id, failed=False)
        self.spans.read(self.ledger.take_moves())
        self.taken += 1
        self._taken[request_id] = None
        while len(self._taken) > _TAKEN_KEPT:
            self._taken.popitem(last=False)

    def drop_reported(self, output: object) -> None:
        """A step's output, before anyone reads it: the landings it reports that were
        taken here already are removed from it."""
        if self._taken:  # only ever filled through the hook
            for request_id in hooks.ScheduleHook.drop_taken(output, self._taken):
                del self._taken[request_id]
        reported = getattr(output, "finished_recving", None) or ()
        failed = getattr(output, "failed_recving", None) or ()
        if reported or getattr(output, "finished_sending", None):
            self.idle.news()
        self.by_step += sum(request_id not in failed for request_id in reported)

    def counts(self) -> dict[str, int]:
        """How decode's scheduler learnt of its landings: here, or from a step."""
        return {"before_schedule": self.taken, "by_step_report": self.by_step}
