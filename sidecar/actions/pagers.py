"""Every pager target behind one ``Pager``: the Alertmanager push and each webhook.

The actions page once per incident (the journal decides that); this fans the page out to every
target, settles the page's journal row from all their outcomes (``PageOutcome``) and gives
``/metrics`` each target's health. Each target delivers through the one pager outbox
(``outbox``); ``restore`` gives them back what a previous sidecar journaled and no receiver
acknowledged, with outcomes that settle those pages' journal rows too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Protocol

from .outbox import DestinationWorker, restore_pages
from .pager_health import Outcome, PageOutcome, TargetHealth, page_of


class PagerTarget(Protocol):
    """One place pages go (``AlertmanagerPusher``, ``WebhookNotifier``)."""

    health: TargetHealth
    #: Where its runbook links point (set again once /metrics' real port is known).
    runbook_url_pattern: str
    #: Its queue and thread in the pager outbox.
    worker: DestinationWorker

    def fire(
        self, run_id: str, detector: str, severity: str, summary: str, description: str,
        evidence: dict[str, str] | None = None, starts_at: float | datetime | None = None,
        on_result: Outcome | None = None, reassert: bool = False, page: int | None = None,
    ) -> None: ...

    def resolve(self, run_id: str, detector: str, severity: str,
                ends_at: float | datetime | None = None) -> None: ...

    def close(self, flush_timeout: float = 2.0) -> None: ...


#: Settles a page restored from the journal: (its action id, "delivered" or "failed").
SettleRestored = Callable[[int, str], None]


class PagerSet:
    """Fans pages out to targets; a page is delivered once every target took it."""

    def __init__(self, targets: Sequence[PagerTarget]) -> None:
        self.targets = tuple(targets)

    def health(self) -> list[TargetHealth]:
        return [t.health for t in self.targets]

    def fire(
        self, run_id: str, detector: str, severity: str, summary: str, description: str,
        evidence: dict[str, str] | None = None, starts_at: float | None = None,
        on_result: Outcome | None = None, reassert: bool = False,
    ) -> None:
        page = page_of(on_result)
        outcome = PageOutcome(len(self.targets), on_result) if on_result is not None else None
        for index, target in enumerate(self.targets):
            target.fire(run_id, detector, severity, summary, description, evidence,
                        starts_at, on_result=None if outcome is None
                        else outcome.for_target(index), reassert=reassert, page=page)

    def resolve(self, run_id: str, detector: str, severity: str) -> None:
        for target in self.targets:
            target.resolve(run_id, detector, severity)

    def restore(self, settle: SettleRestored) -> int:
        """Queue again every delivery a previous sidecar journaled that no receiver
        acknowledged (before the open incidents are re-asserted); a restored page's journal
        row is settled by settle once its remaining targets answered. Returns how many."""

        def outcome_for(page: int, targets: int) -> Callable[[int], Outcome]:
            return PageOutcome(targets, lambda result: settle(page, result)).for_target

        return restore_pages([t.worker for t in self.targets], outcome_for)

    def mute(self, run_id: str, detectors: list[str], until: float, comment: str) -> None:
        """Mute on the targets that can (Alertmanager); a webhook never posts resolutions."""
        for target in self.targets:
            mute = getattr(target, "mute", None)
            if callable(mute):
                mute(run_id, detectors, until, comment)

    def unmute(self, run_id: str, detector: str) -> None:
        for target in self.targets:
            unmute = getattr(target, "unmute", None)
            if callable(unmute):
                unmute(run_id, detector)

    def close(self, flush_timeout: float = 2.0) -> None:
        for target in self.targets:
            target.close(flush_timeout)
