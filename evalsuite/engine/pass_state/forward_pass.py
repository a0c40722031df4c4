"""`ForwardPass`: what is known of the model's forward pass running now, the one per-pass state the
engine's hooks read.

The engine makes a new one each time the model is called (`Engine._before_forward`) and holds it
as `engine.forward` until the next call; the oracle's look-ahead pass runs with its own copy
(`looking_ahead=True`) and the engine puts the real one back after it. The hooks that read it:
the prediction driver (from the experts implementation, or a router hook in speculating modes), the
shadow predictors (router hooks), the trace recorder, the expert implementation's counting by token
kind, and the perf probes (evalsuite.perf.costs).
Everything else the engine keeps (cache, record, pending predictions) spans forward passes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from evalsuite.engine.pass_state.token_kinds import TokenKinds


@dataclass(frozen=True)
class ForwardPass:
    decoding: bool  # a decode step (the attention's key/value cache already holds tokens), not a prefill
    rows: int  # batch rows
    attention_mask: torch.Tensor | None = None  # [rows, tokens so far], as the model was given it
    kinds: TokenKinds | None = None  # where the image and text tokens are (models with image tokens only)
    looking_ahead: bool = False  # the oracle's side-effect-free look-ahead pass: the hooks record nothing
    # the sparse layer running now: expert -> whether it was a cache hit (filled only when `kinds` counts hits)
    layer_hits: dict[int, bool] = field(default_factory=dict)

    @classmethod
    def of_call(cls, args, kwargs, decoding: bool, image_ids: torch.Tensor | None) -> ForwardPass:
        """The pass the model was called with (`args`, `kwargs`: its forward's arguments);
        `image_ids`: the model's image token ids (None: a text model)."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        ids = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        mask = kwargs.get("attention_mask")
        kinds = TokenKinds.of(image_ids, input_ids, mask) if image_ids is not None else None
        return cls(decoding, ids.shape[0] if ids is not None else 1, mask, kinds)
