"""Membership on real PEFT models: which tensors the per-module-kind groups hold.

GRPO with ``beta > 0`` on an adapter loaded from disk adds a frozen "ref" copy of it, never
active and never in the optimizer. Counting that copy in the module-kind groups would show
half of every module "unchanged" in the report and in the per-element counts.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deadweight.callbacks.facts.membership import measure
from deadweight.demo import runs


def _module_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    found = measure(model, optimizer)
    return [found.watched_names[i] for g in found.groups if g.kind == "module"
            for i in g.indices]


def test_a_reference_copy_of_the_adapter_is_left_out_of_the_module_groups(
        tiny: tuple[Path, Path]) -> None:
    model = runs.load_adapter(*tiny, trainable=True)
    model.add_adapter("ref", model.peft_config["default"])  # what GRPOTrainer does
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    names = _module_names(model, optimizer)
    assert names and all(".default." in n for n in names), names
    assert any(".ref." in n for n in measure(model, optimizer).watched_names)


def test_an_adapter_loaded_frozen_stays_in_the_module_groups(tiny: tuple[Path, Path]) -> None:
    """The F1 mistake: the active adapter is outside the optimizer, and must still be seen."""
    model = runs.load_adapter(*tiny, trainable=False)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    names = _module_names(model, optimizer)
    assert names and all(".default." in n for n in names), names
