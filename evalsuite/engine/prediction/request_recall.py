"""Recall@k of a request's decode predictions, scored once, when the request ends (PredictionDriver.end_request):
scoring every step on the decode path would cost each step tensor calls the engine does not otherwise need.

A request's rows are its samples: each row's recall@k and exact@K per target layer are averaged over its own
decode steps, by token kind too; the prediction for the next token's first sparse layer is scored apart, as
recall_next_token@K (definitions: evalsuite.engine.metrics). Predictions put off to the request's end
(put_off.PutOffPrediction, put_off.PutOffToken) are made here.
"""
from __future__ import annotations

from typing import Callable

import torch

from evalsuite.engine.metrics import EXACT, NEXT_TOKEN, RECALL, exact_of_recall, token_recall
from evalsuite.engine.prediction.put_off import PutOffPrediction, PutOffToken


def scored_as(recall_ks, top_k: int, cross_token: bool) -> list[tuple[str, int]]:
    """(metric, k) a target layer's predictions are scored by: recall@k and exact@K within a token; the next token's
    first sparse layer (`cross_token`) recall_next_token@K alone."""
    if cross_token:
        return [(NEXT_TOKEN, top_k)]
    return [*((RECALL, k) for k in recall_ks), (EXACT, top_k)]


def per_token_scores(scores: torch.Tensor, native: torch.Tensor, wanted) -> dict[tuple[str, int], torch.Tensor]:
    """Per token (rows of `scores` [N, E] against the router's `native` ids [N, K]), each (metric, k) of `wanted`,
    as float64 on the CPU."""
    at: dict[int, torch.Tensor] = {}
    out = {}
    for metric, k in wanted:
        if k not in at:
            at[k] = token_recall(scores, native, k).double().cpu()
        out[(metric, k)] = exact_of_recall(at[k]) if metric == EXACT else at[k]
    return out


def row_means(values: torch.Tensor, row: torch.Tensor, total: int, keep: torch.Tensor | None = None) -> list[float]:
    """The mean of per-token `values` of each of `total` rows (`row`: which row each token is; `keep`: which tokens
    count, default all), adding each row's tokens in order; a row with none is NaN (which the summaries leave
    out)."""
    if keep is not None:
        values, row = values[keep], row[keep]
    sums = torch.zeros(total, dtype=torch.float64).index_add_(0, row, values)
    counts = torch.zeros(total, dtype=torch.float64).index_add_(0, row, torch.ones_like(values))
    return (sums / counts).tolist()  # 0 / 0: NaN


def step_rows(made: list) -> torch.Tensor:
    """Which of the request's rows each scored token is, over `made`'s steps (scores, native ids, the request's
    rows in the batch then, None: all), in order."""
    return torch.cat([torch.arange(scores.shape[0]) if rows is None else rows.cpu() for scores, _, rows in made])


def score_request(record, steps: dict, pos_of: dict, recall_ks, top_k: int, next_token_layer: int | None = None,
                  learn: Callable | None = None) -> None:
    """Add the request's scores to `record` (the engine's metrics.EngineRecord): `steps` holds per decoder layer its
    decode steps in order, each (prediction, native ids, rows, token kinds) or the PutOffToken it was part of;
    `pos_of` maps a decoder layer to its sparse position; `next_token_layer`: the decoder layer whose predictions
    are made at the previous token's last sparse layer (scored as recall_next_token@K, `top_k` = K), the others
    being within-token targets. `learn(layer, scores, native ids, resident)` is told of each prediction made here
    (the scheduler's precision; `resident`: the layer's experts the cache held when it was put off,
    PutOffPrediction.resident)."""
    total = record.requests[-1].rows if record.requests else None
    per_row: dict = {}  # metric -> k -> layer -> per row
    by_kind: dict = {}  # kind -> metric -> k -> layer -> per row
    for layer, layer_steps in steps.items():
        made, kinds_of, pos = [], [], pos_of[layer]  # (scores, native ids, rows), and token kinds, per step
        for step in layer_steps:
            if type(step) is PutOffToken:  # (its layers after a forward pass cut short have nothing)
                if not step.ran(pos):
                    continue
                predicted, native, rows, kinds = step.prediction_for(pos), step.ids(pos), None, step.kinds
            else:
                predicted, native, rows, kinds = step
            scores = predicted.scores() if isinstance(predicted, PutOffPrediction) else predicted[0]
            if scores is None:
                continue  # the predictor had nothing for this step
            if isinstance(predicted, PutOffPrediction) and learn is not None:
                learn(layer, scores, native, predicted.resident)
            made.append((scores, native, rows))
            kinds_of.append(kinds)
        if not made:
            continue
        rows = total if total is not None else made[0][0].shape[0]
        cross_token = layer == next_token_layer
        scores = torch.cat([s for s, _, _ in made])
        native = torch.cat([n.to(scores.device) for _, n, _ in made])
        row = step_rows(made)
        masks = {} if cross_token else kind_masks(made, kinds_of)  # by kind: within-token decode tokens only
        for (metric, k), values in per_token_scores(scores, native, scored_as(recall_ks, top_k, cross_token)).items():
            per_row.setdefault(metric, {}).setdefault(k, {})[layer] = row_means(values, row, rows)
            for kind, mask in masks.items():
                if mask.any():
                    by_kind.setdefault(kind, {}).setdefault(metric, {}).setdefault(k, {})[layer] = \
                        row_means(values, row, rows, mask)
    record.add_scores(per_row)
    for kind, scores in by_kind.items():
        record.kinds.add_scores(kind, scores)


def kind_masks(made: list, kinds_of: list) -> dict[str, torch.Tensor]:
    """Per token kind, which of the scored tokens of `made` (concatenated over its steps) hold it; {} where no step
    knows its kinds (a text-only model)."""
    if all(kinds is None for kinds in kinds_of):
        return {}
    per_step = []
    for (scores, _, _), kinds in zip(made, kinds_of):
        masks = kinds.masks(scores.shape[0]) if kinds is not None else {}
        per_step.append({kind: mask.flatten().cpu() for kind, mask in masks.items()})
    names = sorted({kind for masks in per_step for kind in masks})
    return {kind: torch.cat([masks.get(kind, torch.zeros(scores.shape[0], dtype=torch.bool))
                             for masks, (scores, _, _) in zip(per_step, made)]) for kind in names}


def recall_per_row(made: list, k: int, total: int, counted=None) -> list[float]:
    """Recall@k per row of a request of `total` rows that left the batch one by one (keep_rows), each averaged
    over its own steps: `made` holds per step (scores [rows then, E], native ids [rows then, K], the request's
    rows then, None: all); `counted(steps, rows)`: which (step, row) pairs count, element by element (default:
    all). A row no step counts for has no recall (NaN, which the summaries leave out). Every step is scored in
    one call; each row's sum still adds its steps in order."""
    scores = torch.cat([s for s, _, _ in made])
    native = torch.cat([n.to(scores.device) for _, n, _ in made])
    recall = token_recall(scores, native, k).double().cpu()
    row = step_rows(made)
    keep = None
    if counted is not None:
        steps = torch.repeat_interleave(torch.arange(len(made)), torch.tensor([s.shape[0] for s, _, _ in made]))
        keep = counted(steps, row)
    return row_means(recall, row, total, keep)
