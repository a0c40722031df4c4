"""The adapter off the CPU (or with store=disk) builds the model without its experts instead of loading it whole;
exact modes still give resident's tokens, and lm-eval's batches reach the engine unchanged in meaning."""
import lm_eval
import pytest
import transformers
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from evalsuite.lm import add_engine_metrics  # importing evalsuite.lm registers specmoe
from evalsuite.engine import arch

from .helpers import TASKS, shipped_model

MODEL = shipped_model("tiny-qwen3-moe")
TASK = "evalsuite_arith"


@pytest.fixture(scope="module")
def manager():
    return TaskManager(include_path=TASKS)


def adapter(model_args: str, batch_size: int = 1):
    return get_model("specmoe").create_from_arg_string(f"pretrained={MODEL},{model_args}",
                                                       {"batch_size": batch_size, "device": "cpu"})


def generations(lm, manager, limit: int = 5) -> dict:
    results = add_engine_metrics(lm_eval.simple_evaluate(model=lm, tasks=[TASK], limit=limit, log_samples=True,
                                                         task_manager=manager))
    return {s["doc_id"]: s["resps"] for s in results["samples"][TASK]}, results["engine"][TASK]


@pytest.fixture(scope="module")
def resident(manager):
    """Resident's generations at batch 1 and at batch 3, loaded the ordinary way (from_pretrained)."""
    out = {}
    for batch in (1, 3):
        lm = adapter("mode=resident", batch)
        out[batch] = generations(lm, manager)[0]
        lm.engine.close()
    return out


@pytest.mark.parametrize("mode", ["on-demand", "router-preserving"])
def test_store_disk_never_loads_the_experts_whole_and_is_exact(resident, manager, monkeypatch, mode):
    def whole(*args, **kwargs):
        raise AssertionError("the whole model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", whole)
    lm = adapter(f"mode={mode},store=disk,cache_capacity=0.25")  # the path device=cuda takes, on the CPU
    engine = lm.engine
    assert engine.unloaded and engine.device_expert_bytes() == engine.cache.nbytes  # only the cache holds experts
    assert all(layer.experts.gate_up_proj.numel() == 0 for layer in arch.sparse_layers(lm.model))
    assert generations(lm, manager)[0] == resident[1]
    engine.close()
    assert all(layer.experts.gate_up_proj.is_meta for layer in arch.sparse_layers(lm.model))  # never read back whole


@pytest.mark.parametrize("mode", ["on-demand", "router-preserving"])
def test_exact_modes_at_batch_3_give_residents_batch_3_generations(resident, manager, mode):
    lm = adapter(f"mode={mode},cache_capacity=0.25", batch_size=3)
    got, engine = generations(lm, manager)
    lm.engine.close()
    assert got == resident[3]
    assert engine["requests"] == 2  # 5 documents went to the model as 2 batched generate calls


def test_options_only_from_pretrained_applies_are_refused_without_it():
    with pytest.raises(ValueError, match="specmoe: peft= cannot be applied to a model loaded without") as no:
        adapter("mode=on-demand,store=disk,peft=some/adapter")
    assert "\n" not in str(no.value)


def test_the_vision_language_adapter_loads_without_its_experts_too(monkeypatch):
    vl_model, task = shipped_model("tiny-qwen3-vl-moe"), "evalsuite_vision"
    manager = TaskManager(include_path=TASKS)

    def run(model_args: str):
        lm = get_model("specmoe-vlm").create_from_arg_string(f"pretrained={vl_model},{model_args}",
                                                             {"batch_size": 1, "device": "cpu"})
        results = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=3, log_samples=True, task_manager=manager)
        return lm, {s["doc_id"]: s["resps"] for s in results["samples"][task]}

    _, want = run("mode=resident")
    monkeypatch.setattr(transformers.AutoModelForImageTextToText, "from_pretrained",
                        lambda *a, **k: pytest.fail("the whole model was loaded"))
    lm, got = run("mode=on-demand,store=disk,cache_capacity=0.25")
    assert lm.engine.unloaded and lm.engine.device_expert_bytes() == lm.engine.cache.nbytes
    assert got == want
    lm.engine.close()
