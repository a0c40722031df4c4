"""lm-eval `!function` hooks for every task in this folder (the project's own and the benchmarks).

lm-eval imports this file by path (relative to the YAML files), so it puts the folder that holds
the evalsuite package on sys.path itself; that makes `--include_path tasks` work from any working
directory in a source checkout that is not installed. That folder is the checkout's root for
tasks/hooks.py, and the site folder for an installed evalsuite/tasks/hooks.py.
"""
import sys
from pathlib import Path

PACKAGE_PARENT = next((folder for folder in Path(__file__).resolve().parents
                       if (folder / "evalsuite" / "__init__.py").is_file()), None)
if PACKAGE_PARENT is not None and str(PACKAGE_PARENT) not in sys.path:
    sys.path.insert(0, str(PACKAGE_PARENT))

from evalsuite.scoring.answers import score_arith, score_boxed, score_code, score_vision, score_yesno  # noqa: E402,F401
from evalsuite.scoring.benchmarks import (  # noqa: E402,F401
    boxed_integer_filter, gsm8k_flexible_filter, keep_all_generations, score_aime, score_gsm8k, score_humaneval,
    score_yes_no,
)
from evalsuite.scoring.datasets import (  # noqa: E402,F401
    load_aime24, load_aime25, load_aime_1983_2024, load_gsm8k, load_humaneval, load_strategyqa,
)
from evalsuite.scoring.heldout import (  # noqa: E402,F401
    load_arith, load_boxed, load_code, load_vision, load_yesno, vision_doc_to_image,
)
from evalsuite.scoring.mathvision import (  # noqa: E402,F401
    doc_to_image as mathvision_doc_to_image, doc_to_text as mathvision_doc_to_text, load_mathvision_testmini,
    score_mathvision,
)


def strategyqa_cot_target(doc: dict) -> str:
    """A few-shot exemplar's answer: the supporting facts as the reasoning, then the verdict."""
    reasoning = " ".join(doc["facts"])
    return f"{reasoning} So the answer is {doc['target']}.".strip()


def strategyqa_choice_index(doc: dict) -> int:
    """Index of the right answer in the choices ["yes", "no"]."""
    return 0 if doc["answer"] else 1
