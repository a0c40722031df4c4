"""The bench's models and their decoding: random-weight real shapes from a checkpoint, greedy
decoding teacher-forced on a reference, and the model made whole for the runs that need it."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..engine.arch import sparse_layers
from ..timing import frozen_heap


def load_bench_model(spec: str, layers: int, device: str, workdir: str | None = None, prompt_tokens: int = 16):
    """A shipped model directory, `tiny:<type>`, or a real model's name (random weights, real shapes).

    A real model's shape is written to a checkpoint under `workdir` and loaded without its experts
    (evalsuite.engine.load_skeleton): every engine then reads them from there, as one would offload
    a model larger than memory, so the bench holds one copy of the experts at a time (8 sparse
    layers of Qwen3-30B-A3B are 9.6 GB) and never moves the whole model to the device."""
    from ..engine import load_skeleton
    from ..generate import load_model
    from .shapes import MODELS, random_model

    if spec in MODELS:
        path = str(Path(workdir or ".") / "checkpoint")
        random_model(spec, layers).save_pretrained(path)
        model = load_skeleton(path, torch.bfloat16, device)
        return model, random_prompt(model, prompt_tokens).to(device), None
    model, tokenizer = load_model(spec, device=device)
    if tokenizer is None:
        ids = random_prompt(model, prompt_tokens)
    else:
        from ..taskgen.corpus import heldout_items

        ids = torch.tensor([tokenizer(heldout_items("arith")[0]["prompt"])["input_ids"]])
    return model, ids.to(device), tokenizer


def random_prompt(model, tokens: int, seed: int = 0) -> torch.Tensor:
    """[1, tokens] random token ids (seeded) for a model without a tokenizer; a vision-language model's
    vocabulary is its text config's."""
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(3, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))


def serve_earlier(engine, model, prompt: torch.Tensor, tokens: int) -> None:
    """Make `engine` a warm one (`evalsuite bench --warm`): it serves `prompt` greedily, then empties its cache
    and its stats; what its scheduler learned of the predictor's precision stays (Engine.clear_cache)."""
    greedy(model, prompt, tokens)
    engine.clear_cache()
    engine.reset_stats()


def other_prompt(model, tokenizer, like: torch.Tensor) -> torch.Tensor:
    """A prompt other than load_bench_model's, on the same device: the next task item, or random ids of the same
    length (a warm engine's earlier request, `evalsuite bench --warm`)."""
    if tokenizer is None:
        return random_prompt(model, like.shape[1], seed=1).to(like.device)
    from ..taskgen.corpus import heldout_items

    return torch.tensor([tokenizer(heldout_items("arith")[1]["prompt"])["input_ids"]]).to(like.device)


def greedy(model, ids, tokens, forced: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy decoding of `tokens` new tokens, batch 1: the prompt and each step's greedy token.
    With `forced` (a reference's output, prompt included) each step feeds the reference's token
    instead of its own: the work is the reference's, the returned tokens are this model's. Timed as the suite
    times (evalsuite.timing.frozen_heap)."""
    from transformers import DynamicCache

    cache, steps = DynamicCache(config=model.config), [ids]
    with torch.no_grad(), frozen_heap():
        feed = ids
        for i in range(tokens):
            logits = model(input_ids=feed, cache=cache, use_cache=True).logits
            steps.append(logits[:, -1].argmax(dim=-1, keepdim=True))
            at = ids.shape[1] + i
            feed = steps[-1] if forced is None else forced[:, at:at + 1]
    out = torch.cat(steps, dim=1)
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    return out


def bench_store(model) -> str:
    """The store the bench's engines offload to: a model built without its experts reads them from its
    checkpoint when fetched ("disk"); a host store would first read every one into memory (9.6 GB for 8
    sparse layers of Qwen3-30B-A3B, ~15 s an engine, beside the page cache's copy). A whole model: "host"."""
    return "disk" if unloaded(model) else "host"


def unloaded(model) -> bool:
    from ..engine.placement import experts_unloaded
    from ..engine.placement.store import ExpertLayout

    layers = sparse_layers(model)
    return experts_unloaded(layers, ExpertLayout.of(layers[0].experts))


@contextlib.contextmanager
def whole(model):
    """The model with every expert in place for the runs that need the unmodified model: a model
    built without its experts reads them from its checkpoint, and drops them again afterwards."""
    if not unloaded(model):
        yield model
        return
    from ..engine.arch import family_of
    from ..engine.placement import drop_experts, home_device, load_experts
    from ..engine.placement.store import Checkpoint, ExpertLayout

    layers = sparse_layers(model)
    layout = ExpertLayout.of(layers[0].experts)
    load_experts(layers, layout, family_of(model), Checkpoint(model.config._name_or_path, layout.dtype),
                 home_device(model, layers, layout))
    try:
        yield model
    finally:
        drop_experts(layers, layout)
