"""The lm-eval task YAMLs resolve their hooks from any working directory and serve the held-out items."""
from pathlib import Path

from evalsuite.tasks import TASKS_DIR as PACKAGE_TASKS
from evalsuite.taskgen.corpus import HELDOUT_SIZE, heldout_items

TASKS_DIR = Path(PACKAGE_TASKS)


def test_tasks_load_with_include_path(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    loaded = manager.load(["evalsuite_tiny"])
    assert "evalsuite_tiny" in loaded["groups"]
    names = {task.config.task: task for task in loaded["tasks"].values()}
    assert set(names) == {"evalsuite_arith", "evalsuite_yesno", "evalsuite_code", "evalsuite_boxed"}
    code = names["evalsuite_code"]
    docs = list(code.test_docs())
    assert len(docs) == HELDOUT_SIZE
    assert code.doc_to_text(docs[0]) == heldout_items("code")[0]["prompt"]
    reference = docs[0]["completion"]
    assert code.process_results(docs[0], [reference]) == {"pass_at_1": 1.0}
    assert code.process_results(docs[0], ["    return None\n"]) == {"pass_at_1": 0.0}


def test_the_checkout_serves_its_top_level_tasks_folder_as_lm_eval_include_path(monkeypatch):
    # `lm_eval --include_path tasks` from a checkout's root reads the same files the package ships as evalsuite.tasks
    from lm_eval.tasks import TaskManager

    repo = Path(__file__).resolve().parent.parent
    assert TASKS_DIR.resolve() == repo / "tasks"  # an editable install maps evalsuite.tasks onto tasks/
    monkeypatch.chdir(repo)
    task = TaskManager(include_path="tasks", include_defaults=False).load(["evalsuite_arith"])["tasks"]
    [arith] = task.values()
    docs = list(arith.test_docs())
    assert arith.doc_to_text(docs[0]) == heldout_items("arith")[0]["prompt"]
