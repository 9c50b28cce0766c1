"""A recipe's fingerprint: the facts of a RunStart that must match for a comparison to hold.

Model size and what trains, trainer, optimizer and its settings, PEFT settings, data shape,
world size and library versions (a changed default often comes with a new version). What
varies between healthy runs of one recipe (seed, where it logs and saves) is left out.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...proto import pb

#: Settings that vary between runs of one recipe (or only say how it reports).
VOLATILE = frozenset({"seed", "data_seed", "logging_steps", "save_steps", "save_strategy",
                      "logging_strategy", "declared_frozen_modules",
                      "unsaved_trainable_examples"})
#: Libraries whose version is part of a recipe.
VERSIONED = ("torch", "transformers", "trl", "peft")
#: Differences named in one verdict line.
MAX_NAMED = 8


def fingerprint(start: pb.RunStart) -> dict[str, str]:
    """The recipe facts of a RunStart, as flat text (``key: value``)."""
    facts: dict[str, str] = {"trainer": start.trainer, "world_size": str(start.world_size)}
    if start.wrapper:
        facts["wrapper"] = start.wrapper
    for key, number in start.config.items():
        if key not in VOLATILE and not key.startswith("expected_trainable"):
            facts[f"config.{key}"] = f"{number:.6g}"
    for key, text in start.config_text.items():
        if key not in VOLATILE:
            facts[f"config.{key}"] = text
    m = start.membership
    facts["optimizer_params"] = str(m.optimizer_params)
    facts["trainable_params"] = str(m.trainable_params)
    f = start.preflight
    if f.is_peft:
        facts["peft.type"] = f.peft_type
        facts["peft.rank"] = str(f.lora_rank)
        facts["peft.target_modules"] = ",".join(sorted(f.requested_target_modules)) or \
            f.target_modules_regex
        if f.modules_to_save:
            facts["peft.modules_to_save"] = ",".join(sorted(f.modules_to_save))
    if start.HasField("dataset_rows"):
        facts["data.rows"] = str(start.dataset_rows.kept)
    for name in VERSIONED:
        if name in start.versions:
            facts[f"version.{name}"] = start.versions[name]
    return facts


def common(prints: list[dict[str, str]]) -> dict[str, str]:
    """The facts every one of several runs agrees on (what differs is no part of the recipe)."""
    if not prints:
        return {}
    first = prints[0]
    return {k: v for k, v in first.items() if all(p.get(k) == v for p in prints[1:])}


def differences(baseline: Mapping[str, str], run: Mapping[str, str]) -> list[str]:
    """What differs, as ``key: baseline -> run`` lines (a fact only the run has is left out:
    the baseline's runs did not agree on it, or it did not exist then)."""
    return [f"{key}: {baseline[key]} -> {run.get(key, '(absent)')}"
            for key in sorted(baseline) if run.get(key) != baseline[key]]
