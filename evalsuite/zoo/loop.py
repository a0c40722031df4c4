"""The training loop both tiny-model trainers share (text: evalsuite.zoo.train, vision-language:
evalsuite.zoo.train_vl): loss weighting, learning-rate schedule, optimizer steps, resumable
checkpoints, and saving the model. Kept apart from either trainer so neither imports the other.

The learning-rate schedule follows whichever runs out first, the step budget or the wall-clock
budget, so a slow machine still ends on a decayed learning rate.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig

IGNORE = -100  # the label of a token that carries no loss


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over examples of each example's mean next-token cross-entropy."""
    targets, w = labels[:, 1:], weights[:, 1:]
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return (ce * w.flatten()).sum() / w.sum()


def restore(ckpt_path: Path, model, optimizer, name: str) -> tuple[int, float]:
    """Continue from a checkpoint: (step, elapsed seconds), or (0, 0.0) without one."""
    if not ckpt_path.exists():
        return 0, 0.0
    state = torch.load(ckpt_path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    print(f"[{name}] resumed at step {state['step']} ({state['elapsed'] / 60:.1f} min)")
    return state["step"], state["elapsed"]


def checkpoint(ckpt_path: Path, model, optimizer, step: int, elapsed: float) -> None:
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed, "torch_rng": torch.get_rng_state()}, ckpt_path)


def optimizer_step(model, optimizer, loss: torch.Tensor) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_loop(name: str, model, optimizer, args, step_loss, after_step=None) -> tuple[int, float, float]:
    """The loop both trainers share: learning-rate schedule, optimizer steps, progress bar and
    resumable checkpoints. `step_loss(step)` returns the step's loss and extra progress fields;
    `after_step(step)` runs after each step. Returns (steps, elapsed seconds, last loss)."""
    ckpt_path = Path(args.checkpoints) / name / "last.pt"
    step, elapsed = restore(ckpt_path, model, optimizer, name) if args.resume else (0, 0.0)
    budget = args.minutes * 60
    started, last_save = time.time() - elapsed, time.time()
    bar = tqdm(total=args.steps, initial=step, desc=name, mininterval=5)
    progress = max(step / args.steps, elapsed / budget)
    last_loss = float("nan")  # stays NaN when resuming an already finished run
    while progress < 1.0:
        lr = learning_rate(progress, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, shown = step_loss(step)
        optimizer_step(model, optimizer, loss)
        step += 1
        last_loss = loss.item()
        elapsed = time.time() - started
        progress = max(step / args.steps, elapsed / budget)
        bar.update(1)
        bar.set_postfix(loss=f"{last_loss:.3f}", **shown, lr=f"{lr:.1e}", min=f"{elapsed / 60:.1f}")
        if after_step is not None:
            after_step(step)
        if time.time() - last_save > args.save_every_min * 60 or progress >= 1.0:
            checkpoint(ckpt_path, model, optimizer, step, elapsed)
            last_save = time.time()
    bar.close()
    return step, elapsed, last_loss


def save_model(model, tokenizer, preprocessor, out_dir: Path) -> None:
    """Weights, greedy generation defaults, and the tokenizer (or processor) that feeds the model."""
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    preprocessor.save_pretrained(out_dir)


def write_summary(out_dir: Path, name: str, summary: dict) -> None:
    (out_dir / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[{name}] saved to {out_dir}: {summary}")


def learning_rate(progress: float, peak: float, warmup: float = 0.03) -> float:
    if progress < warmup:
        return peak * progress / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup)))))
