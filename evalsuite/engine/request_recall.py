"""Recall@k of a request's decode predictions, scored once, when the request ends (PredictionDriver.end_request):
scoring every step on the decode path would cost each step tensor calls the engine does not otherwise need.

A request's rows are its samples: each row's recall per layer is averaged over its own decode steps, by token
kind too. Predictions put off to the request's end (put_off.Later, put_off.QuietToken) are made here.
"""
from __future__ import annotations

from typing import Callable

import torch

from .metrics import token_recall
from .put_off import Later, QuietToken


def score_request(record, steps: dict, pos_of: dict, recall_ks, learn: Callable | None = None) -> None:
    """Add the request's recall@k to `record` (the engine's metrics.Record): `steps` holds per decoder layer its
    decode steps in order, each (prediction, native ids, rows, token kinds) or the QuietToken it was part of;
    `pos_of` maps a decoder layer to its sparse position. `learn(layer, scores, native ids, resident)` is told of
    each prediction made here (the scheduler's precision; `resident`: the layer's experts the cache held when it
    was put off, Later.resident)."""
    for k in recall_ks:
        record.recall.setdefault(k, {})
    for layer, layer_steps in steps.items():
        made, kinds_of, pos = [], [], pos_of[layer]  # (scores, native ids, rows), and token kinds, per step
        for step in layer_steps:
            if type(step) is QuietToken:  # (its layers after a forward pass cut short have nothing)
                if not step.ran(pos):
                    continue
                predicted, native, rows, kinds = step.prediction_for(pos), step.ids(pos), None, step.kinds
            else:
                predicted, native, rows, kinds = step
            scores = predicted.scores() if isinstance(predicted, Later) else predicted[0]
            if scores is None:
                continue  # the predictor had nothing for this step
            if isinstance(predicted, Later) and learn is not None:
                learn(layer, scores, native, predicted.resident)
            made.append((scores, native, rows))
            kinds_of.append(kinds)
        if not made:
            continue
        if any(rows is not None for _, _, rows in made):  # rows left the batch (PredictionDriver.keep_rows)
            total = record.requests[-1].rows
            for k in recall_ks:
                record.add_recall(k, layer, recall_per_row(made, k, total))
                for (scores, native, _), kinds in zip(made, kinds_of):
                    if kinds is not None:
                        kinds.count_recall(record.kinds, k, layer, token_recall(scores, native, k))
            continue
        predicted = torch.stack([p for p, _, _ in made])  # [steps, rows, experts]
        native = torch.stack([n.to(predicted.device) for _, n, _ in made])  # [steps, rows, top-k]
        flat_p, flat_n = predicted.flatten(0, 1), native.flatten(0, 1)
        for k in recall_ks:
            per_token = token_recall(flat_p, flat_n, k).view(predicted.shape[:2])  # [steps, rows]
            record.add_recall(k, layer, per_token.mean(dim=0).tolist())
            for step, kinds in enumerate(kinds_of):  # by kind, from the same per-token recall
                if kinds is not None:
                    kinds.count_recall(record.kinds, k, layer, per_token[step])


def recall_per_row(made: list, k: int, total: int, counted=None) -> list[float]:
    """Recall@k per row of a request of `total` rows that left the batch one by one (keep_rows), each averaged
    over its own steps: `made` holds per step (scores [rows then, E], native ids [rows then, K], the request's
    rows then, None: all); `counted(steps, rows)`: which (step, row) pairs count, element by element (default:
    all). A row no step counts for has no recall (NaN, which the summaries leave out). Every step is scored in
    one call; each row's sum still adds its steps in order."""
    rows = [torch.arange(scores.shape[0]) if r is None else r for scores, _, r in made]
    scores = torch.cat([s for s, _, _ in made])
    native = torch.cat([n.to(scores.device) for _, n, _ in made])
    recall = token_recall(scores, native, k).double().cpu()
    row = torch.cat(rows)
    if counted is not None:
        steps = torch.repeat_interleave(torch.arange(len(made)), torch.tensor([len(r) for r in rows]))
        keep = counted(steps, row)
        row, recall = row[keep], recall[keep]
    sums = torch.zeros(total, dtype=torch.float64).index_add_(0, row, recall)
    counts = torch.zeros(total, dtype=torch.float64).index_add_(0, row, torch.ones_like(recall))
    return (sums / counts).tolist()  # 0 / 0: NaN
