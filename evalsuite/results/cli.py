"""`evalsuite runs | report | compare | gate`: add_commands(subparsers) adds them to the main parser.

Each subcommand's `run` default takes the parsed args and returns the exit code; bad input raises ValueError or
FileNotFoundError with a one-line message.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..table import Column, format_table

_DB_HELP = "results database: SQLAlchemy URL or SQLite path (default: $EVALSUITE_DB, else results/results.db)"
_LISTED = ["id", "started_at", "status", "model", "mode", "predictor", "bits", "cache_capacity", "cache_policy", "link",
           "tasks", "limit", "accuracy", "tpot_ms"]
_NUMBERS = {"id", "cache_capacity", "limit", "accuracy", "tpot_ms"}


def _open(args):
    from .database import ResultsDB

    return ResultsDB(args.db)


def cmd_runs(args) -> int:
    from .report import summary_table

    with _open(args) as db:
        runs = db.runs(status=args.status)
        if runs.empty:
            print(f"no runs in {db.url}")
            return 0
        shown = runs.head(args.last)
        ids = shown["id"].tolist()
        table = summary_table(shown, db.task_metrics(ids), db.engine_metrics(ids))
    table = table.merge(shown[["id", "started_at", "error", "expert_bits"]].rename(columns={"expert_bits": "bits"}),
                        on="id")[_LISTED + ["error"]]
    table["started_at"] = table["started_at"].map(lambda t: t.strftime("%Y-%m-%d %H:%M") if hasattr(t, "strftime")
                                                  else t)
    columns = [Column(name, "d" if name == "id" else ".4g") if name in _NUMBERS else name for name in table.columns]
    print(format_table(table.astype(object).itertuples(index=False), columns))
    return 0


def cmd_report(args) -> int:
    from .report import report

    with _open(args) as db:
        made = report(db, args.out, sweep=args.sweep)
    print(format_pareto(made["tables"]["pareto"]))
    print(f"wrote {made['html']} ({len(made['plots'])} plots, tables: "
          + ", ".join(f"{n}.csv" for n in made["tables"]) + ")")
    for note in made["notes"]:
        print(f"  skipped {note}")
    return 0


def format_pareto(front) -> str:
    """The Pareto fronts as text: one table per model, task set and limit, by rising TPOT."""
    from .plots import limit_text

    if front.empty:
        return "Pareto fronts: no run has both an accuracy and a TPOT"
    lines = ["Pareto fronts (accuracy vs TPOT, per model, task set and limit):"]
    columns = [Column("run", "d"), "setting", Column("accuracy", ".3f"), Column("TPOT ms", ".2f")]
    for (model, tasks, limit), part in front.groupby(["model", "tasks", "limit"], sort=True, dropna=False):
        lines.append(f"  {model}: tasks {tasks}, limit {limit_text(limit)}")
        cells = [[row.id, " / ".join(str(v) for v in (row.mode, row.predictor, row.cache_capacity, row.link)
                                     if v is not None and v == v), row.accuracy, row.tpot_ms]
                 for row in part.itertuples(index=False)]
        lines.append(format_table(cells, columns, indent="    "))
    return "\n".join(lines)


def cmd_compare(args) -> int:
    from .compare import compare, format_comparison

    with _open(args) as db:
        table = compare(db, args.run_a, args.run_b, tasks=args.task, force=args.force)
    for warning in table.attrs["warnings"]:
        print(f"evalsuite: warning: {warning}; compared anyway (--force)", file=sys.stderr)
    print(format_comparison(table))
    if args.csv:
        table.to_csv(args.csv, index=False)
    return 0


def cmd_gate(args) -> int:
    from .gate import gate

    if not os.path.exists(args.config):  # before opening (and perhaps creating) a database
        raise FileNotFoundError(f"gates file {args.config} not found; pass --config PATH (see docs/results.md)")
    with _open(args) as db:
        return gate(db, args.config)


def cmd_paper_tables(args) -> int:
    from .paper_tables import accuracy_table, format_accuracy, format_recall, recall_table

    with _open(args) as db:
        recall, accuracy = recall_table(db, args.model), accuracy_table(db, args.model)
    print(format_recall(recall))
    print()
    print(format_accuracy(accuracy))
    if args.csv:
        os.makedirs(args.csv, exist_ok=True)
        recall.to_csv(os.path.join(args.csv, "recall.csv"), index=False)
        accuracy.to_csv(os.path.join(args.csv, "accuracy.csv"), index=False)
        print(f"wrote {args.csv}/recall.csv and accuracy.csv")
    return 0


def add_commands(subparsers) -> None:
    """Add runs, report, compare, gate and paper-tables to an argparse subparsers object."""
    p = subparsers.add_parser("runs", help="list stored runs, newest first")
    p.add_argument("--status", choices=("running", "complete", "incomplete", "failed"))
    p.add_argument("--last", type=int, default=50, help="show at most this many runs")
    p.set_defaults(run=cmd_runs)

    p = subparsers.add_parser("report", help="CSV tables, plots and an HTML page over all stored runs")
    p.add_argument("--out", default=os.path.join("results", "report"), help="output folder")
    p.add_argument("--sweep", help="only the runs of this sweep (its `name`)")
    p.set_defaults(run=cmd_report)

    p = subparsers.add_parser("compare", help="run B vs run A per task: delta, paired test, bootstrap CI")
    p.add_argument("run_a", metavar="RUN_A")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--task", action="append", help="only this task (repeatable)")
    p.add_argument("--csv", help="also write the comparison to this CSV file")
    p.add_argument("--force", action="store_true",
                   help="compare runs that differ in model, task set, limit, few-shot or seed (with a warning)")
    p.set_defaults(run=cmd_compare)

    p = subparsers.add_parser("gate", help="check release gates (YAML rules); exit 1 when any fails")
    p.add_argument("--config", required=True, help="gates YAML file")
    p.set_defaults(run=cmd_gate)

    p = subparsers.add_parser("paper-tables", help="the seeds' tables from stored runs: recall@k and exact@K per "
                                                   "predictor (SpecPrefetch), accuracy of resident / speculative / "
                                                   "hybrid (Speculating Experts)")
    p.add_argument("--model", help="only this model (as the runs name it)")
    p.add_argument("--csv", help="also write recall.csv and accuracy.csv into this folder")
    p.set_defaults(run=cmd_paper_tables)

    for name in ("runs", "report", "compare", "gate", "paper-tables"):
        subparsers.choices[name].add_argument("--db", default=None, help=_DB_HELP)


def _standalone(argv=None) -> int:
    """For trying the commands before they are wired into `evalsuite`: python -m evalsuite.results.cli ..."""
    import sys

    parser = argparse.ArgumentParser(prog="python -m evalsuite.results.cli")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(_standalone())
