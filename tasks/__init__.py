"""lm-eval task YAMLs (the project's own tasks and the real benchmarks): the checkout's top-level tasks/,
shipped inside the package as evalsuite.tasks (pyproject's package-dir).

Hand TASKS_DIR to lm-eval as its include path: `TaskManager(include_path=TASKS_DIR)`, or on the
command line `--include_path tasks` from a checkout's root, `--include_path "$(python -m evalsuite.tasks)"`
from anywhere. The YAMLs' `!function` hooks are in hooks.py.
"""
import os

TASKS_DIR = os.path.dirname(os.path.abspath(__file__))
