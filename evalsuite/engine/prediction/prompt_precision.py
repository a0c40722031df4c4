"""What a prompt's rows say of a predictor's precision, before the first decode token.

A prefill predicts every sparse layer from the layer before for all of its rows at once, and the router
then routes each row: each row is one prediction scored, as a decode step's would be. A fresh engine's
scheduler has nothing else to go on at its first decode tokens (its priors of a half can send guesses that
are right about a missing expert far less often), so it counts the
prompt's rows as a few decode predictions (PrefetchScheduler.learn_prompt). The first sparse layer is
predicted from each row's last, for the row after it, as a decode token predicts the next token's.

What the send rule weighs is the precision over candidates missing from the cache (pm), which a prompt
cannot show directly: a row's candidate counts as missing where none of the few rows before it used it, as
many rows as the layer's share of the cache holds (its slots over top-k: an LRU cache of s slots a layer
holds at least the last s/k tokens' experts of that layer). So each row keeps, per rank of its candidates,
how many rows back the candidate was last used, and the share is read for any cache (`PromptRows.outcomes`):
the simulator replays a trace's prompts at other capacities.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

PROMPT_ROWS = 64  # each sequence's last rows kept (a long prompt's earlier rows would only cost time)


@dataclass
class PromptOutcomes:
    """Per rank of a prediction's candidates, over the rows scored: how many the router picked, how many were
    missing and of those how many it picked; `rows` scored."""
    rows: int
    picked: list[int]
    missing: list[int]
    missing_picked: list[int]

    def __add__(self, other: PromptOutcomes) -> PromptOutcomes:
        return PromptOutcomes(self.rows + other.rows, *([a + b for a, b in zip(mine, theirs)] for mine, theirs in (
            (self.picked, other.picked), (self.missing, other.missing), (self.missing_picked, other.missing_picked))))


@dataclass
class PromptRows:
    """One sparse layer's predictions over a prefill's rows, scored: per row its position in its sequence, and
    per rank of its candidates whether the router picked it and how many rows back that candidate was last used
    in the sequence (0: by no row before)."""
    position: list[int]
    picked: list[list[bool]]
    last_used: list[list[int]]

    def outcomes(self, held: int) -> PromptOutcomes | None:
        """The counts where a layer's share of the cache holds `held` rows' experts: rows with fewer rows before
        them are not scored (what the cache held there is unknown); None where no row is."""
        rows = [i for i, position in enumerate(self.position) if position >= held]
        if not rows:
            return None
        ranks = len(self.picked[0])
        picked, missing, missing_picked = [0] * ranks, [0] * ranks, [0] * ranks
        for i in rows:
            for rank, (hit, back) in enumerate(zip(self.picked[i], self.last_used[i])):
                gone = back == 0 or back > held
                picked[rank] += hit
                missing[rank] += gone
                missing_picked[rank] += gone and hit
        return PromptOutcomes(len(rows), picked, missing, missing_picked)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> PromptRows:
        return cls([int(p) for p in data["position"]], [[bool(h) for h in row] for row in data["picked"]],
                   [[int(b) for b in row] for row in data["last_used"]])


def prompt_rows(scores: torch.Tensor, ids: torch.Tensor, budget: int, sequences: int = 1,
                real: torch.Tensor | None = None, shifted: bool = False) -> PromptRows | None:
    """Score per-row predictions `scores` [rows, E] against the router's `ids` [rows, top-k] of the same rows, or
    with `shifted` of the row after each (the first sparse layer's prediction, made at the last): `sequences`
    sequences of equal length, one after another, of which `real` ([sequences, length] bool, None: all) marks the
    sequences' own tokens (padding is left out). None where no row is left."""
    experts = scores.shape[-1]
    budget = min(budget, experts)
    scores, ids = scores.reshape(sequences, -1, experts), ids.reshape(sequences, -1, ids.shape[-1]).to(scores.device)
    if shifted:
        scores, ids = scores[:, :-1], ids[:, 1:]
        real = None if real is None else real[:, :-1] & real[:, 1:]
    position, picked, last_used = [], [], []
    for s in range(sequences):
        mine = slice(None) if real is None else real[s].to(scores.device)
        own_scores, own_ids = scores[s][mine], ids[s][mine]
        length = own_ids.shape[0]
        if length == 0:
            continue
        # read once to the host and walked in Python: a few hundred list operations for a prompt's rows, where
        # the same in tensor calls (a cumulative max over a rows × experts table) takes 20-odd calls at each
        # sparse layer of a prefill, which TTFT pays
        start = max(0, length - PROMPT_ROWS)
        routed, ranked = own_ids.tolist(), own_scores[start:].topk(budget, dim=-1).indices.tolist()
        last: dict[int, int] = {}  # expert -> the last row that used it, of the rows walked so far
        for i, used in enumerate(routed):
            if i >= start:
                candidates = ranked[i - start]
                position.append(i)
                picked.append([e in used for e in candidates])
                last_used.append([i - last[e] if e in last else 0 for e in candidates])
            for e in used:
                last[e] = i
    return PromptRows(position, picked, last_used) if position else None


def forward_rows(forward, scores: torch.Tensor, ids: torch.Tensor, budget: int,
                 shifted: bool = False) -> PromptRows | None:
    """prompt_rows of a prefill (`forward`: its evalsuite.engine.pass_state.forward_pass.ForwardPass): one sequence a batch row, their
    padding left out."""
    mask, real = forward.attention_mask, None
    if mask is not None and not bool(mask.all()):
        real = mask[:, -(ids.shape[0] // forward.rows):].bool()
    return prompt_rows(scores, ids, budget, forward.rows, real, shifted)
