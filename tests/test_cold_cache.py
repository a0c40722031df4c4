"""Every task starts from a cold expert cache: its engine metrics do not depend on what ran before."""
import lm_eval
import pytest
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from evalsuite.lm import add_engine_metrics  # (registers specmoe)

from .helpers import TASKS, shipped_model

MODEL = shipped_model("tiny-qwen3-moe")
# counts, not timings: the same requests from the same cache state move the same experts
COUNTED = ("expert_uses", "hits", "misses", "prefetches", "prefetch_used", "prefetch_wasted", "bytes_transferred",
           "hit_rate", "tokens")


def engine_metrics(engine_args: str, tasks: list[str]) -> dict[str, dict]:
    """Each task evaluated in turn by one model, as `evalsuite eval` does; the counted engine metrics per task."""
    lm = get_model("specmoe").create_from_arg_string(f"pretrained={MODEL},{engine_args}",
                                                     {"batch_size": 1, "device": "cpu"})
    manager = TaskManager(include_path=TASKS)
    try:
        out = {}
        for task in tasks:
            results = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=3, task_manager=manager)
            summary = add_engine_metrics(results)["engine"][task]
            out[task] = {name: summary[name] for name in COUNTED} | {
                "layers": {layer: row["hits"] for layer, row in summary["layers"].items()}}
        return out
    finally:
        lm.engine.close()


# on-demand: what moves depends only on the requests and the cache state. Prefetching modes also depend
# on when copies land (an expert still being copied cannot be evicted), so their counts vary run to run.
@pytest.mark.parametrize("engine_args", ["mode=on-demand,cache_capacity=0.25", "mode=on-demand,cache_capacity=8"])
def test_a_task_measures_the_same_after_another_task_as_alone(engine_args):
    after = engine_metrics(engine_args, ["evalsuite_arith", "evalsuite_yesno"])["evalsuite_yesno"]
    alone = engine_metrics(engine_args, ["evalsuite_yesno"])["evalsuite_yesno"]
    assert after == alone
    assert 0 < alone["hit_rate"] < 1  # the cache really was too small to hold every expert
