"""`python -m evalsuite.tasks` prints the folder of the task YAMLs, for lm-eval's --include_path."""
from evalsuite.tasks import TASKS_DIR

print(TASKS_DIR)
