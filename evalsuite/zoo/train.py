"""Train the tiny MoE models on the generated corpus.

    python -m evalsuite.zoo.train --model all --out models --seed 0

Batches are a pure function of (seed, step), so a run resumed from its
checkpoint (--resume) sees exactly the data it would have seen uninterrupted.
The loop, schedule and checkpoints are evalsuite.zoo.loop's, shared with the
vision-language trainer (evalsuite.zoo.train_vl).
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from evalsuite.taskgen.corpus import SKILLS, heldout_prompts, training_corpus, training_items
from evalsuite.zoo.balance import RouterRecorder, sigmoid_balance_loss
from evalsuite.zoo.configs import BALANCE_LOSS_COEF, CONFIG_BUILDERS, MODEL_NAMES
from evalsuite.zoo.loop import IGNORE, per_example_loss, save_model, train_loop, write_summary
from evalsuite.zoo.tokenizer import build_tokenizer

ROW_LEN = 256


def encode(tokenizer, item: dict) -> tuple[list[int], list[int]]:
    """Token ids and labels; only the completion and the end-of-sequence token carry loss."""
    prompt = tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
    completion = tokenizer(item["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + completion, [IGNORE] * len(prompt) + completion


def make_batch(encoded: list, seed: int, step: int, rows: int, pad_id: int):
    """Pack randomly drawn examples into `rows` rows of ROW_LEN tokens; deterministic in (seed, step).

    `weights` gives each loss-carrying token 1 / (its example's loss tokens), so
    every example weighs the same: a one-token yes/no decision counts as much
    as a whole worked solution.
    """
    rng = random.Random(f"{seed}:batch:{step}")
    ids = torch.full((rows, ROW_LEN), pad_id, dtype=torch.long)
    labels = torch.full((rows, ROW_LEN), IGNORE, dtype=torch.long)
    weights = torch.zeros((rows, ROW_LEN))
    mask = torch.zeros((rows, ROW_LEN), dtype=torch.long)
    for row in range(rows):
        pos = 0
        while True:
            x, y = encoded[rng.randrange(len(encoded))]
            if pos + len(x) > ROW_LEN:
                break
            label = torch.tensor(y)
            ids[row, pos:pos + len(x)] = torch.tensor(x)
            labels[row, pos:pos + len(x)] = label
            weights[row, pos:pos + len(x)] = (label != IGNORE) / (label != IGNORE).sum()
            mask[row, pos:pos + len(x)] = 1
            pos += len(x)
    return ids, labels, weights, mask


@torch.no_grad()
def validation_accuracy(model, tokenizer, seed: int, per_skill: int = 25) -> dict[str, float]:
    """Greedy exact-match of the whole completion on fresh non-held-out items (a progress signal only)."""
    model.eval()
    exclude = heldout_prompts()
    scores = {}
    for skill in SKILLS:
        items = training_items(skill, seed + 1_000_003, per_skill, exclude)
        hits = 0
        for item in items:
            ids = tokenizer(item["prompt"], return_tensors="pt", add_special_tokens=False)["input_ids"]
            out = model.generate(ids, max_new_tokens=len(item["completion"]) + 8, do_sample=False)
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            hits += text.strip() == item["completion"].strip()
        scores[skill] = hits / len(items)
    model.train()
    return scores


def train_one(kind: str, args) -> None:
    name = MODEL_NAMES[kind]
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    config = CONFIG_BUILDERS[kind](len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    recorder = RouterRecorder(model) if kind == "glm" else None

    print(f"[{name}] {sum(p.numel() for p in model.parameters()):,} parameters; building corpus")
    encoded = [encode(tokenizer, item) for item in training_corpus(args.seed, args.items_per_skill)]

    def step_loss(step: int):
        ids, labels, weights, mask = make_batch(encoded, args.seed, step, args.batch, tokenizer.pad_token_id)
        if kind == "qwen":  # Qwen3-MoE computes its own load-balancing loss from the router logits
            out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
            balance = out.aux_loss
        else:
            recorder.clear()
            out = model(input_ids=ids, attention_mask=mask)
            balance = sigmoid_balance_loss(recorder.logits, mask, config.num_experts_per_tok)
        loss = per_example_loss(out.logits, labels, weights) + BALANCE_LOSS_COEF * balance
        return loss, {"bal": f"{balance.item():.3f}"}

    step, elapsed, last_loss = train_loop(name, model, optimizer, args, step_loss)
    if recorder is not None:
        recorder.remove()

    out_dir = Path(args.out) / name
    save_model(model, tokenizer, tokenizer, out_dir)
    val = validation_accuracy(model, tokenizer, args.seed) if args.validate else {}
    write_summary(out_dir, name, {"seed": args.seed, "steps": step, "minutes": round(elapsed / 60, 2),
                                  "batch_rows": args.batch, "row_len": ROW_LEN, "peak_lr": args.lr,
                                  "final_loss": round(last_loss, 4), "validation_exact_match": val})


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="train-tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["qwen", "glm", "vl", "all"], default="all",
                        help="all = the two text models; vl = the vision-language model (evalsuite.zoo.train_vl)")
    parser.add_argument("--out", default="models", help="models are written to OUT/<name>/")
    parser.add_argument("--checkpoints", default="checkpoints", help="resumable state (git-ignored)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="default: 3400 (text), 4500 (vl)")
    parser.add_argument("--minutes", type=float, default=45.0,
                        help="wall-clock cap per model; on an idle core the step budget binds first")
    parser.add_argument("--batch", type=int, help="rows of %d tokens (text, default 16) or images (vl, default 32) "
                        "per step" % ROW_LEN)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--items-per-skill", type=int, default=40_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save-every-min", type=float, default=3.0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--no-validate", dest="validate", action="store_false")
    parser.add_argument("--validate-every", type=int, default=500, help="vl: steps between progress validations")
    args = parser.parse_args(argv)
    vl = args.model == "vl"
    args.steps = args.steps or (4500 if vl else 3400)
    args.batch = args.batch or (32 if vl else 16)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model == "vl":
        from evalsuite.zoo.train_vl import train_vl
        train_vl(args)
        return 0
    for kind in (["qwen", "glm"] if args.model == "all" else [args.model]):
        train_one(kind, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
