"""``deadweight baseline save RUN_ID... --state-dir DIR --output FILE`` and ``deadweight
baseline show FILE``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..baseline.model import MAX_BASELINE_BYTES, Band, Baseline, BaselineError

if TYPE_CHECKING:
    from typing import TypeAlias

    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]


def _save(args: argparse.Namespace) -> int:
    from ..baseline.build import build
    from .cli_args import state_store

    store = state_store("baseline", args.state_dir)
    if store is None:
        return 2
    try:
        baseline = build(store, args.run_ids)
    except BaselineError as err:
        print(f"deadweight baseline: {err}", file=sys.stderr)
        return 2
    finally:
        store.close()
    text = baseline.to_json()
    if len(text) > MAX_BASELINE_BYTES:
        print(f"deadweight baseline: the baseline is {len(text)} bytes, more than a run may "
              f"send ({MAX_BASELINE_BYTES})", file=sys.stderr)
        return 2
    out = Path(args.output)
    out.write_text(text + "\n", encoding="utf-8")
    print(f"deadweight baseline: wrote {out} from {len(baseline.runs)} run(s), "
          f"{baseline.steps} steps, {len(baseline.series)} figures, "
          f"{len(baseline.modules)} module kinds ({len(text)} bytes)")
    return 0


def _band(band: Band | None) -> str:
    if band is None:
        return "-"
    return f"{band.low:.4g}..{band.high:.4g} (median {band.median:.4g})"


def render(baseline: Baseline) -> str:
    """The baseline as a person reads it."""
    lines = [f"baseline {baseline.name} (version {baseline.version}, created "
             f"{baseline.created or '?'})",
             f"  runs: {', '.join(baseline.runs)}; {baseline.steps} steps",
             f"  trainable share: {_band(baseline.trainable_share)}",
             f"  step seconds: {_band(baseline.step_seconds)}",
             f"  tokens per step: {_band(baseline.tokens_per_step)}",
             "  largest grad-norm jump over its recent level: " + (
                 "-" if baseline.grad_norm_jump is None else f"{baseline.grad_norm_jump:.3g}x"),
             "  slowest rank's own step time over the next rank's: " + (
                 "-" if baseline.rank_time_ratio is None
                 else f"{baseline.rank_time_ratio:.3g}x"),
             "  fingerprint:"]
    lines += [f"    {key}: {value}" for key, value in sorted(baseline.fingerprint.items())]
    lines.append("  module kinds (share of steps moved, update per element over lr):")
    lines += [f"    {name}: moved {facts.moved_share:.0%}, {facts.tensors} tensors, "
              f"{_band(facts.update_over_lr)}" for name, facts in sorted(baseline.modules.items())]
    lines.append("  bands over normalised steps (start, middle, end):")
    for quantity, bands in sorted(baseline.series.items()):
        picks = [bands[0], bands[len(bands) // 2], bands[-1]]
        lines.append(f"    {quantity}: " + " | ".join(_band(b) for b in picks))
    return "\n".join(lines)


def _show(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        baseline = Baseline.from_json(path.read_bytes(), name=path.name)
    except (OSError, BaselineError) as err:
        print(f"deadweight baseline: {err}", file=sys.stderr)
        return 2
    print(render(baseline))
    return 0


def add(commands: Commands) -> None:
    """Register ``deadweight baseline save|show``."""
    baseline = commands.add_parser(
        "baseline", help="what a healthy run of a recipe looks like: save one, show one")
    actions = baseline.add_subparsers(dest="baseline_command", required=True)
    save = actions.add_parser("save", help="a baseline file from finished healthy runs")
    save.add_argument("run_ids", nargs="+", metavar="RUN_ID",
                      help="healthy runs of one recipe (several, e.g. seeds, widen the bands)")
    save.add_argument("--state-dir", required=True, metavar="DIR",
                      help="the --state-dir of the sidecar that watched the runs")
    save.add_argument("--output", required=True, metavar="FILE",
                      help="where to write the baseline (JSON)")
    save.set_defaults(func=_save)
    show = actions.add_parser("show", help="print a baseline file")
    show.add_argument("file", metavar="FILE")
    show.set_defaults(func=_show)
