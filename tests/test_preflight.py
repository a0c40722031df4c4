"""Pre-flight checks of an eval request: checkpoints, tasks that run code, model configurations."""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from evalsuite.lm.preflight import check_checkpoint, check_eval, task_manager, unsafe_tasks

from .helpers import eval_request, shipped_model


@pytest.fixture(scope="module")
def manager():
    return task_manager()


def sharded_copy(folder):
    """The shipped tiny model split into two safetensors shards with an index, like large checkpoints."""
    shutil.copytree(shipped_model(), folder, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(f"{shipped_model()}/model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def cut(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])


def test_intact_checkpoints_pass(tmp_path):
    check_checkpoint(shipped_model())
    check_checkpoint(str(sharded_copy(tmp_path / "sharded")))


@pytest.mark.parametrize("keep", [-1, -4096, 100, 7, 0])
def test_a_truncated_checkpoint_is_named(tmp_path, keep):
    folder = tmp_path / "m"
    shutil.copytree(shipped_model(), folder)
    cut(folder / "model.safetensors", keep)
    with pytest.raises(ValueError, match=r"model\.safetensors .*(truncated|damaged).*copy it again") as info:
        check_checkpoint(str(folder))
    assert "\n" not in str(info.value)


def test_a_truncated_or_missing_shard_is_named(tmp_path):
    folder = sharded_copy(tmp_path / "sharded")
    cut(folder / "model-00002-of-00002.safetensors", -10)
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors .*truncated"):
        check_checkpoint(str(folder))
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors.*named in"):
        check_checkpoint(str(folder))
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json"):
        check_checkpoint(str(folder))


def test_a_directory_without_weights(tmp_path):
    shutil.copytree(shipped_model(), tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        check_checkpoint(str(tmp_path / "m"))


def test_tasks_that_run_code_are_found_through_groups_and_includes(manager):
    assert unsafe_tasks(["evalsuite_arith", "evalsuite_yesno"], manager) == []
    assert unsafe_tasks(["evalsuite_code"], manager) == ["evalsuite_code"]
    assert unsafe_tasks(["humaneval_es_sampled"], manager) == ["humaneval_es_sampled"]  # via include:
    assert unsafe_tasks(["evalsuite_all"], manager) == ["evalsuite_all"]  # a group of groups
    assert unsafe_tasks(["benchmarks_es"], manager) == []


def test_a_request_is_checked_whole(manager):
    request = dict(models=[shipped_model()], modes=["resident", "speculative"], tasks=["evalsuite_arith"], limit=1,
                   predictor="gate", predictor_path=None, cache_capacity=0.25, link="ufs4", db_url=None,
                   confirm_run_unsafe_code=False)
    check_eval(**eval_request(**request), manager=manager)
    for change, words in ((dict(modes=[]), "--modes"), (dict(modes=["resident", "warp"]), "warp"),
                          (dict(limit=0), "--limit"), (dict(tasks={shipped_model(): []}), "--tasks"),
                          (dict(predictor_path="/nonexistent/p.safetensors"), "/nonexistent/p.safetensors"),
                          (dict(db_url="postgresql://::bad"), "not a URL")):
        with pytest.raises((ValueError, OSError), match=".*") as info:
            check_eval(**eval_request(**{**request, **change}), manager=manager)
        assert words in str(info.value), (change, str(info.value))


def test_a_bad_database_is_refused_before_the_task_index_is_built(tmp_path, monkeypatch):
    """Building lm-eval's task index takes seconds: a database folder that does not exist is named first."""
    from evalsuite.lm import preflight

    def no_index():
        raise AssertionError("the task index was built before the database was checked")

    monkeypatch.setattr(preflight, "task_manager", no_index)
    with pytest.raises(ValueError, match="does not exist"):
        check_eval([shipped_model()], ["resident"], ["evalsuite_arith"], 1, db_url=f"sqlite:///{tmp_path}/no/r.db")
