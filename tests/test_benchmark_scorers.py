"""Benchmark answer extraction, pass@k, the HumanEval sandbox scorer and the data loaders.

The gold-answer checks run every reference answer of the real data files through
the same filters (lm-eval's own where the YAML names them) and scorers the task YAMLs name.
"""
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from math import comb
from pathlib import Path

import pytest

from evalsuite.scoring import answers
from evalsuite.scoring import benchmarks as bm
from evalsuite.scoring import datasets as ds
from evalsuite.scoring.code_eval import pass_at_k, truncate_completion

from .helpers import shared_data
from .task_filters import apply_filter


DATA_DIR = Path(shared_data()) if shared_data() else None
needs_data = pytest.mark.skipif(DATA_DIR is None, reason="benchmark data directory (shared/data) not found")


@pytest.fixture
def local_data(monkeypatch):
    monkeypatch.setenv(ds.DATA_DIR_ENV, str(DATA_DIR))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def through_filter(filter_fn, text: str) -> str:
    """One generation through an lm-eval custom filter, as lm-eval calls it (a list of repeats per doc)."""
    return filter_fn([[text]], [{}])[0]


# ---------------------------------------------------------------- extraction units


def test_gsm8k_strict_takes_first_hash_answer_and_flexible_takes_last_number():
    text = "She pays $1,200 in total.\n#### 1,200\nThen 7 more"
    assert answers.extract_gsm8k_strict(text) == "1200"
    assert answers.extract_last_number(text) == "7"
    assert answers.extract_gsm8k_strict("The answer is 5.") is None
    assert answers.extract_last_number("no digits here") is None
    assert answers.extract_last_number("It costs $-3.50.") == "-3.50"
    assert answers.extract_last_number("So 18 apples...") == "18"  # a digit is needed: "..." is no number
    assert apply_filter("gsm8k_es", "strict-match", [text, "The answer is 5."]) == ["1,200", answers.NO_ANSWER]


def test_gsm8k_number_comparison_is_numeric():
    assert answers.same_number("18.00", "18")
    assert answers.same_number("$1,000", "1000")
    assert not answers.same_number("19", "18")
    assert not answers.same_number(answers.NO_ANSWER, "18")
    assert not answers.same_number(None, "18")
    assert not answers.same_number("NaN", "18") and not answers.same_number("sNaN", "18")


def test_final_yes_no_is_the_last_verdict():
    texts = ["Yes, Albany NY is bigger. So the answer is no.", "NO", "Nobody knows; yesterday it rained."]
    assert [answers.extract_yes_no(text) for text in texts] == ["no", "no", None]
    assert apply_filter("strategyqa_es_cot", "final-yes-no", texts) == ["no", "no", answers.NO_ANSWER]


@pytest.mark.parametrize("text, expected", [
    (r"so $\boxed{033}$", 33),
    (r"first \boxed{1} then \boxed{\mathbf{127} }", 127),
    (r"$b = \boxed{\textbf{(211) }}$", 211),
    (r"or $\framebox{204}$ minutes", 204),
    (r"\boxed{104.}", 104),
    (r"\boxed{45^\circ}", 45),
    (r"\boxed{\frac{1}{2}}", None),
    (r"\boxed{x+1}", None),
    (r"\boxed{12", None),  # cut off inside the box
    ("the answer is 12", None),
    (r"\boxed{Infinity}", None),
    (r"\boxed{sNaN}", None),
])
def test_boxed_integer_extraction(text, expected):
    assert answers.extract_boxed_integer(text) == expected


def test_aime_scorer_accepts_any_accepted_answer():
    doc = {"answer": 80, "accepted_answers": [80, 81]}
    assert bm.score_aime(doc, [through_filter(bm.boxed_integer_filter, r"\boxed{081}")])["exact_match"] == 1.0
    assert bm.score_aime(doc, [through_filter(bm.boxed_integer_filter, r"\boxed{82}")])["exact_match"] == 0.0
    assert bm.score_aime(doc, [through_filter(bm.boxed_integer_filter, "80")])["exact_match"] == 0.0


# ---------------------------------------------------------------- pass@k


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("samples", [1, 3, 6])
def test_pass_at_k_matches_enumerating_every_subset(samples):
    for correct in range(samples + 1):
        outcomes = [True] * correct + [False] * (samples - correct)
        for k in range(1, samples + 1):
            assert pass_at_k(samples, correct, k) == pytest.approx(brute_force_pass_at_k(outcomes, k))


def test_pass_at_k_large_n_matches_closed_form():
    assert pass_at_k(200, 13, 10) == pytest.approx(1 - comb(187, 10) / comb(200, 10))
    assert pass_at_k(20, 5, 1) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        pass_at_k(5, 1, 10)


# ---------------------------------------------------------------- HumanEval in the sandbox

SQUARE_DOC = {
    "prompt": "def square(x):\n    \"\"\"Return x squared.\"\"\"\n",
    "test": "def check(candidate):\n    assert candidate(3) == 9\n    assert candidate(-2) == 4\n",
    "entry_point": "square",
}


def test_humaneval_scorer_reports_pass_at_k_over_all_samples(monkeypatch):
    # A short wall-clock limit, so the endless loop below fails fast.
    monkeypatch.setattr(bm, "HUMANEVAL_LIMITS", bm.SandboxLimits(wall_seconds=1.0, cpu_seconds=1))
    samples = ["    return x * x\n", "    return x + x\n", "    return x ** 2\n", "    while True:\n        pass\n",
               "    return x * x\n", "    return abs(x) * 3\n"]
    scores = bm.score_humaneval(SQUARE_DOC, [samples])
    assert set(scores) == {"pass_at_1", "pass_at_5"}  # 6 samples: pass@10 is not defined
    assert scores["pass_at_1"] == pytest.approx(3 / 6)
    assert scores["pass_at_5"] == pytest.approx(pass_at_k(6, 3, 5))


def test_humaneval_completion_is_cut_at_top_level_code():
    completion = "    return x * x\n\nprint('side effect')\nraise SystemExit(1)\n"
    assert truncate_completion(completion) == "    return x * x\n"
    assert bm.score_humaneval(SQUARE_DOC, [[completion]]) == {"pass_at_1": 1.0}


@needs_data
def test_every_humaneval_canonical_solution_passes_and_wrong_ones_fail(local_data):
    docs = list(ds.load_humaneval()["test"])
    assert len(docs) == 164
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        scores = list(pool.map(lambda doc: bm.score_humaneval(doc, [[doc["canonical_solution"]]]), docs))
    failed = [doc["task_id"] for doc, score in zip(docs, scores) if score != {"pass_at_1": 1.0}]
    assert failed == []
    assert time.perf_counter() - start < 120
    # A body that returns nothing, and another problem's solution, both fail.
    for i in (0, 50, 100):
        wrong = ["    return None\n", docs[i + 1]["canonical_solution"]]
        assert bm.score_humaneval(docs[i], [wrong])["pass_at_1"] == 0.0, docs[i]["task_id"]


# ---------------------------------------------------------------- gold answers of the real data


@needs_data
def test_every_gsm8k_gold_solution_scores_under_both_filters(local_data):
    docs = list(ds.load_gsm8k()["test"])
    assert len(docs) == 1319
    strict = apply_filter("gsm8k_es", "strict-match", [doc["answer"] for doc in docs])
    for doc, strict_match in zip(docs, strict):
        flexible = through_filter(bm.gsm8k_flexible_filter, doc["answer"])
        for extracted in (strict_match, flexible):
            assert bm.score_gsm8k(doc, [extracted]) == {"exact_match": 1.0}, (doc["question"], extracted)
        # Off by one must not match: the comparison looks at the number, not just any output.
        assert bm.score_gsm8k(doc, [str(int(doc["target"]) + 1)]) == {"exact_match": 0.0}


@needs_data
@pytest.mark.parametrize("loader, rows", [(ds.load_aime24, 30), (ds.load_aime25, 30), (ds.load_aime_1983_2024, 933)])
def test_every_aime_gold_answer_scores_when_boxed(local_data, loader, rows):
    docs = list(loader()["test"])
    assert len(docs) == rows
    for doc in docs:
        for accepted in doc["accepted_answers"]:
            boxed = through_filter(bm.boxed_integer_filter, f"Thus the answer is $\\boxed{{{accepted}}}$.")
            assert bm.score_aime(doc, [boxed]) == {"exact_match": 1.0}
        if doc["solution"]:
            from_solution = through_filter(bm.boxed_integer_filter, doc["solution"])
            assert bm.score_aime(doc, [from_solution]) == {"exact_match": 1.0}, doc["id"]
        unboxed = through_filter(bm.boxed_integer_filter, str(doc["answer"]))
        assert bm.score_aime(doc, [unboxed]) == {"exact_match": 0.0}


@needs_data
def test_aime_solutions_exist_for_2024_only(local_data):
    # The solution-text check above must actually have run on the 2024 solutions.
    assert all(doc["solution"] for doc in ds.load_aime24()["test"])


@needs_data
def test_every_strategyqa_gold_verdict_scores(local_data):
    docs = list(ds.load_strategyqa()["test"])
    assert len(docs) == 229 and {doc["target"] for doc in docs} == {"yes", "no"}

    def verdicts(texts):
        return apply_filter("strategyqa_es_cot", "final-yes-no", texts)

    bare = verdicts([doc["target"] for doc in docs])
    reasoned = verdicts([f"{' '.join(doc['facts'])} So the answer is {doc['target']}." for doc in docs])
    flipped = verdicts(["no" if doc["target"] == "yes" else "yes" for doc in docs])
    for doc, *read in zip(docs, bare, reasoned, flipped):
        assert [bm.score_yes_no(doc, [verdict]) for verdict in read] == [
            {"exact_match": 1.0}, {"exact_match": 1.0}, {"exact_match": 0.0}], doc["question"]


# ---------------------------------------------------------------- loaders


def test_missing_file_is_a_one_line_error_naming_the_variable_and_path(tmp_path, monkeypatch):
    monkeypatch.setenv(ds.DATA_DIR_ENV, str(tmp_path))
    for loader, relative in [(ds.load_gsm8k, "gsm8k/test.jsonl"), (ds.load_humaneval, "humaneval/test.jsonl"),
                             (ds.load_strategyqa, "strategyqa/dev.jsonl"), (ds.load_aime25, "aime/aime2025.jsonl")]:
        with pytest.raises(ds.MissingDataError) as error:
            loader()
        message = str(error.value)
        assert "\n" not in message
        assert ds.DATA_DIR_ENV in message and str(tmp_path / relative) in message


def test_unset_data_dir_reads_the_hub_datasets_lm_eval_uses(monkeypatch):
    """Without EVALSUITE_DATA_DIR the loaders ask `datasets.load_dataset` (stubbed here) for lm-eval's Hub data."""
    import datasets

    calls = []
    hub_rows = {
        ("openai/gsm8k", "main"): {"question": "1+1?", "answer": "1+1=<<1+1=2>>2\n#### 2"},
        ("openai/openai_humaneval", None): {**SQUARE_DOC, "task_id": "T/0", "canonical_solution": "    return x*x\n"},
        ("hails/bigbench", "strategyqa_zero_shot"): {
            "inputs": "Q: Is water wet?\n  A:", "targets": ["Yes. It is."],
            "multiple_choice_targets": ["Yes", "No"], "multiple_choice_scores": [1, 0]},
        ("Maxwell-Jia/AIME_2024", None): {"ID": "2024-II-4", "Problem": "P", "Solution": r"\boxed{033}", "Answer": 33},
        ("math-ai/aime25", None): {"id": 0, "problem": "P", "answer": "70"},
        ("gneubig/aime-1983-2024", None): {"ID": "2022-II-8", "Year": 2022, "Question": "P",
                                           "Answer": "080 or 081 (both were accepted)", "Part": "II"},
    }

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return [hub_rows[(path, name)]]

    monkeypatch.delenv(ds.DATA_DIR_ENV, raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)

    assert ds.load_gsm8k()["test"][0]["target"] == "2"
    assert ds.load_humaneval()["test"][0]["entry_point"] == "square"
    strategyqa = ds.load_strategyqa()["test"][0]
    assert (strategyqa["question"], strategyqa["answer"], strategyqa["target"]) == ("Is water wet?", True, "yes")
    assert ds.load_aime24()["test"][0]["accepted_answers"] == [33]
    assert ds.load_aime25()["test"][0]["answer"] == 70
    historical = ds.load_aime_1983_2024()["test"][0]
    assert (historical["answer"], historical["accepted_answers"]) == (80, [80, 81])
    assert set(calls) == {
        ("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test"),
        ("openai/openai_humaneval", None, "test"),
        ("hails/bigbench", "strategyqa_zero_shot", "train"), ("hails/bigbench", "strategyqa_zero_shot", "validation"),
        ("Maxwell-Jia/AIME_2024", None, "train"), ("math-ai/aime25", None, "test"),
        ("gneubig/aime-1983-2024", None, "train"),
    }


def test_bigbench_no_answer_is_read_from_the_choice_scores():
    row = {"inputs": "Q: Can a cat fly?\nA:", "targets": ["No. Cats lack wings."],
           "multiple_choice_targets": ["Yes", "No"], "multiple_choice_scores": [0, 1]}
    assert ds.normalise_strategyqa(row) == {"question": "Can a cat fly?", "answer": False, "target": "no", "facts": []}
