"""Greedy generation under several execution modes, side by side (`evalsuite generate`).

Each mode runs on a fresh copy of the model, so modes never share cache state; tokens are
compared with the resident run, which is the reference: it runs first, and runs even when it is
not among the modes asked for (its row then says so), wherever it fits. A model loaded without its
experts (`--store disk`) whose experts would not fit the memory free on its device (`resident_shortfall`)
runs its modes without it: nothing is then compared, and the table says why in one line.
"""
from __future__ import annotations

import copy
import os

import torch
from tqdm import tqdm

from .engine import EngineConfig, offload
from .engine.metrics import token_divergence
from .engine.modes import REFERENCE, mode_named
from .table import Column
from .table import format_table as _format_table

MEMORY_ENV = "EVALSUITE_AVAILABLE_MEMORY"  # memory `generate` takes as free on the device ("2GiB"; default: measured)
RESERVE = 0.1  # of the free memory, kept for activations and the allocator (as the expert cache's check)
DEMO_PROMPTS = ("Natalia sold clips to 48 of her friends in April,", "def add(a, b):", "Is a whale a fish?")


def load_model(spec: str, dtype: str = "float32", device: str = "cpu", store: str = "host"):
    """A model and its tokenizer: a directory/hub id, or `tiny:<model_type>` (random weights).
    With store='disk' a directory is loaded without its experts (evalsuite.engine.load_skeleton):
    the engine reads them from the checkpoint, so the model need not fit in memory."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if spec.startswith("tiny:"):
        from .zoo.tiny import TINY, tiny_model

        model_type = spec.split(":", 1)[1]
        if model_type not in TINY:
            raise ValueError(f"unknown tiny model {model_type!r}: use one of {', '.join(TINY)}")
        return tiny_model(model_type, dtype=torch_dtype).to(device), None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from .zoo.tiny import VISION_LANGUAGE

    # a vision-language model loads as one (its text runs without images), not as a causal LM, which refuses it
    vision = AutoConfig.from_pretrained(spec).model_type in VISION_LANGUAGE
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    if store == "disk" and os.path.isdir(spec):
        from .engine.placement.loading import load_skeleton

        return load_skeleton(spec, torch_dtype, device, auto), AutoTokenizer.from_pretrained(spec)
    model = auto.from_pretrained(spec, dtype=torch_dtype).to(device).eval()
    model.set_experts_implementation("eager")  # the kernel the engine reproduces bit for bit
    return model, AutoTokenizer.from_pretrained(spec)


def encode(prompts, tokenizer, vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask (random ids when there is no tokenizer)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(3, vocab_size, (8 + 3 * i,), generator=g) for i in range(len(prompts))]
    else:
        rows = [torch.tensor(tokenizer(p)["input_ids"]) for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids.to(device), mask.to(device)


def free_memory(device, available: int | str | None = None) -> int:
    """Bytes free on `device` for a resident copy of the model: `available` when given (bytes, or a size such as
    '2GiB'), else the environment's EVALSUITE_AVAILABLE_MEMORY, else what the device reports (MemAvailable on the
    CPU, free memory on a GPU: evalsuite.engine.cache.slots.free_bytes)."""
    if available is None:
        available = os.environ.get(MEMORY_ENV) or None
    from .engine.cache.slots import free_bytes, size_in_bytes

    if available is None:
        return free_bytes(torch.device(device))
    if isinstance(available, int) and not isinstance(available, bool):
        return available
    nbytes = size_in_bytes(str(available), bare_bytes=True)
    if nbytes is None:
        raise ValueError(f"{MEMORY_ENV}={available!r}: give a size such as 2GiB or 500MB, or bytes")
    return nbytes


def resident_shortfall(model, available: int | str | None = None) -> str | None:
    """None where a resident run of `model` fits, else why not, in one line. Only a model built without its
    experts (evalsuite.engine.load_skeleton) can fail to: resident reads every expert in, on a copy of the
    non-expert weights, and that must fit `free_memory` of the non-expert weights' device, less RESERVE."""
    from .engine import arch, placement
    from .engine.placement.store import ExpertLayout

    layers = arch.sparse_layers(model)
    layout = ExpertLayout.of(layers[0].experts)
    if not placement.experts_unloaded(layers, layout):
        return None  # its experts are in memory already: a copy of the model is what every mode runs on
    device = placement.home_device(model, layers, layout)
    experts = sum(p.nbytes for p in placement.expert_params(layers, layout))
    rest = sum(t.nbytes for t in placement.non_expert_tensors(model, layers, layout) if not t.is_meta)
    free = free_memory(device, available)
    if experts + rest <= free * (1 - RESERVE):
        return None
    return (f"its experts ({_size(experts)}) and a copy of the other weights ({_size(rest)}) do not fit the "
            f"{_size(free)} free on {device.type} less {RESERVE:.0%} ({MEMORY_ENV} sets that figure)")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


EVERY_MODE = ("expert_bits", "expert_group_size")  # resident too: the reference runs at the same bits


def mode_options(mode: str, engine_options: dict) -> dict:
    """The engine options mode `mode` runs with in compare_modes: for resident only EVERY_MODE's, no predictor where
    it predicts nothing."""
    kind = mode_named(mode)
    options = dict(engine_options) if kind.offloads else {
        name: value for name, value in engine_options.items() if name in EVERY_MODE}
    if not kind.predicts:  # an offloading mode that does not predict refuses a predictor
        options.pop("predictor", None), options.pop("predictor_path", None)
    return options


def check_modes(modes, **engine_options) -> None:
    """Every mode's engine configuration, checked before a model loads (a bad pairing is one line, not a failure
    after the first modes ran)."""
    for mode in modes:
        EngineConfig(mode=mode, **mode_options(mode, engine_options))


def compare_modes(model, tokenizer, modes, prompts=DEMO_PROMPTS, max_new_tokens=16, available_memory=None,
                  **engine_options):
    """Run every prompt (batch 1, greedy) under resident, then under each other mode; one result row per mode,
    resident's first (`requested` says whether it was among `modes`). Where resident does not fit
    (`resident_shortfall`, given `available_memory`: bytes or '2GiB', default measured) the other modes run
    alone, each row's `no_reference` saying why; resident among `modes` is then refused before anything runs."""
    rows, reference = [], None
    inputs = [encode([p], tokenizer, model.config.get_text_config().vocab_size, model.device) for p in prompts]
    offloading = [m for m in modes if m != REFERENCE]
    kinds = {mode: mode_named(mode) for mode in [REFERENCE] + offloading}  # an unknown mode fails before any run
    missing = resident_shortfall(model, available_memory)
    if missing and REFERENCE in modes:
        raise ValueError(f"--modes {REFERENCE} needs every expert in memory: {missing}; leave it out to run the "
                         "other modes without a reference")
    ordered = offloading if missing else [REFERENCE] + offloading
    check_modes(ordered, **engine_options)
    for mode in tqdm(ordered, desc="modes", disable=len(ordered) < 2):
        run = copy.deepcopy(model)
        with offload(run, mode=mode, **mode_options(mode, engine_options)) as engine, torch.no_grad():
            outputs = [run.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=0) for ids, mask in inputs]
            stats = engine.stats()
        same = None if reference is None else all(torch.equal(a, b) for a, b in zip(outputs, reference))
        divergence = None if reference is None else [
            token_divergence(o[0, i.shape[1]:].tolist(), r[0, i.shape[1]:].tolist())
            for o, r, (i, _) in zip(outputs, reference, inputs)]
        reference = outputs if mode == REFERENCE else reference
        rows.append({"mode": mode, "requested": mode in modes, "same_as_resident": same, "divergence": divergence,
                     **({"no_reference": missing} if missing else {}), **stats,
                     "text": [tokenizer.decode(o[0]) for o in outputs] if tokenizer is not None else None})
    return rows


def _headline_recall(stats: dict) -> float | None:
    """recall@K (K the router's top-k; evalsuite.engine.metrics) of an engine summary, None without predictions."""
    recall = stats.get("recall")
    if not recall:
        return None
    at = recall.get(stats.get("top_k")) or recall[min(recall)]
    return at["mean"] or 0


def format_table(rows) -> str:
    columns = ["mode", "predictor", "same", Column("recall", ".3f"), Column("uses", "d"), Column("hit rate", ".3f"),
               Column("MB moved", ".2f"), Column("stall ms", ".1f"), Column("TTFT ms", ".2f"), Column("TPOT ms", ".2f")]
    cells = [[r["mode"], r.get("predictor"), "ref" if r["mode"] == REFERENCE else
              {None: "-", True: "yes", False: "NO"}[r["same_as_resident"]],
              _headline_recall(r), r["expert_uses"],
              r["hit_rate"], r["bytes_transferred"] / 1e6, r["stall_s"] * 1e3, r["ttft_ms"]["median"],
              r["tpot_ms"]["median"]] for r in rows]
    lines = [_format_table(cells, columns)]
    if rows and not rows[0].get("requested", True):
        lines.append("(resident was not among --modes: it ran as the reference the others are compared with)")
    missing = next((r["no_reference"] for r in rows if r.get("no_reference")), None)
    if missing:
        lines.append(f"same -: resident did not run, so no tokens are compared: {missing}")
    return "\n".join(lines)
