"""`evalsuite-lm-eval`: the `lm_eval` command, every flag included, with evalsuite's models.

lm-eval finds models only through its registry, and has no plugin entry point, so this
imports the adapters (which registers them) before handing over to lm-eval's own CLI.
"""
import sys


def main() -> None:
    import evalsuite.lm  # noqa: F401  (registers specmoe)
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except (ValueError, OSError) as exc:  # bad model_args, missing model or data: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"evalsuite-lm-eval: error: {first}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
