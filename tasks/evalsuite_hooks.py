"""lm-eval `!function` hooks for the evalsuite_* tasks.

lm-eval imports this file by path (relative to the YAML files), so it puts the
repository root on sys.path itself; that makes `--include_path tasks` work from
any working directory without installing the package.
"""
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from evalsuite.scoring.answers import score_arith, score_boxed, score_code, score_yesno  # noqa: E402,F401
from evalsuite.scoring.heldout import (  # noqa: E402,F401
    load_arith, load_boxed, load_code, load_yesno,
)
