"""Which positions of a forward pass hold image tokens, for metrics split by token kind.

Vision-language MoEs route image tokens through the same experts as text, but differently;
the engine reports hit rate and recall for each kind (definitions in evalsuite/engine/metrics.py: recall by kind
is over decode tokens, scored when a request ends from each step's `masks`, evalsuite.engine.prediction.request_recall).
Padding positions (attention mask 0) belong to neither kind.
"""
from __future__ import annotations

import torch

from evalsuite.engine.metrics import KindCounts

IMAGE_TOKEN_FIELDS = ("image_token_id", "video_token_id", "image_token_index")


def image_token_ids(model) -> list[int]:
    config = model.config
    return sorted({v for name in IMAGE_TOKEN_FIELDS if isinstance(v := getattr(config, name, None), int)})


class TokenKinds:
    """Which flattened positions of one forward pass hold image tokens and which text tokens
    (None: not known, the pass was given embeddings only)."""

    def __init__(self, image: torch.Tensor | None, text: torch.Tensor | None, all_text: bool = False):
        self.image, self.text = image, text
        self.all_text = all_text  # every position holds a text token (every decode step does): counted without masks

    @classmethod
    def of(cls, image_ids: torch.Tensor, input_ids, attention_mask) -> TokenKinds:
        if input_ids is None:
            return cls(None, None)
        image = torch.isin(input_ids, image_ids.to(input_ids.device))
        real = torch.ones_like(image)
        if attention_mask is not None:
            real = attention_mask[:, -input_ids.shape[1]:].bool()
        text = (~image & real).flatten()
        # one host read a pass spares the masks' tensor calls and reads at every sparse layer of a text-only pass
        return cls((image & real).flatten(), text, bool(text.all()))

    def masks(self, tokens: int) -> dict[str, torch.Tensor]:
        if self.image is None or self.image.numel() != tokens:
            return {}
        return {"image": self.image, "text": self.text}

    def count_hits(self, counts: KindCounts, top_k_index: torch.Tensor, hit_of: dict[int, bool]) -> None:
        """Per kind: (token, routed expert) pairs whose expert was a hit at this layer."""
        masks = self.masks(top_k_index.shape[0])
        if not masks:
            return
        if self.all_text:  # the sums below with every token text, from one read of the routing
            rows = top_k_index.tolist()
            counts.add_hits("image", 0, 0)
            counts.add_hits("text", sum(bool(hit_of.get(e)) for row in rows for e in row), top_k_index.numel())
            return
        hit = torch.zeros(int(top_k_index.max()) + 1, dtype=torch.long, device=top_k_index.device)
        for expert, was_hit in hit_of.items():
            if was_hit and expert < hit.numel():
                hit[expert] = 1
        per_token = hit[top_k_index].sum(dim=-1)
        for kind, mask in masks.items():
            counts.add_hits(kind, int(per_token[mask].sum()), int(mask.sum()) * top_k_index.shape[1])
