"""Train the tiny vision-language MoE (Qwen3-VL-MoE architecture) on rendered images.

    evalsuite train-tiny --model vl --out models --seed 0

Each step draws a fresh batch of images (evalsuite.taskgen.vision) as a pure function of
(seed, step), so a resumed run sees the data an uninterrupted one would; held-out images
are never drawn. The loop, schedule, loss weighting and checkpoints are shared with the text
models' trainer (evalsuite.zoo.loop).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForImageTextToText

from evalsuite.taskgen.corpus import heldout_vision_keys, vision_training_items
from evalsuite.taskgen.vision import SIZE
from evalsuite.zoo.configs import BALANCE_LOSS_COEF, MODEL_NAMES, vl_config
from evalsuite.zoo.loop import IGNORE, per_example_loss, save_model, train_loop, write_summary
from evalsuite.zoo.vl_processor import build_processor


def encode_batch(processor, items: list[dict]) -> dict:
    """Model inputs plus `labels` and per-token `weights`: loss on the completion and end token only."""
    tokenizer = processor.tokenizer
    prompts = [item["prompt"].replace("<image>", processor.image_token) for item in items]
    enc = processor(images=[[item["image"]] for item in items], text=prompts, padding="longest", return_tensors="pt")
    rows = []
    for row, item in enumerate(items):
        prompt = enc["input_ids"][row][enc["attention_mask"][row].bool()].tolist()
        completion = tokenizer(item["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, completion))
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    weights = torch.zeros(ids.shape)
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(rows):  # right-padded: prompt, completion, padding
        end = len(prompt) + len(completion)
        ids[row, :end] = torch.tensor(prompt + completion)
        labels[row, len(prompt):end] = torch.tensor(completion)
        weights[row, len(prompt):end] = 1 / len(completion)
        mask[row, :end] = 1
    return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == processor.image_token_id).long(),
            "pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"],
            "labels": labels, "weights": weights}


@torch.no_grad()
def validation_accuracy(model, processor, seed: int, exclude: set, size: int = 100) -> dict[str, float]:
    """Greedy answers on fresh (non-held-out) items, per question kind: a progress signal only."""
    model.eval()
    hits, totals = defaultdict(int), defaultdict(int)
    for item in vision_training_items(seed + 1_000_003, 0, size, exclude):
        text = item["prompt"].replace("<image>", processor.image_token)
        inputs = processor(images=[[item["image"]]], text=[text], return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        answer = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        hits[item["kind"]] += answer.strip() == item["answer"]
        totals[item["kind"]] += 1
    model.train()
    scores = {kind: round(hits[kind] / totals[kind], 3) for kind in sorted(totals)}
    scores["all"] = round(sum(hits.values()) / size, 3)
    return scores


def train_vl(args) -> None:
    name = MODEL_NAMES["vl"]
    torch.manual_seed(args.seed)
    processor = build_processor(SIZE)
    tokenizer = processor.tokenizer
    vision_ids = {kind: getattr(processor, f"{kind}_token_id") for kind in ("image", "video", "vision_start", "vision_end")}
    config = vl_config(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, vision_ids)
    model = AutoModelForImageTextToText.from_config(config, experts_implementation="grouped_mm")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))

    print(f"[{name}] {sum(p.numel() for p in model.parameters()):,} parameters")
    exclude = heldout_vision_keys()

    def step_loss(step: int):
        batch = encode_batch(processor, vision_training_items(args.seed, step, args.batch, exclude))
        labels, weights = batch.pop("labels"), batch.pop("weights")
        out = model(**batch, output_router_logits=True)  # Qwen3-VL-MoE adds its balancing loss as aux_loss
        return per_example_loss(out.logits, labels, weights) + BALANCE_LOSS_COEF * out.aux_loss, {}

    def after_step(step: int):
        if args.validate_every and step % args.validate_every == 0:
            tqdm.write(f"[{name}] step {step}: validation {validation_accuracy(model, processor, args.seed, exclude, 40)}")

    step, elapsed, last_loss = train_loop(name, model, optimizer, args, step_loss, after_step)

    out_dir = Path(args.out) / name
    save_model(model, tokenizer, processor, out_dir)
    val = validation_accuracy(model, processor, args.seed, exclude) if args.validate else {}
    write_summary(out_dir, name, {"seed": args.seed, "steps": step, "minutes": round(elapsed / 60, 2),
                                  "batch_items": args.batch, "peak_lr": args.lr, "final_loss": round(last_loss, 4),
                                  "validation_accuracy": val})

