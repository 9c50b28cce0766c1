"""Which ranks of a run stopped first, and where: what a hung multi-rank job's verdicts name.

Ranks of a synchronised job stop at the same optimizer step when one of them hangs: the others
go on into the next step and block in its first collective. Each rank's furthest mark (a phase
inside a step from its heartbeats, the step it began, its last optimizer step; see
``RankState.position``) tells them apart: the ranks whose mark lies behind the furthest one,
unchanged for the limit, stopped first; the others wait for them. Where every rank reports the
same mark, the ones whose training thread sits outside a collective while the others wait in
one are the stuck ones; a rank that went silent while the others still report is one too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.position import Position
from ..model.run_state import RankState

#: What a rank's heartbeat says when its training thread waits in a collective (the client's
#: ``callbacks.where.COLLECTIVE``; the sidecar imports nothing from the callback).
COLLECTIVE = "collective"


@dataclass(frozen=True)
class StoppedFirst:
    """The ranks that stopped first (lowest first) and the ranks still waiting or reporting."""

    stuck: list[RankState]
    waiting: list[RankState]
    #: "behind" (its mark lies behind the others'), "busy" (in its own code while the others
    #: wait in a collective) or "silent" (sent nothing while the others report): the first's.
    how: str
    #: The furthest mark any rank reached.
    furthest: Position

    @property
    def first(self) -> RankState:
        return self.stuck[0]


def ranks_text(ranks: list[RankState]) -> str:
    return ",".join(str(r.rank) for r in ranks)


def stopped_first(heard: list[RankState], now: float, limit: float) -> StoppedFirst | None:
    """The ranks of ``heard`` (sorted by rank) that stopped first: behind the furthest mark
    for more than ``limit`` seconds, silent for more than ``limit``, or (every mark equal) in
    their own code while another rank waits in a collective; None when no rank stands out."""
    positions = {r.rank: r.position for r in heard}
    furthest = max(positions.values(), key=lambda p: p.key)
    behind = {r.rank for r in heard if positions[r.rank].key < furthest.key
              and now - (positions[r.rank].time or r.first_seen) > limit}
    silent = {r.rank for r in heard if now - r.last_seen > limit}
    busy: set[int] = set()
    if not behind and not silent and any(r.where == COLLECTIVE for r in heard):
        # Every rank at the same mark: the ones waiting in a collective wait for the ones
        # that are not (the trainer gathers before a step begins, too).
        busy = {r.rank for r in heard if r.where not in ("", COLLECTIVE)}
    out = behind | silent | busy
    stuck = [r for r in heard if r.rank in out]
    if not stuck:
        return None
    # The rank furthest behind leads: it stopped first.
    stuck.sort(key=lambda r: (positions[r.rank].key, r.rank))
    first = stuck[0].rank
    how = "behind" if first in behind else "busy" if first in busy else "silent"
    return StoppedFirst(stuck, [r for r in heard if r.rank not in out], how, furthest)


def since(rank: RankState) -> float:
    """When the rank reached its furthest mark (the sidecar's first word of it at worst)."""
    return rank.position.time or rank.first_seen


def account(found: StoppedFirst, now: float) -> str:
    """Which rank stopped first, where and since when, and what the others do: for the
    verdict's words."""
    first = found.first
    head = f"rank {first.rank} stopped first, at {first.position.words()}, " \
        f"{now - since(first):.0f} s ago"
    return f"{head}: {why(found, now)}"


def why(found: StoppedFirst, now: float) -> str:
    """What sets the first rank apart from the others."""
    first = found.first
    others = ranks_text(found.waiting)
    if not others:
        return "no other rank reports"
    if found.how == "behind":
        there = found.furthest.words()
        if first.position.step < found.furthest.step:
            return (f"it never began step {found.furthest.step}, which rank(s) {others} began "
                    f"and wait in (at {there})")
        return f"rank(s) {others} went on to {there} and wait there"
    if found.how == "busy":
        return (f"it is in its own code ({first.where}) while rank(s) {others} wait for it in "
                "a collective")
    return f"it sent nothing for {now - first.last_seen:.0f} s while rank(s) {others} still report"


def evidence(found: StoppedFirst, now: float) -> dict[str, str]:
    """The rank, its phase and since when, for the verdict's evidence (and the page)."""
    first = found.first
    mark = first.position
    return {"rank": str(first.rank), "stuck_ranks": ranks_text(found.stuck),
            "phase": mark.phase, "phase_step": str(mark.step),
            "stopped_seconds": f"{now - since(first):.1f}",
            "waiting_ranks": ranks_text(found.waiting),
            "waiting_phase": found.furthest.phase,
            "waiting_phase_step": str(found.furthest.step)}
