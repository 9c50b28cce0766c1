"""Detectors over what trains against what is saved or expected, checked at train begin.

The client reports, beside the optimizer membership, the optimizer's parameters that a PEFT
save leaves out (``unsaved_trainable_params``), the model's size, the band of trainable
percent the user expects (``expected_trainable_pct_low/high``) and the modules the user
declared frozen; see ``callbacks/facts/trainable.py``.
"""

from __future__ import annotations

from ...proto import pb
from ..model.run_state import RunState
from ..model.settings import DetectorSettings
from .base import SpecDetector, Verdict, fmt, start_facts_or_silent, trainer_loop
from .spec import DetectorSpec, Evidence, Policy, Severity


def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


class BaseWeightsTrained(SpecDetector):
    """A PEFT run whose optimizer trains base weights that the adapter save leaves out.

    Typically ``for p in model.parameters(): p.requires_grad_(True)`` after ``get_peft_model``:
    the optimizer trains the whole model, the loss falls, and the checkpoint holds only the
    adapter; base + saved adapter is the untrained base. What the save will hold is PEFT's own
    answer (``get_peft_model_state_dict``: adapter tensors, ``modules_to_save``, trained
    biases), so every method and option counts what it really saves.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "lora-modules-to-save",
                         "optimizer-over-every-parameter"),
        false_positives=("none known at critical: a Trainer saves a PEFT model through the "
                         "adapter, so what the base learns is lost from every checkpoint it "
                         "writes; a raw loop may save the full model itself, so there it fires "
                         "as a warning. Frozen parameters an optimizer holds (built over "
                         "`model.parameters()`) get no gradient and do not count"),
        id="base_weights_trained",
        severity=Severity.CRITICAL,
        lower_severity=Severity.WARNING,
        lower_when="the run is a raw loop (`deadweight.watch`): the script may save the full "
        "model itself",
        latching=True,
        summary="Run {run_id} trains base weights that its adapter save throws away",
        meaning="the optimizer trains base-model weights in a PEFT run that saves only the "
        "adapter, so what those weights learn is lost at save",
        fix="re-freeze the base after wrapping (call `get_peft_model` after any code that sets "
        "`requires_grad`), and put heads or embeddings that must train in `modules_to_save`",
        fires_when="at train begin, the optimizer of a PEFT run holds parameters that the "
        "adapter save (`get_peft_model_state_dict`: adapter, `modules_to_save`, trained "
        "biases) leaves out",
        evidence=(Evidence("optimizer_params", 101328), Evidence("trainable_params", 101328)),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        start = start_facts_or_silent(run)
        if not isinstance(start, pb.RunStart):
            return start
        unsaved = int(run.config.get("unsaved_trainable_params", 0))
        if not start.preflight.is_peft or unsaved <= 0:
            return Verdict(False)
        m = start.membership
        total = run.config.get("model_params", 0.0)
        examples = start.config_text.get("unsaved_trainable_examples", "")
        method = start.preflight.peft_type or "PEFT"
        return Verdict(
            True,
            step=0,
            severity=None if trainer_loop(run) else Severity.WARNING,
            summary=(
                f"the optimizer trains {unsaved} base-model params in "
                f"{int(run.config.get('unsaved_trainable_tensors', 0))} tensors "
                f"({examples or 'base weights'}, ...) that the {method} "
                f"adapter save leaves out: {_pct(m.optimizer_params, total):.3g}% of the model "
                f"trains, the adapter is {_pct(m.adapter_params, total):.3g}%; re-freeze the base "
                f"after get_peft_model, or save the full model (modules_to_save for heads)"
            ),
            evidence={
                "unsaved_trainable_params": fmt(unsaved),
                "unsaved_trainable_tensors": fmt(int(run.config.get(
                    "unsaved_trainable_tensors", 0))),
                "unsaved_examples": examples or "n/a",
                "optimizer_params": fmt(m.optimizer_params),
                "adapter_params": fmt(m.adapter_params),
                "model_params": fmt(int(total)),
                "trainable_pct": fmt(_pct(m.optimizer_params, total)),
                "step": "0 (train begin)",
            },
        )


class TrainableOutOfBand(SpecDetector):
    """The trainable fraction lies outside the band the user said to expect.

    For full fine-tunes and custom setups no config states what should train: the user's
    band (``expected_trainable_pct=(low, high)`` on the callback or ``watch``, or
    ``DEADWEIGHT_EXPECTED_TRAINABLE_PCT=LOW-HIGH``) does. Silent when no band is set.
    """

    spec = DetectorSpec(
        checked_against=("healthy-matrix", "conformance-twin", "lora-twin-expected-band"),
        false_positives="a band set too narrow by the user; silent without a band",
        id="trainable_out_of_band",
        severity=Severity.WARNING,
        policy=Policy.OBSERVE,
        latching=True,
        summary="Run {run_id} trains a share of its parameters outside the expected band",
        meaning="the parameters the optimizer trains are a larger or smaller share of the "
        "model than the band the run was told to expect",
        fix="check which parameters require grad against the band you set "
        "(`expected_trainable_pct`): a freeze that did not take, or a target list that matched "
        "too little",
        fires_when="at train begin, the optimizer's share of the model's parameters lies "
        "outside `expected_trainable_pct` (callback/`watch` argument or "
        "`DEADWEIGHT_EXPECTED_TRAINABLE_PCT=LOW-HIGH`; silent without one)",
        evidence=(Evidence("optimizer_params", 101328), Evidence("trainable_params", 101328)),
    )

    def evaluate(self, run: RunState, settings: DetectorSettings) -> Verdict | None:
        if run.start is None:
            return None
        config = run.config
        low = config.get("expected_trainable_pct_low")
        high = config.get("expected_trainable_pct_high")
        total = config.get("model_params", 0.0)
        m = run.start.membership
        if low is None or high is None or total <= 0 or m.layout == "unknown":
            return Verdict(False)
        pct = _pct(m.optimizer_params, total)
        if low <= pct <= high:
            return Verdict(False)
        return Verdict(
            True,
            step=0,
            summary=(f"the optimizer trains {m.optimizer_params} of {int(total)} params "
                     f"({pct:.3g}%), outside the expected {low:g}-{high:g}%"),
            evidence={"trainable_pct": fmt(pct), "expected_low_pct": fmt(low),
                      "expected_high_pct": fmt(high), "optimizer_params": fmt(m.optimizer_params),
                      "model_params": fmt(int(total)), "step": "0 (train begin)"},
        )
