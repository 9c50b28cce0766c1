"""The baseline file: a small, versioned, human-readable JSON document.

One or more healthy runs of one recipe give: the recipe's fingerprint (what must be the same
for the comparison to mean something), which module kinds the optimizer moved and how far
(per-element update over the learning rate), the share of the model that trained, and, per
figure (loss, grad norm, learning rate, update size, RL signals), a band per bin of
normalised steps: the lowest, median and highest value the runs showed there. Version 2 adds
the largest jump of the gradient norm over its recent level the runs showed
(``grad_norm_jump``, which calibrates ``grad_norm_spike``) and, for runs of several ranks, how
far their slowest rank's own step time lay above the next one's (``rank_time_ratio``, which
calibrates ``rank_straggler``); a version 1 file reads as one without them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The file format's version; a reader refuses a newer one and reads every older one.
VERSION = 2
#: What the file says it is (a stray JSON document is refused).
KIND = "deadweight.baseline"
#: Largest baseline a run may send (and the sidecar accepts) in its RunStart.
MAX_BASELINE_BYTES = 64 * 1024
#: Bins of normalised steps per figure.
BINS = 20
#: Module kinds kept (a model with more keeps the ones that moved most).
MAX_MODULES = 64
#: Fingerprint entries kept, and the longest value.
MAX_FINGERPRINT = 128
MAX_FINGERPRINT_TEXT = 256


class BaselineError(ValueError):
    """The baseline cannot be read or made (wrong kind, newer version, damaged, too large)."""


@dataclass(frozen=True)
class Band:
    """The values healthy runs showed in one place: lowest, median, highest."""

    low: float
    median: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Band | None:
        finite = sorted(v for v in values if math.isfinite(v))
        if not finite:
            return None
        return cls(finite[0], finite[len(finite) // 2], finite[-1])

    def to_json(self) -> list[float]:
        return [_round(self.low), _round(self.median), _round(self.high)]

    @classmethod
    def from_json(cls, value: Any) -> Band | None:
        if value is None:
            return None
        low, median, high = (float(v) for v in value)
        return cls(low, median, high)


@dataclass(frozen=True)
class ModuleFacts:
    """One module kind of the baseline runs: how often it moved, and how far per unit lr."""

    moved_share: float
    tensors: int
    update_over_lr: Band | None


@dataclass(frozen=True)
class Baseline:
    """What healthy runs of one recipe looked like (see the module's docstring)."""

    runs: tuple[str, ...]
    steps: int
    fingerprint: Mapping[str, str]
    modules: Mapping[str, ModuleFacts]
    series: Mapping[str, tuple[Band | None, ...]]
    trainable_share: Band | None = None
    step_seconds: Band | None = None
    tokens_per_step: Band | None = None
    #: The largest gradient norm over its recent level (``quantities.jump``) the runs showed;
    #: None when they logged too few norms, or the file predates version 2.
    grad_norm_jump: float | None = None
    #: The largest median, over ``straggler_steps`` consecutive steps every rank timed, of a
    #: step's slowest rank's own seconds over the next slowest's; None for one-rank runs.
    rank_time_ratio: float | None = None
    created: str = ""
    version: int = VERSION
    #: The file's name, as the run named it (not part of the content).
    name: str = field(default="", compare=False)
    #: (quantity, relative margin) -> per bin, the (lowest, highest) value inside the widened
    #: band: worked out once, read at every point a detector walks.
    _limits: dict[tuple[str, float], tuple[tuple[float, float] | None, ...]] = field(
        default_factory=dict, compare=False, repr=False)

    def limits(self, quantity: str, relative: float
               ) -> tuple[tuple[float, float] | None, ...]:
        """Per bin of the quantity, the values a run may show there (``margin`` beyond the
        band on either side); None where the baseline saw none."""
        key = (quantity, relative)
        found = self._limits.get(key)
        if found is None:
            found = tuple(None if b is None else (b.low - margin(b, relative),
                                                  b.high + margin(b, relative))
                          for b in self.series.get(quantity, ()))
            self._limits[key] = found
        return found

    def band(self, quantity: str, step: int, total: int) -> Band | None:
        """The quantity's band at a run's step of total steps (normalised to the baseline's)."""
        bands = self.series.get(quantity)
        if not bands:
            return None
        return bands[bin_of(step, total or self.steps, len(bands))]

    def to_json(self) -> str:
        document = {
            "kind": KIND,
            "version": self.version,
            "created": self.created,
            "runs": list(self.runs),
            "steps": self.steps,
            "fingerprint": dict(sorted(self.fingerprint.items())),
            "trainable_share": _band(self.trainable_share),
            "step_seconds": _band(self.step_seconds),
            "tokens_per_step": _band(self.tokens_per_step),
            "grad_norm_jump": None if self.grad_norm_jump is None
            else _round(self.grad_norm_jump),
            "rank_time_ratio": None if self.rank_time_ratio is None
            else _round(self.rank_time_ratio),
            "modules": {name: {"moved_share": round(m.moved_share, 4), "tensors": m.tensors,
                               "update_over_lr": _band(m.update_over_lr)}
                        for name, m in sorted(self.modules.items())},
            "series": {"bins": BINS, **{q: [_band(b) for b in bands]
                                        for q, bands in sorted(self.series.items())}},
        }
        return json.dumps(document, indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, name: str = "") -> Baseline:
        """Read a baseline document (raises BaselineError)."""
        if len(text) > MAX_BASELINE_BYTES:
            raise BaselineError(f"baseline is {len(text)} bytes, more than "
                                f"{MAX_BASELINE_BYTES}")
        try:
            document = json.loads(text)
        except (ValueError, UnicodeDecodeError) as err:
            raise BaselineError(f"baseline is not JSON: {err}") from err
        if not isinstance(document, dict) or document.get("kind") != KIND:
            raise BaselineError(f"not a deadweight baseline (kind {KIND!r} missing)")
        version = document.get("version")
        if not isinstance(version, int) or not 1 <= version <= VERSION:
            raise BaselineError(f"baseline version {version!r}: this deadweight reads "
                                f"1..{VERSION}")
        try:
            series = document.get("series") or {}
            return cls(
                runs=tuple(str(r) for r in document.get("runs") or ()),
                steps=max(1, int(document.get("steps") or 1)),
                fingerprint={str(k)[:MAX_FINGERPRINT_TEXT]: str(v)[:MAX_FINGERPRINT_TEXT]
                             for k, v in list((document.get("fingerprint") or {}).items())
                             [:MAX_FINGERPRINT]},
                modules={str(k): ModuleFacts(float(m.get("moved_share", 0.0)),
                                             int(m.get("tensors", 0)),
                                             Band.from_json(m.get("update_over_lr")))
                         for k, m in list((document.get("modules") or {}).items())
                         [:MAX_MODULES]},
                series={str(q): tuple(Band.from_json(b) for b in bands)
                        for q, bands in series.items() if q != "bins" and bands},
                trainable_share=Band.from_json(document.get("trainable_share")),
                step_seconds=Band.from_json(document.get("step_seconds")),
                tokens_per_step=Band.from_json(document.get("tokens_per_step")),
                grad_norm_jump=_positive(document.get("grad_norm_jump")),
                rank_time_ratio=_positive(document.get("rank_time_ratio")),
                created=str(document.get("created") or ""),
                version=version,
                name=name,
            )
        except (TypeError, ValueError, AttributeError) as err:
            raise BaselineError(f"baseline is damaged: {err}") from err


def margin(band: Band, relative: float) -> float:
    """How far outside its band a value may lie: the band's own width, or ``relative`` of
    its size, whichever is larger (one healthy run gives a narrow band; seeds differ)."""
    size = max(abs(band.low), abs(band.high))
    return max(band.high - band.low, relative * size, 1e-12)


def bin_of(step: int, total: int, bins: int = BINS) -> int:
    """The bin of a step among total steps (step 1 is the first)."""
    if total <= 0:
        return 0
    return max(0, min(bins - 1, int((step - 1) * bins / total)))


def _band(band: Band | None) -> list[float] | None:
    return None if band is None else band.to_json()


def _positive(value: Any) -> float | None:
    """An optional positive finite figure (None stays None; anything else is damage)."""
    if value is None:
        return None
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"expected a positive figure, got {value!r}")
    return number


def _round(value: float) -> float:
    """Five significant digits: a readable file, far below any band's width."""
    return float(f"{value:.5g}") if math.isfinite(value) else value
