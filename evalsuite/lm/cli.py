"""`evalsuite-lm-eval`: the `lm_eval` command, every flag included, with evalsuite's models.

lm-eval finds models only through its registry, and has no plugin entry point, so this imports
the adapters (which registers them) before handing over to lm-eval's own CLI. That CLI prints and
saves what `lm_eval.simple_evaluate` returns with no step in between, so for this command's run it
is handed a simple_evaluate that adds the engine metrics first (and, with `--db URL`, stores the run
in the results database); lm-eval is left as it was after.
"""
import contextlib
import os
import sys

DB_FLAG = "--db"
DB_HELP = (f"{DB_FLAG} URL (evalsuite's own flag): also store the run in this results database, as `evalsuite eval` "
           "does: its configuration, task metrics, engine metrics and every sample")


def take_db_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """`--db URL` / `--db=URL` out of the arguments (lm-eval's parser does not know it): (URL or None, the rest)."""
    rest, url = [], None
    args = iter(argv)
    for arg in args:
        if arg == DB_FLAG:
            url = next(args, None)
            if url is None or url.startswith("-"):
                raise ValueError(f"{DB_FLAG} needs a database URL or file, e.g. {DB_FLAG} results/results.db")
        elif arg.startswith(DB_FLAG + "="):
            url = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return url, rest


def run_config(results: dict) -> dict:
    """The configuration a run of this command is stored under: the model (a directory by its name, a Hub id as
    it is), the engine's settings, and lm-eval's model_args and generation settings; lm-eval's own
    (limit, seed, device, versions) are added by ResultsDB.record_lm_eval."""
    from lm_eval.utils import simple_parse_args_string

    from ..hub import is_hub_id

    lm_config = results.get("config") or {}
    model_args = lm_config.get("model_args") or {}
    if isinstance(model_args, str):
        model_args = simple_parse_args_string(model_args)
    pretrained = str(model_args.get("pretrained") or lm_config.get("model"))
    engine = lm_config.get("evalsuite_engine") or {}
    hub = is_hub_id(pretrained)
    dtype = lm_config.get("model_dtype")
    return {"model": pretrained if hub else os.path.basename(pretrained.rstrip("/")),
            "model_path": pretrained if hub else os.path.abspath(pretrained),
            "lm_eval_model": lm_config.get("model"), "mode": engine.get("mode"), "predictor": engine.get("predictor"),
            "cache_capacity": engine.get("cache_capacity"), "cache_policy": engine.get("cache_policy"),
            "link": engine.get("link"), "model_fingerprint": engine.get("model_fingerprint"),
            "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
            "batch_size": lm_config.get("batch_size"), "gen_kwargs": lm_config.get("gen_kwargs"),
            "model_args": model_args, "engine": engine or None, "tasks": sorted(results.get("results", {})),
            "source": "evalsuite-lm-eval"}


@contextlib.contextmanager
def engine_metrics_in_results(db=None):
    """While active, `lm_eval.simple_evaluate` returns its results with the engine metrics added; with a
    ResultsDB `db`, each evaluation is also stored there as one run, samples included (lm-eval logs them for
    the database; they stay in the results only when the caller asked for them)."""
    import lm_eval

    from .engine_metrics import add_engine_metrics

    evaluate = lm_eval.simple_evaluate

    def simple_evaluate(*args, **kwargs):
        wants_samples = kwargs.get("log_samples", False)
        if db is not None:
            kwargs["log_samples"] = True
        results = evaluate(*args, **kwargs)
        if results is None:  # not the reporting rank
            return None
        add_engine_metrics(results)
        if db is not None:
            run_id = db.record_lm_eval(run_config(results), results, results.get("engine"))
            print(f"evalsuite-lm-eval: stored as run {run_id} in {db.url}", file=sys.stderr)
            if not wants_samples:
                results.pop("samples", None)
        return results

    lm_eval.simple_evaluate = simple_evaluate
    try:
        yield
    finally:
        lm_eval.simple_evaluate = evaluate


def main() -> None:
    try:
        url, sys.argv[1:] = take_db_flag(sys.argv[1:])
        if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
            print(f"evalsuite-lm-eval: lm-eval's command; every flag below works, and {DB_HELP}\n")
        import evalsuite.lm  # noqa: F401  (registers specmoe)
        from lm_eval.__main__ import cli_evaluate

        from ..results import ResultsDB

        db = ResultsDB(url) if url is not None else None  # a bad URL fails here, before any model loads
        with engine_metrics_in_results(db):
            cli_evaluate()
    except (ValueError, OSError) as exc:  # bad model_args, missing model or data, bad --db: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"evalsuite-lm-eval: error: {first}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
