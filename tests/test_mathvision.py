"""MATH-Vision testmini: the loader, the prompt, and the scorer validated against the gold answers."""
import json
from pathlib import Path

import pytest

from evalsuite.scoring import datasets as ds
from evalsuite.scoring.mathvision import LETTERS, choice_letter, is_correct, normalise_mathvision

from .helpers import TASKS, shared_data

DATA_DIR = Path(shared_data()) if shared_data() else None
pytestmark = pytest.mark.skipif(DATA_DIR is None, reason="benchmark data directory (shared/data) not found")


@pytest.fixture(scope="module")
def docs():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ds.DATA_DIR_ENV, str(DATA_DIR))
        rows = [json.loads(line) for line in (DATA_DIR / "mathvision_testmini" / "testmini.jsonl").open()]
        yield [normalise_mathvision(row) for row in rows]


def wrong_answer(doc):
    if doc["multiple_choice"]:
        return LETTERS[(LETTERS.index(doc["answer"]) + 1) % len(doc["options"])]
    return "123456"


def test_every_gold_answer_scores_and_every_wrong_one_does_not(docs):
    assert len(docs) == 304 and sum(d["multiple_choice"] for d in docs) == 190
    for doc in docs:
        assert is_correct(doc, f"Counting carefully gives the result. \\boxed{{{doc['answer']}}}"), doc["id"]
        assert is_correct(doc, f"So the answer is {doc['answer']}."), doc["id"]
        assert not is_correct(doc, f"\\boxed{{{wrong_answer(doc)}}}"), doc["id"]
        assert not is_correct(doc, "I cannot tell."), doc["id"]


def test_multiple_choice_accepts_the_usual_wrappings_and_the_option_text(docs):
    with_texts = [d for d in docs if d["multiple_choice"] and d["options"] != list(LETTERS)]
    assert len(with_texts) == 117
    for doc in with_texts:
        letter = doc["answer"]
        text = doc["options"][LETTERS.index(letter)]
        forms = [f"\\boxed{{({letter})}}", f"\\boxed{{\\text{{{letter}}}}}", f"The answer is ({letter})."]
        if text not in LETTERS:  # id 742 has an option whose text is "E": a bare letter is a letter
            forms.append(f"\\boxed{{{text}}}")
        for generation in forms:
            assert is_correct(doc, generation), (doc["id"], generation)
    assert choice_letter("(C) 12", ["1", "5", "12", "3", "4"]) == "C"


def test_free_form_compares_numbers_by_value(docs):
    doc = next(d for d in docs if d["answer"] == "2.5")
    assert is_correct(doc, "\\boxed{2.50}") and is_correct(doc, "\\boxed{$2.5$}") and not is_correct(doc, "\\boxed{25}")
    point = next(d for d in docs if d["answer"] == "(3,-4)")
    assert is_correct(point, "\\boxed{(3, -4)}") and not is_correct(point, "\\boxed{(-4, 3)}")


def test_the_task_loads_offline_with_its_images(monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv(ds.DATA_DIR_ENV, str(DATA_DIR))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    task = TaskManager(include_path=TASKS, include_defaults=False).load(["mathvision_testmini_es"])
    task = task["tasks"]["mathvision_testmini_es"]
    docs = list(task.test_docs())
    assert len(docs) == 304
    doc = docs[0]
    text = task.doc_to_text(doc)
    assert text.startswith("<image>\n") and "<image1>" not in text and "\\boxed{}" in text
    images = task.doc_to_image(doc)
    assert len(images) == 1 and images[0].mode == "RGB" and min(images[0].size) > 16
    assert task.process_results(doc, [f"\\boxed{{{doc['answer']}}}"])["exact_match"] == 1.0
