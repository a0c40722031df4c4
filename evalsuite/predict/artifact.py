"""Calibration artifacts: one safetensors file with default vectors, expert frequencies,
adapters and estimators, plus metadata that ties it to the model it was made for."""
from __future__ import annotations

import hashlib
import json

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

FORMAT = "evalsuite-predictor/1"
ESTIMATOR_PARTS = ("w1", "b1", "w2", "b2")  # an estimator's tensors: Linear, GELU, Linear
SHARED_ADAPTER = "adapter_shared"  # the prefix of the shared adapter's tensors (predictor adapter-shared)
SHARED_BLOCK_PARTS = ("norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
_VOLATILE = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_experts_implementation"}


class ArtifactError(ValueError):
    """A predictor artifact that cannot be used with this model."""


def fingerprint(model, layers) -> str:
    """A hash of the model's configuration and router weights (what predictions depend on most),
    the same for a float32 model and its bfloat16 copy."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for layer in layers:
        digest.update(layer.router.weight.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class Artifact:
    def __init__(self, tensors: dict[str, torch.Tensor], meta: dict):
        self.tensors, self.meta = tensors, meta

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ArtifactError(f"the predictor artifact has no {name!r}; recalibrate with the predictor you use "
                                "(evalsuite calibrate --predictor ...)")
        return self.tensors[name]

    def default_vectors(self, layer: int) -> torch.Tensor:
        return self._get(f"default_vectors.{layer}")

    def frequency(self, layer: int) -> torch.Tensor:
        return self._get(f"frequency.{layer}")

    def adapter(self, layer: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._get(f"adapter.{layer}.{h}.A"), self._get(f"adapter.{layer}.{h}.B")

    def estimator(self, layer: int) -> tuple[torch.Tensor, ...]:
        return tuple(self._get(f"estimator.{layer}.{p}") for p in ESTIMATOR_PARTS)

    def shared_adapter_shapes(self, hidden: int, anchors: int, experts: int) -> dict[str, tuple[int, ...]]:
        """Every tensor of the shared adapter (predictor adapter-shared) and its shape, for router inputs of width
        `hidden`, `anchors` anchor layers and `experts` experts per target layer, at the artifact's width d
        (`shared_width`) and block count (`shared_blocks`): proj [d, D] + [d], embed [anchors, d], per block a
        LayerNorm [d] x 2, fc1 [2d, d] + [2d], fc2 [d, 2d] + [d], then a LayerNorm [d] x 2 and head [E, d] + [E]."""
        width, blocks = self.meta.get("shared_width"), self.meta.get("shared_blocks")
        if not (type(width) is int and width >= 1 and type(blocks) is int and blocks >= 0):
            raise ArtifactError(f"the predictor artifact's adapter-shared size (shared_width={width!r}, "
                                f"shared_blocks={blocks!r}) is missing or damaged; recalibrate with evalsuite "
                                "calibrate --predictor adapter-shared")
        p = SHARED_ADAPTER
        shapes = {f"{p}.proj.weight": (width, hidden), f"{p}.proj.bias": (width,), f"{p}.embed": (anchors, width)}
        for i in range(blocks):
            block = (((width,),) * 2 + ((2 * width, width), (2 * width,), (width, 2 * width), (width,)))
            shapes.update({f"{p}.block.{i}.{part}": shape for part, shape in zip(SHARED_BLOCK_PARTS, block)})
        shapes.update({f"{p}.norm.weight": (width,), f"{p}.norm.bias": (width,), f"{p}.head.weight": (experts, width),
                       f"{p}.head.bias": (experts,)})
        return shapes

    def shared_adapter(self) -> dict:
        """The shared adapter's tensors: proj.weight, proj.bias, embed, blocks (per block its SHARED_BLOCK_PARTS),
        norm (weight, bias) and head (weight, bias)."""
        p, blocks = SHARED_ADAPTER, self.meta.get("shared_blocks")
        if not (type(blocks) is int and blocks >= 0):
            raise ArtifactError(f"the predictor artifact's adapter-shared block count {blocks!r} is missing or "
                                "damaged; recalibrate with evalsuite calibrate --predictor adapter-shared")
        return {"proj.weight": self._get(f"{p}.proj.weight"), "proj.bias": self._get(f"{p}.proj.bias"),
                "embed": self._get(f"{p}.embed"),
                "blocks": tuple(tuple(self._get(f"{p}.block.{i}.{part}") for part in SHARED_BLOCK_PARTS)
                                for i in range(blocks)),
                "norm": (self._get(f"{p}.norm.weight"), self._get(f"{p}.norm.bias")),
                "head": (self._get(f"{p}.head.weight"), self._get(f"{p}.head.bias"))}

    def next_token_adapter(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The adapter of the next token's first sparse layer on the last one's router input, if trained (an
        artifact calibrated before there was one, or on one-token rows, has none: the gate rule serves there)."""
        return self._optional("adapter.next_token", ("A", "B"))

    def next_token_estimator(self) -> tuple[torch.Tensor, ...] | None:
        """The estimator of the next token's first sparse layer on the last one's router input, if trained."""
        return self._optional("estimator.next_token", ESTIMATOR_PARTS)

    def _optional(self, name: str, parts) -> tuple[torch.Tensor, ...] | None:
        present = [f"{name}.{p}" in self.tensors for p in parts]
        if not any(present):
            return None
        return tuple(self._get(f"{name}.{p}") for p in parts)  # a part missing: refused, as any damage

    def estimator_gelu(self) -> str:
        """The GELU form the estimators were trained with (F.gelu's `approximate`): an artifact that names
        none predates the choice and was trained with the exact form."""
        form = self.meta.get("estimator_gelu", "none")
        if form not in ("none", "tanh"):
            raise ArtifactError(f"the predictor artifact names an unknown estimator GELU {form!r}; recreate it "
                                "with evalsuite calibrate")
        return form

    def check(self, layers, parts, horizon: int = 1) -> None:
        """Every tensor `parts` need for these sparse layers is present, with the model's shapes."""
        hidden = layers[0].router.weight.shape[1]
        expected = {}
        for pos, layer in enumerate(layers):
            e, i = layer.num_experts, layer.index
            if "default_vectors" in parts:
                expected[f"default_vectors.{i}"] = (e, hidden)
            if "frequency" in parts:
                expected[f"frequency.{i}"] = (e,)
            if pos + 1 < len(layers) and "estimator" in parts:
                width = self.meta.get("hidden")
                nxt = layers[pos + 1].num_experts
                expected.update({f"estimator.{i}.w1": (width, hidden), f"estimator.{i}.b1": (width,),
                                 f"estimator.{i}.w2": (nxt, width), f"estimator.{i}.b2": (nxt,)})
            if pos + horizon < len(layers) and "adapter" in parts:
                rank, target = self.meta.get("rank"), layers[pos + horizon].num_experts
                expected.update({f"adapter.{i}.{horizon}.A": (rank, hidden), f"adapter.{i}.{horizon}.B": (target, rank)})
        # the next token's first sparse layer, from the last one's router input, where the artifact has them
        first, last = layers[0].num_experts, layers[-1].router.weight.shape[1]
        if "adapter" in parts and self.next_token_adapter() is not None:
            rank = self.meta.get("rank")
            expected.update({"adapter.next_token.A": (rank, last), "adapter.next_token.B": (first, rank)})
        if "estimator" in parts and self.next_token_estimator() is not None:
            width = self.meta.get("hidden")
            expected.update({"estimator.next_token.w1": (width, last), "estimator.next_token.b1": (width,),
                             "estimator.next_token.w2": (first, width), "estimator.next_token.b2": (first,)})
        if "adapter_shared" in parts and len(layers) > 1:
            expected.update(self._shared_adapter_expected(layers))
        for name, shape in expected.items():
            if tuple(self._get(name).shape) != shape:
                raise ArtifactError(f"predictor artifact tensor {name} has shape {tuple(self.tensors[name].shape)}, "
                                    f"this model needs {shape}; recalibrate with evalsuite calibrate")
        if "adapter_shared" in parts:  # small tensors: a damaged value is looked for too
            for name in expected:
                if name.startswith(SHARED_ADAPTER + ".") and not torch.isfinite(self.tensors[name]).all():
                    raise ArtifactError(f"predictor artifact tensor {name} holds values that are not finite; "
                                        "recalibrate with evalsuite calibrate --predictor adapter-shared")

    def _shared_adapter_expected(self, layers) -> dict[str, tuple[int, ...]]:
        """The shared adapter's tensors for these sparse layers (shared_adapter_shapes), refusing a model whose
        target layers differ in experts (one head serves them all) and tensors of blocks the metadata lacks."""
        experts = {layer.num_experts for layer in layers[1:]}
        if len(experts) != 1:
            raise ArtifactError(f"predictor adapter-shared needs one number of experts in every target layer, this "
                                f"model has {sorted(experts)}; use predictor adapter")
        shapes = self.shared_adapter_shapes(layers[0].router.weight.shape[1], len(layers) - 1, experts.pop())
        extra = sorted(name for name in self.tensors if name.startswith(SHARED_ADAPTER + ".") and name not in shapes)
        if extra:
            raise ArtifactError(f"predictor artifact tensor {extra[0]} is not part of its adapter-shared "
                                f"(shared_blocks={self.meta.get('shared_blocks')}); recalibrate with evalsuite "
                                "calibrate --predictor adapter-shared")
        return shapes

    def to(self, device) -> "Artifact":
        return Artifact({k: v.to(device) for k, v in self.tensors.items()}, self.meta)

    def save(self, path: str) -> None:
        meta = {"format": FORMAT, **{k: json.dumps(v) for k, v in self.meta.items()}}
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, path, metadata=meta)

    @classmethod
    def load(cls, path: str, model=None, layers=None) -> "Artifact":
        """Read an artifact; with a model, refuse one calibrated for another model."""
        try:
            tensors = load_file(path)
            with safe_open(path, framework="pt") as f:
                raw = f.metadata() or {}
        except (SafetensorError, OSError, ValueError) as exc:
            raise ArtifactError(f"cannot read predictor artifact {path!r} ({exc}); recreate it with "
                                "evalsuite calibrate") from None
        if raw.get("format") != FORMAT:
            raise ArtifactError(f"{path!r} is not an evalsuite predictor artifact (format {raw.get('format')!r})")
        try:
            meta = {k: json.loads(v) for k, v in raw.items() if k != "format"}
        except json.JSONDecodeError:
            raise ArtifactError(f"predictor artifact {path!r} has damaged metadata; recreate it with "
                                "evalsuite calibrate") from None
        if model is not None:
            mine = fingerprint(model, layers)
            if meta.get("fingerprint") != mine:
                raise ArtifactError(f"predictor artifact {path!r} was calibrated for model "
                                    f"{meta.get('model', '?')} (fingerprint {meta.get('fingerprint')}), not this one "
                                    f"({mine}); run evalsuite calibrate for this model")
        return cls(tensors, meta)


def predictor_parameters(path: str | None, predictor: str | None) -> int | None:
    """`predictor`'s trainable parameters as the artifact at `path` counted them (its `parameters` metadata),
    read without loading the tensors; 0 for the training-free gate rule; None where nothing says."""
    if predictor == "gate":
        return 0
    if not path or predictor is None:
        return None
    try:
        with safe_open(path, framework="pt") as f:
            counted = json.loads((f.metadata() or {}).get("parameters", "{}"))
    except (SafetensorError, OSError, ValueError):
        return None
    return counted.get(predictor) if isinstance(counted, dict) else None
