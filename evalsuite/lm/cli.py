"""`evalsuite-lm-eval`: the `lm_eval` command, every flag included, with evalsuite's models.

lm-eval finds models only through its registry, and has no plugin entry point, so this imports
the adapters (which registers them) before handing over to lm-eval's own CLI. That CLI prints and
saves what `lm_eval.simple_evaluate` returns with no step in between, so for this command's run it
is handed a simple_evaluate that adds the engine metrics first; lm-eval is left as it was after.
"""
import contextlib
import sys


@contextlib.contextmanager
def engine_metrics_in_results():
    """While active, `lm_eval.simple_evaluate` returns its results with the engine metrics added."""
    import lm_eval

    from .engine_metrics import add_engine_metrics

    evaluate = lm_eval.simple_evaluate

    def simple_evaluate(*args, **kwargs):
        results = evaluate(*args, **kwargs)
        return None if results is None else add_engine_metrics(results)  # None: not the reporting rank

    lm_eval.simple_evaluate = simple_evaluate
    try:
        yield
    finally:
        lm_eval.simple_evaluate = evaluate


def main() -> None:
    import evalsuite.lm  # noqa: F401  (registers specmoe)
    from lm_eval.__main__ import cli_evaluate

    try:
        with engine_metrics_in_results():
            cli_evaluate()
    except (ValueError, OSError) as exc:  # bad model_args, missing model or data: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"evalsuite-lm-eval: error: {first}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
