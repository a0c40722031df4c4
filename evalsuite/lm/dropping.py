"""Batched greedy generation whose finished rows leave the batch.

lm-eval's `hf` generation runs a batch until its last row has met its stop sequence, every row computed
at every step. A speculative pass of the plan (evalsuite.lm.plan) generates its batch once per predictor
in one call, and the tiny models' speculative answers to GSM8k run to max_gen_toks now and then: most
of such a batch's steps compute rows that have long ended. Here the batch is generated in segments of
the model's own `generate`: a segment ends when a slot has ended (its row in every row group met its
batch-1 stop: end of sequence, or a stop sequence as lm-eval's criterion finds it), its rows leave the
key/value cache and the engine (`Engine.keep_rows`), and the next segment goes on from the cache with
the rest. Every row's tokens are its own: a row's computation never reads another's.

The result is shaped as `generate`'s: context, then the generated tokens, each row padded after its end
(lm-eval cuts a response at its stop sequence, so what followed it in a batch never reaches a score).
"""
from __future__ import annotations

import torch
from lm_eval.models.utils_hf import stop_sequences_criteria
from transformers import DynamicCache, StoppingCriteria


def eos_ids(model) -> set[int]:
    """The token ids that end a generation of `model` (its generation config's)."""
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def stop_windows(tokenizer, stop: list[str]) -> list[tuple[str, int]]:
    """(stop sequence, tokens its lm-eval criterion decodes after each token: `sequence_id_len`) per stop."""
    return [(c.sequence, c.sequence_id_len) for c in stop_sequences_criteria(tokenizer, stop, 0, 1)]


def batch_one_length(tokenizer, generated: list[int], stop: list[str], eos: set[int]) -> int:
    """How many of a generated row's tokens its batch-1 generation makes: up to the first end-of-sequence token
    or stop sequence. lm-eval's criterion decodes, after each token, the last `sequence_id_len` generated tokens
    and stops once the stop sequence is in them; the same windows are decoded here, every step's in one
    batch_decode call (RowEnds finds the same ends as the tokens come)."""
    length = next((n for n, token in enumerate(generated, 1) if token in eos), len(generated))
    for sequence, window in stop_windows(tokenizer, stop):
        texts = tokenizer.batch_decode([generated[max(0, n - window):n] for n in range(1, length)])
        length = next((n for n, text in enumerate(texts, 1) if sequence in text), length)
    return length


class RowEnds:
    """Where each row's batch-1 generation ends, found as its tokens come (batch_one_length's rule): the first
    end-of-sequence token, or the first step at which a stop sequence is in the decoded window lm-eval's
    criterion reads (its last `sequence_id_len` tokens)."""

    def __init__(self, tokenizer, stop: list[str], eos: set[int], rows: int):
        self.tokenizer, self.eos = tokenizer, eos
        self.stops = stop_windows(tokenizer, stop)
        self.length: list[int | None] = [None] * rows  # generated tokens up to and with the end (None: going on)

    def update(self, rows: list[int], generated: torch.Tensor) -> None:
        """`generated[i]`: every token row `rows[i]` has generated so far."""
        going = [i for i, row in enumerate(rows) if self.length[row] is None]
        n = generated.shape[1]
        if not going or n == 0:
            return
        for i in going:
            if int(generated[i, -1]) in self.eos:
                self.length[rows[i]] = n
        for sequence, window in self.stops:
            going = [i for i in going if self.length[rows[i]] is None]
            texts = self.tokenizer.batch_decode(generated[going, -window:].tolist()) if going else []
            for i, text in zip(going, texts):
                if sequence in text:
                    self.length[rows[i]] = n


class SlotEnded(StoppingCriteria):
    """Ends a `generate` segment when one more slot (a row position, in every row group) has ended."""

    def __init__(self, ends: RowEnds, rows: list[int], start: int, slots: int):
        self.ends, self.rows, self.start, self.slots = ends, rows, start, slots
        self.ended = self._ended()

    def _ended(self) -> int:
        return sum(self.slot_done(slot) for slot in {row % self.slots for row in self.rows})

    def slot_done(self, slot: int) -> bool:
        return all(self.ends.length[row] is not None for row in self.rows if row % self.slots == slot)

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.ends.update(self.rows, input_ids[:, self.start:])
        done = self._ended() > self.ended
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def plain_cache(model) -> bool:
    """Whether the model's key/value cache is plain full attention (rows can be taken out of it as they end)."""
    return all(type(layer).__name__ == "DynamicLayer" for layer in DynamicCache(config=model.config).layers)


def generate_dropping_ended(model, engine, tokenizer, context: torch.Tensor, attention_mask: torch.Tensor,
                            max_length: int, stop: list[str], groups: int, pad: int, **generation_kwargs):
    """Greedy `model.generate(context, ...)` up to `max_length` tokens, each row cut at its batch-1 end and the
    ended slots (rows `s, s + R/groups, ...`) taken out of the batch between segments (see the module doc):
    (the tokens, each row's generated length up to and with its end)."""
    rows, start = context.shape
    slots = rows // groups
    ends = RowEnds(tokenizer, stop, eos_ids(model), rows)
    out = torch.full((rows, max_length), pad, dtype=context.dtype, device=context.device)
    out[:, :start] = context
    alive, ids, mask, cache = list(range(rows)), context, attention_mask, None
    while True:
        ended = SlotEnded(ends, alive, start, slots)
        result = model.generate(input_ids=ids, attention_mask=mask, max_length=max_length, stopping_criteria=[ended],
                                pad_token_id=pad, use_cache=True, return_dict_in_generate=True, cache=cache,
                                **generation_kwargs)
        ids, cache = result.sequences, result.cache
        out[alive, :ids.shape[1]] = ids
        keep = [i for i, row in enumerate(alive) if not ended.slot_done(row % slots)]
        if not keep or ids.shape[1] >= max_length:
            break
        index = torch.tensor(keep, device=ids.device)
        cache.batch_select_indices(index)
        engine.keep_rows(keep)
        alive, ids = [alive[i] for i in keep], ids[index]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], ids.shape[1] - mask.shape[1])], dim=1)[index]
    lengths = [max_length - start if n is None else n for n in ends.length]
    for row, length in enumerate(lengths):  # after its end a row holds padding, as generate pads an ended row
        out[row, start + length:] = pad
    return out[:, :start + max(lengths)], lengths
