"""Answer extraction, metrics and a subprocess sandbox used by the project's lm-eval tasks."""
