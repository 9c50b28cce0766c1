"""Build the Grafana dashboards as code and write them as committed JSON.

Two dashboards: a fleet view (runs, verdicts, firing detectors, actions) and a run view that
puts what a loss-only view shows (left column) beside what deadweight shows (right column) for
one `run_id`. Run from the repository root: `python -m dashboards.build` (`--check` compares).
Every query is listed by `queries()` so the tests can run each against a live Prometheus.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

HERE = Path(__file__).resolve().parent
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run_id="$run_id"'
FULL = 24
HALF = 12

PanelBuilder = timeseries.Panel | stat.Panel | table.Panel


def _query(expr: str, legend: str = "", *, instant: bool = False,
           ref: str = "A") -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant().format(PromQueryFormat.TABLE)
    return q


def _targets(panel: Any, queries: list[tuple[str, str]], instant: bool = False) -> Any:
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(_query(expr, legend, instant=instant, ref=chr(ord("A") + i)))
    return panel


def series(title: str, description: str, queries: list[tuple[str, str]], unit: str = "short",
           w: int = HALF, h: int = 8) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).datasource(DATASOURCE)
             .unit(unit).span(w).height(h))
    result: timeseries.Panel = _targets(panel, queries)
    return result


def single(title: str, description: str, expr: str, unit: str = "short", w: int = 6,
           h: int = 4) -> stat.Panel:
    panel = (stat.Panel().title(title).description(description).datasource(DATASOURCE)
             .unit(unit).span(w).height(h).with_target(_query(expr)))
    return panel


def tabular(title: str, description: str, queries: list[tuple[str, str]], w: int = FULL,
            h: int = 8) -> table.Panel:
    panel = (table.Panel().title(title).description(description).datasource(DATASOURCE)
             .span(w).height(h))
    result: table.Panel = _targets(panel, queries, instant=True)
    if len(queries) > 1:
        result = result.with_transformation(model.DataTransformerConfig(id_val="merge",
                                                                        options={}))
    return result


def _datasource_variable() -> dash.DatasourceVariable:
    return dash.DatasourceVariable("datasource").label("Prometheus").type("prometheus")


def fleet() -> dash.Dashboard:
    firing = "deadweight_detector_firing == 1"
    board = (
        dash.Dashboard("deadweight / fleet").uid("deadweight-fleet")
        .description("Every run the sidecars watch: verdicts, firing detectors, actions.")
        .tags(["deadweight"]).refresh("30s").time("now-6h", "now").timezone("utc")
        .with_variable(_datasource_variable())
    )
    panels: list[PanelBuilder] = [
        single("Active runs", "Runs that have not ended.",
               "sum(max by (run_id) (deadweight_run_active)) or vector(0)"),
        single("Runs with a critical verdict", "Runs with at least one critical detector "
               "firing: these page.",
               'count(max by (run_id) (deadweight_detector_firing{severity="critical"} == 1))'
               " or vector(0)"),
        single("Sidecars up", "Scraped deadweight sidecars that answer.",
               'sum(up{job=~".*deadweight.*"}) or vector(0)'),
        single("Dropped client events (1h)", "Events the training callbacks dropped because "
               "their queue was full.",
               "sum(increase(deadweight_client_dropped_events_total[1h])) or vector(0)"),
        tabular("Runs", "One row per run: progress, the loss a loss-only view shows, and the "
                "update ratio that tells whether weights move (healthy LoRA: 0.4-0.9).", [
                    ("max by (run_id, trainer) (deadweight_step)", ""),
                    ("max by (run_id) (deadweight_loss)", ""),
                    ("max by (run_id) (deadweight_update_ratio)", ""),
                    ("max by (run_id) (deadweight_run_active)", ""),
                    ("time() - max by (run_id) (deadweight_last_step_timestamp_seconds)", ""),
                ]),
        tabular("Firing detectors", "Each (run, detector) verdict that is firing now; "
                "the runbook of each is alerts/runbooks/<detector>.md.",
                [(f"max by (run_id, detector, severity) ({firing})", "")]),
        series("Firing detectors by severity", "How many verdicts fire, over time.",
               [("sum by (severity) (deadweight_detector_firing)", "{{severity}}")], w=HALF),
        series("Actions taken", "Pages, stops and kills the sidecars performed, by result.",
               [("sum by (detector, action, result) "
                 "(increase(deadweight_actions_total[$__rate_interval]))",
                 "{{detector}} {{action}} {{result}}")], w=HALF),
        series("Update ratio per run", "Scale-free update: exactly 0 means the weights did "
               "not move in that step.",
               [("max by (run_id) (deadweight_update_ratio)", "{{run_id}}")], w=HALF),
        series("Loss per run", "What a loss-only view shows.",
               [("max by (run_id) (deadweight_loss)", "{{run_id}}")], w=HALF),
    ]
    for panel in panels:
        board = board.with_panel(panel)
    return board


def run() -> dash.Dashboard:
    run_var = (
        dash.QueryVariable("run_id").label("Run").datasource(DATASOURCE)
        .query("label_values(deadweight_run_active, run_id)")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
    )
    board = (
        dash.Dashboard("deadweight / run").uid("deadweight-run")
        .description("One run: the loss-only view (left) beside what deadweight measures "
                     "(right).")
        .tags(["deadweight"]).refresh("30s").time("now-3h", "now").timezone("utc")
        .with_variable(_datasource_variable()).with_variable(run_var)
    )
    by_rank = "rank {{rank}}"
    items: list[PanelBuilder | dash.Row] = [
        dash.Row("Verdicts"),
        tabular("Detectors", "Every detector verdict for this run (1 = firing).",
                [(f"max by (detector, severity) (deadweight_detector_firing{{{RUN}}})", "")],
                w=HALF),
        single("Run active", "1 while the run has not ended.",
               f"max(deadweight_run_active{{{RUN}}})", w=4, h=8),
        single("Step", "Latest optimizer step.", f"max(deadweight_step{{{RUN}}})", w=4, h=8),
        single("Since last step", "Seconds since the slowest rank's last optimizer step.",
               f"time() - min(deadweight_last_step_timestamp_seconds{{{RUN}}})", unit="s",
               w=4, h=8),
        dash.Row("Loss-only view | deadweight view"),
        series("Loss", "What a loss-only view shows: it moves even when the weights do not.",
               [(f"deadweight_loss{{{RUN}}}", "loss")]),
        series("Update norm and scale-free ratio", "L2 of each optimizer step's change, and "
               "update_L2 / (lr * sqrt(n)); exactly 0 = frozen. Healthy LoRA ratio 0.4-0.9.",
               [(f"deadweight_update_norm{{{RUN}}}", "update_norm"),
                (f"deadweight_update_ratio{{{RUN}}}", "update_ratio")]),
        series("Gradient norm", "What a loss-only view shows: alive even when the optimizer "
               "holds none of the parameters.",
               [(f"deadweight_grad_norm{{{RUN}}}", "grad_norm")]),
        series("Optimizer membership", "Parameters the optimizer holds, parameters that "
               "require grad, and parameters with a grad that the optimizer does not hold.",
               [(f"deadweight_optimizer_params{{{RUN}}}", "in optimizer " + by_rank),
                (f"deadweight_trainable_params{{{RUN}}}", "trainable " + by_rank),
                (f"deadweight_grad_not_in_optimizer_params{{{RUN}}}",
                 "grad, not in optimizer " + by_rank)]),
        series("Learning rate", "Scheduled learning rate (0 during warmup step 1 is normal).",
               [(f"deadweight_learning_rate{{{RUN}}}", "learning_rate")]),
        series("Frozen steps", "Consecutive optimizer steps that left every weight unchanged.",
               [(f"deadweight_frozen_steps{{{RUN}}}", "frozen steps")]),
        dash.Row("RL signals"),
        series("Reward", "What a loss-only view shows for RL: mean reward.",
               [(f"deadweight_reward{{{RUN}}}", "reward")]),
        series("Reward spread", "reward_std is the batch spread; frac_reward_zero_std = 1 "
               "means every group got identical rewards (zero advantage, zero gradient).",
               [(f"deadweight_reward_std{{{RUN}}}", "reward_std"),
                (f"deadweight_frac_reward_zero_std{{{RUN}}}", "frac_reward_zero_std")]),
        series("KL to the reference", "Absent when beta = 0; exactly 0 after step 1 means "
               "the policy equals the reference.", [(f"deadweight_kl{{{RUN}}}", "kl")]),
        series("Entropy", "Token entropy; a steady fall is entropy collapse.",
               [(f"deadweight_entropy{{{RUN}}}", "entropy")]),
        series("Completion length", "Mean completion length in tokens; a steady fall is "
               "length collapse.",
               [(f"deadweight_completion_mean_length{{{RUN}}}", "mean length")], w=FULL),
        dash.Row("Checkpoints and actions"),
        series("Checkpoints", "Checkpoints written, and how many hash equal to the previous "
               "or initial adapter.",
               [(f"deadweight_checkpoints_total{{{RUN}}}", "written"),
                (f"deadweight_checkpoint_unchanged_total{{{RUN}}}", "unchanged")]),
        series("Adapter size", "Bytes of the latest adapter file; a jump means non-LoRA "
               "tensors were saved.",
               [(f"deadweight_checkpoint_adapter_bytes{{{RUN}}}", "adapter bytes")],
               unit="bytes"),
        tabular("Checkpoint digests", "Digest of the latest checkpoint's adapter tensors.",
                [(f"max by (digest) (deadweight_checkpoint_info{{{RUN}}})", "")], w=HALF),
        tabular("Actions taken", "Pages, stops and kills for this run, by result.",
                [(f"max by (detector, action, result) (deadweight_actions_total{{{RUN}}})",
                  "")], w=HALF),
    ]
    for item in items:
        board = board.with_row(item) if isinstance(item, dash.Row) else board.with_panel(item)
    return board


def to_json(board: dash.Dashboard) -> dict[str, Any]:
    """Grafana dashboard JSON (schemaVersion from the SDK, panel ids assigned in order)."""
    data: dict[str, Any] = json.loads(JSONEncoder(sort_keys=True).encode(board.build()))
    next_id = 1
    for panel in data.get("panels", []):
        panel["id"] = next_id
        next_id += 1
    return data


DASHBOARDS = {"deadweight-fleet.json": fleet, "deadweight-run.json": run}


def render() -> dict[str, str]:
    return {name: json.dumps(to_json(make()), indent=2, sort_keys=True) + "\n"
            for name, make in DASHBOARDS.items()}


def queries(data: dict[str, Any]) -> list[str]:
    """Every PromQL expression in one dashboard JSON: targets and query variables."""
    out = [t["expr"] for p in data.get("panels", []) for t in p.get("targets", [])]
    for var in data.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            out.append(query if isinstance(query, str) else query["query"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the deadweight Grafana dashboards.")
    parser.add_argument("--check", action="store_true", help="fail if a file would change")
    args = parser.parse_args(argv)
    stale = 0
    for name, text in render().items():
        path = HERE / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                print(f"stale: {path}", file=sys.stderr)
                stale += 1
        else:
            path.write_text(text)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
