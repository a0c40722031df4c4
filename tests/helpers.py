"""Shared test helpers: cached tiny reference models and left-padded prompt batches."""
import copy
import functools
import os

import torch

from evalsuite.tasks import TASKS_DIR
from evalsuite.zoo.tiny import tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tiny models gain nothing from intra-op threads, and oversubscribed cores slow them 100x.
torch.set_num_threads(1)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@functools.lru_cache(maxsize=None)
def reference_model(model_type: str, dtype: str = "float32"):
    """A cached tiny model per (model_type, dtype): read-only, deepcopy it to modify."""
    return tiny_model(model_type, dtype=DTYPES[dtype])


def batch(size: int, seq: int = 10, vocab: int = 128, seed: int = 0):
    """Random prompts, left-padded by different amounts, with their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (size, seq), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, size):
        pad = (2 * row) % (seq - 2)
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = TASKS_DIR


def copy_and_reference(rows: int, tokens: int):
    """A copy of the tiny qwen3 model, a batch, and the resident model's greedy generation of it."""
    reference = reference_model("qwen3_moe")
    ids, mask = batch(rows)
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return copy.deepcopy(reference), ids, mask, expected


def shipped_model(name: str = "tiny-qwen3-moe") -> str:
    return os.path.join(REPO, "models", name)


def shared_data() -> str | None:
    """The benchmark data directory: EVALSUITE_DATA_DIR, or shared/data beside or inside the checkout."""
    candidates = (os.environ.get("EVALSUITE_DATA_DIR"), os.path.join(REPO, "..", "shared", "data"),
                  os.path.join(REPO, "shared", "data"))
    for candidate in candidates:
        if candidate and os.path.isfile(os.path.join(candidate, "gsm8k", "test.jsonl")):
            return os.path.abspath(candidate)
    return None


# An emulated link on the CPU is served without a thread (evalsuite.engine.link.lazy) when one expert is
# small, as every test model's is; the transfer worker serves it when the bound is 0.
LINK_KINDS = {"lazy-link": None, "worker": 0}


def use_link_kind(monkeypatch, kind: str) -> None:
    """Make engines built in this test serve an emulated link the `kind` way (LINK_KINDS)."""
    if LINK_KINDS[kind] is not None:
        import importlib

        monkeypatch.setattr(importlib.import_module("evalsuite.engine.placement.offloading"), "INLINE_MAX_BYTES", LINK_KINDS[kind])


def eval_request(**options) -> dict:
    """run_suite / check_eval keywords from flat options, as the CLI builds them: engine options into an
    EngineConfig (eval's defaults under them), run options into RunOptions, the rest as given."""
    import dataclasses

    from evalsuite.engine.config import EngineConfig
    from evalsuite.lm.run_options import EVAL_ENGINE, RunOptions

    engine = {f.name for f in dataclasses.fields(EngineConfig)} - {"predictor"}
    run = {f.name for f in dataclasses.fields(RunOptions)}
    out = {k: v for k, v in options.items() if k not in engine | run}
    out["engine"] = EVAL_ENGINE.replace(**{k: v for k, v in options.items() if k in engine})
    out["run"] = RunOptions(**{k: v for k, v in options.items() if k in run})
    return out
