"""Calibration: routing traces on calibration prompts -> default vectors, expert frequencies,
trained adapters and estimators, and per-layer recall, saved as one artifact.

Run on the unmodified model (before `offload`). Targets are the frozen native routers: the
adapters and estimators minimise KL(softmax(native logits) || softmax(predicted logits)).

The batches are split in two (split_batches): the first part (the calibration tokens) gives the
default vectors and frequencies and trains the adapters and estimators; the last `heldout` of the
batches (20 %, at least one, where there are two or more) is never trained on, and measures every
predictor's recall@K there (`heldout_recall`), beside its trainable parameter count (`parameters`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..engine import arch
from ..engine.kernel import expert_mlp
from ..engine.metrics import token_recall
from ..engine.placement.store import ExpertLayout
from .artifact import ESTIMATOR_PARTS, SHARED_ADAPTER, SHARED_BLOCK_PARTS, Artifact, fingerprint
from ..engine.pass_state.layer_state import LayerState
from .predictors import (AdapterPredictor, EstimatorPredictor, FrequencyPredictor, GatePredictor, QuasiPredictor,
                         SharedAdapterPredictor, router_logits, shared_correction)

TRAINED = {"gate": (), "quasi": (), "frequency": (), "adapter": ("adapter",), "adapter-shared": ("adapter_shared",),
           "estimator": ("estimator",), "hybrid": ("estimator",), "all": ("adapter", "adapter_shared", "estimator")}
HELDOUT = 0.2  # the fraction of the calibration batches held out of training to measure recall on (split_batches)
# Whether the quasi state adds the shared experts' output (QuasiPredictor): new artifacts' default, measured better
QUASI_SHARED_EXPERTS = True


@torch.no_grad()
def collect(model, layers, batches) -> list[dict[str, torch.Tensor]]:
    """Per sparse layer: router input x, residual, native logits, ids and weights of real tokens, and
    `has_next`: whether a token's row goes on to a next real token (the token after it in this order)."""
    trace = [{k: [] for k in ("x", "residual", "logits", "ids", "weights")} for _ in layers]
    keep = {}
    hooks, has_next = [], []
    for pos, layer in enumerate(layers):
        hooks.append(layer.norm.register_forward_pre_hook(
            lambda m, args, pos=pos: trace[pos]["residual"].append(args[0].reshape(-1, args[0].shape[-1])[keep["m"]])))
        hooks.append(layer.router.register_forward_hook(lambda m, args, out, pos=pos: _record(trace[pos], args, out, keep["m"])))
    try:
        for ids, mask in batches:
            real = mask.bool()
            keep["m"] = real.reshape(-1)
            model(input_ids=ids, attention_mask=mask)
            # real tokens are kept in row-major order, so a token followed by a real one in its row has it next
            follows = torch.zeros_like(real)
            follows[:, :-1] = real[:, :-1] & real[:, 1:]
            has_next.append(follows[real])
    finally:
        for h in hooks:
            h.remove()
    out = [{k: torch.cat(v) for k, v in t.items()} for t in trace]
    for t in out:
        t["has_next"] = torch.cat(has_next)
    return out


def next_token_pairs(trace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the next token's first sparse layer is predicted from and must match: the last sparse layer's
    router input of every token with a next one, and that next token's first-layer logits and ids."""
    at = trace[-1]["has_next"].nonzero().squeeze(1)
    return trace[-1]["x"][at].float(), trace[0]["logits"][at + 1], trace[0]["ids"][at + 1]


def _record(store, args, out, keep):
    x = args[0].reshape(-1, args[0].shape[-1])
    logits, weights, ids = out
    for name, value in (("x", x), ("logits", logits), ("ids", ids), ("weights", weights)):
        store[name].append(value[keep])


@torch.no_grad()
def default_vectors(layer, trace) -> torch.Tensor:
    """Mean (unweighted) output of each expert over the calibration tokens routed to it."""
    layout = ExpertLayout.of(layer.experts)
    out = torch.zeros(layer.num_experts, trace["x"].shape[1])
    for e in range(layer.num_experts):
        tokens = (trace["ids"] == e).any(dim=1)
        if tokens.any():
            w = {name: getattr(layer.experts, name)[e] for name, _, _ in layout.fields}
            out[e] = expert_mlp(layer.experts, trace["x"][tokens], w).float().mean(dim=0)
    return out


def _fit(params, forward, inputs, targets, epochs, lr, desc, batch_size=256) -> float:
    """Minimise KL(softmax(targets) || softmax(forward(inputs))) with Adam; returns the last epoch's loss."""
    optimizer = torch.optim.Adam(params, lr=lr)
    target_logp = F.log_softmax(targets.float(), dim=-1)
    loss_value = float("nan")
    bar = tqdm(range(epochs), desc=desc, leave=False)
    for _ in bar:
        order, total = torch.randperm(len(inputs)), 0.0
        for start in range(0, len(inputs), batch_size):
            idx = order[start:start + batch_size]
            pred = F.log_softmax(forward(inputs[idx]), dim=-1)
            loss = F.kl_div(pred, target_logp[idx], log_target=True, reduction="batchmean")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(idx)
        loss_value = total / len(inputs)
        bar.set_postfix(kl=f"{loss_value:.4f}")
    return loss_value


def train_adapter(router, x, target_logits, rank, epochs, lr, desc="adapter"):
    """Low-rank correction B A of the target router: B starts at zero, so untrained = gate."""
    a = torch.nn.Parameter(torch.randn(rank, x.shape[1]) / x.shape[1] ** 0.5)
    b = torch.nn.Parameter(torch.zeros(router.weight.shape[0], rank))
    base = router_logits(router, x).detach()
    loss = _fit([a, b], lambda rows: base[rows] + F.linear(F.linear(x[rows], a), b), torch.arange(len(x)),
                target_logits, epochs, lr, desc)
    return a.detach(), b.detach(), loss


# The estimators' GELU: the tanh form, because a prediction runs at every sparse layer and on a CPU the exact
# (erf) form of a [1, 64] hidden costs several times the tanh form
ESTIMATOR_GELU = "tanh"


def train_estimator(q, target_logits, hidden, epochs, lr, desc="estimator"):
    net = torch.nn.Sequential(torch.nn.Linear(q.shape[1], hidden), torch.nn.GELU(approximate=ESTIMATOR_GELU),
                              torch.nn.Linear(hidden, target_logits.shape[1]))
    loss = _fit(list(net.parameters()), lambda rows: net(q[rows]), torch.arange(len(q)), target_logits, epochs, lr,
                desc)
    return [t.detach() for t in (net[0].weight, net[0].bias, net[2].weight, net[2].bias)], loss


def train_shared_adapter(layers, trace, width, blocks, epochs, lr, desc="training adapter-shared, every layer"):
    """The shared adapter (SharedAdapterPredictor), fitted on every anchor layer's tokens together: each token's
    router input x at anchor position p, its target the native logits of sparse layer p+1, its prediction those of
    W_gate^{p+1} x plus the adapter's correction. The head starts at zero, so untrained = gate. Returns the tensors,
    by artifact name, and the final KL."""
    anchors = len(layers) - 1
    x = torch.cat([trace[pos]["x"].float() for pos in range(anchors)])
    at = torch.cat([torch.full((len(trace[pos]["x"]),), pos, dtype=torch.long) for pos in range(anchors)])
    with torch.no_grad():
        base = torch.cat([router_logits(layers[pos + 1].router, trace[pos]["x"]) for pos in range(anchors)])
    target = torch.cat([trace[pos + 1]["logits"] for pos in range(anchors)])
    nn = torch.nn
    proj, norm, head = nn.Linear(x.shape[1], width), nn.LayerNorm(width), nn.Linear(width, base.shape[1])
    embed = nn.Parameter(torch.randn(anchors, width) * 0.02)
    residual = [(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)) for _ in range(blocks)]
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
    block_params = [(ln.weight, ln.bias, fc1.weight, fc1.bias, fc2.weight, fc2.bias) for ln, fc1, fc2 in residual]
    params = [proj.weight, proj.bias, embed, *(t for block in block_params for t in block), norm.weight, norm.bias,
              head.weight, head.bias]

    def forward(rows):
        return base[rows] + shared_correction(x[rows], proj.weight, proj.bias + embed[at[rows]], block_params,
                                              (norm.weight, norm.bias), (head.weight, head.bias))

    loss = _fit(params, forward, torch.arange(len(x)), target, epochs, lr, desc)
    p = SHARED_ADAPTER
    tensors = {f"{p}.proj.weight": proj.weight, f"{p}.proj.bias": proj.bias, f"{p}.embed": embed,
               f"{p}.norm.weight": norm.weight, f"{p}.norm.bias": norm.bias, f"{p}.head.weight": head.weight,
               f"{p}.head.bias": head.bias}
    for i, block in enumerate(block_params):
        tensors.update({f"{p}.block.{i}.{part}": t for part, t in zip(SHARED_BLOCK_PARTS, block)})
    return {name: t.detach().clone() for name, t in tensors.items()}, loss


def recall(scores: torch.Tensor, true_ids: torch.Tensor) -> float:
    """Mean recall@K over tokens, K = the router's top-k (evalsuite.engine.metrics.token_recall)."""
    return token_recall(scores, true_ids, true_ids.shape[1]).mean().item()


def _layer_state(trace, pos: int) -> LayerState:
    t = trace[pos]
    return LayerState(pos, t["x"], t["residual"], t["ids"], t["weights"])


def train(layers, family, artifact, trace, predictor: str, rank, horizon, hidden, epochs, lr, shared_width: int = 64,
          shared_blocks: int = 2) -> dict[str, float]:
    """Train the adapters and estimators `predictor` needs into the artifact's tensors; returns each final KL."""
    tensors, losses = artifact.tensors, {}
    if "adapter_shared" in TRAINED[predictor] and len(layers) > 1:
        experts = {layer.num_experts for layer in layers[1:]}
        if len(experts) != 1:
            raise ValueError(f"predictor adapter-shared needs one number of experts in every target layer, this "
                             f"model has {sorted(experts)}; calibrate --predictor adapter instead")
        shared, losses[SHARED_ADAPTER] = train_shared_adapter(layers, trace, shared_width, shared_blocks, epochs, lr)
        tensors.update(shared)
    quasi = QuasiPredictor(layers, family, artifact)
    for pos, layer in enumerate(layers[:-1]):
        t = trace[pos]
        if "adapter" in TRAINED[predictor]:
            for h in range(1, horizon + 1):
                if pos + h < len(layers):
                    name = f"adapter.{layer.index}.{h}"
                    a, b, losses[name] = train_adapter(layers[pos + h].router, t["x"].float(), trace[pos + h]["logits"],
                                                       rank, epochs, lr, desc=_bar("adapter", layer, layers[pos + h]))
                    tensors[f"{name}.A"], tensors[f"{name}.B"] = a, b
        if "estimator" in TRAINED[predictor]:
            with torch.no_grad():
                q = quasi.quasi_state(_layer_state(trace, pos)).float()
            params, losses[f"estimator.{layer.index}"] = train_estimator(
                q, trace[pos + 1]["logits"], hidden, epochs, lr, desc=_bar("estimator", layer, layers[pos + 1]))
            for name, value in zip(ESTIMATOR_PARTS, params):
                tensors[f"estimator.{layer.index}.{name}"] = value
    x, target, _ = next_token_pairs(trace)
    if len(x):  # the next token's first sparse layer, from this token's last (none from one-token rows)
        if "adapter" in TRAINED[predictor]:
            a, b, losses["adapter.next_token"] = train_adapter(layers[0].router, x, target, rank, epochs, lr,
                                                               desc=_bar("adapter", layers[-1], layers[0], True))
            tensors["adapter.next_token.A"], tensors["adapter.next_token.B"] = a, b
        if "estimator" in TRAINED[predictor]:
            params, losses["estimator.next_token"] = train_estimator(
                x, target, hidden, epochs, lr, desc=_bar("estimator", layers[-1], layers[0], True))
            for name, value in zip(ESTIMATOR_PARTS, params):
                tensors[f"estimator.next_token.{name}"] = value
    return losses


def _bar(predictor: str, layer, target, next_token: bool = False) -> str:
    return f"training {predictor} layer {layer.index}->{target.index}" + (" of the next token" if next_token else "")


def recalls(layers, family, artifact, trace, predictor: str, horizon: int) -> dict[str, dict[str, float]]:
    """Recall@K per target layer of every predictor the artifact serves, one step ahead, on the tokens of `trace`;
    adapters trained two steps ahead also as `adapter_h2`. calibrate() scores the calibration tokens (the trained
    predictors on the tokens they were fitted to) as `recall`, and the held-out tokens as `heldout_recall`."""
    served = {"gate": (GatePredictor, 1), "quasi": (QuasiPredictor, 1), "frequency": (FrequencyPredictor, 1)}
    if "adapter" in TRAINED[predictor]:
        served["adapter"] = (AdapterPredictor, 1)
        if horizon > 1:
            served["adapter_h2"] = (AdapterPredictor, 2)
    if "adapter_shared" in TRAINED[predictor]:
        served["adapter-shared"] = (SharedAdapterPredictor, 1)
    if "estimator" in TRAINED[predictor]:
        served["estimator"] = (EstimatorPredictor, 1)
    out = {}
    for name, (kind, h) in served.items():
        made = kind(layers, family, artifact)
        with torch.no_grad():  # keys are strings, as they come back from the artifact's JSON metadata
            out[name] = {str(layers[pos + h].index): recall(made.scores(_layer_state(trace, pos), h),
                                                            trace[pos + h]["ids"]) for pos in range(len(layers) - h)}
    return out


def next_token_recalls(layers, family, artifact, trace, predictor: str) -> dict[str, float]:
    """Recall@K of the next token's first sparse layer, predicted at this token's last (Predictor.next_token_scores),
    by every predictor whose prediction there the artifact serves: the gate rule, and the adapter and estimator it
    trained for it (on the tokens they were fitted to). Empty where no calibration row has two tokens."""
    x, _, ids = next_token_pairs(trace)
    if not len(x):
        return {}
    served = {"gate": GatePredictor, **{name: kind for name, kind in (("adapter", AdapterPredictor),
                                                                      ("estimator", EstimatorPredictor))
                                        if name in TRAINED[predictor]}}
    with torch.no_grad():
        return {name: recall(kind(layers, family, artifact).next_token_scores(x), ids) for name, kind in served.items()}


def split_batches(batches: list, heldout: float = HELDOUT) -> tuple[list, list]:
    """(calibration batches, held-out batches): the last `heldout` of them (rounded, at least one) held out, where
    there are two or more; one batch is all calibration (nothing held out), as is `heldout` = 0."""
    if not 0 <= heldout < 1:
        raise ValueError(f"heldout={heldout!r} must be a fraction of the batches, 0 or more and below 1")
    held = 0 if len(batches) < 2 or heldout == 0 else min(len(batches) - 1, max(1, round(heldout * len(batches))))
    return batches[:len(batches) - held], batches[len(batches) - held:]


TRAINABLE = {"adapter": "adapter.", "adapter-shared": SHARED_ADAPTER + ".", "estimator": "estimator."}


def trainable_parameters(artifact, predictor: str) -> dict[str, int]:
    """Trainable parameters of every predictor the artifact serves (the names of `recalls`, without `adapter_h2`):
    the numbers training fitted, every tensor of that predictor (an adapter per anchor layer and horizon and the
    next token's; the shared adapter; an estimator per anchor layer and the next token's). gate, quasi and
    frequency have none: quasi's default vectors and frequency's counts are statistics of the calibration tokens
    (per-expert mean outputs, routing counts: `statistics`), not trained."""
    counts = {"gate": 0, "quasi": 0, "frequency": 0}
    for name, part in (("adapter", "adapter"), ("adapter-shared", "adapter_shared"), ("estimator", "estimator")):
        if part in TRAINED[predictor]:
            counts[name] = sum(t.numel() for key, t in artifact.tensors.items() if key.startswith(TRAINABLE[name]))
    return counts


def calibrate(model, batches, predictor: str = "all", rank: int = 16, horizon: int = 1, hidden: int = 64,
              epochs: int = 30, lr: float = 1e-3, shared_width: int = 64, shared_blocks: int = 2,
              heldout: float = HELDOUT, quasi_shared_experts: bool = QUASI_SHARED_EXPERTS) -> Artifact:
    """Everything the predictors need, from the model's own routing on `batches` of (ids, mask): fitted on the
    first part of them, scored on both parts (split_batches). `shared_width`, `shared_blocks`: the shared
    adapter's width d and residual blocks; `quasi_shared_experts`: whether the quasi state (and so the estimators
    trained on it) adds the shared experts' output (QuasiPredictor)."""
    if predictor not in TRAINED:
        raise ValueError(f"cannot calibrate predictor={predictor!r}: use one of {', '.join(TRAINED)}")
    if shared_width < 1 or shared_blocks < 0:
        raise ValueError(f"the shared adapter needs a width of at least 1 and 0 or more blocks, not "
                         f"shared_width={shared_width}, shared_blocks={shared_blocks}")
    layers, family = arch.sparse_layers(model), arch.family_of(model)
    fitted, held = split_batches(list(batches), heldout)
    trace = collect(model, layers, fitted)
    held_trace = collect(model, layers, held) if held else None
    tensors = {}
    # (read as the predictors below are trained and scored)
    meta = {"estimator_gelu": ESTIMATOR_GELU, "shared_width": shared_width, "shared_blocks": shared_blocks,
            "quasi_shared_experts": bool(quasi_shared_experts)}
    for pos, layer in enumerate(layers):
        tensors[f"default_vectors.{layer.index}"] = default_vectors(layer, trace[pos])
        tensors[f"frequency.{layer.index}"] = torch.bincount(trace[pos]["ids"].reshape(-1),
                                                             minlength=layer.num_experts).float()
    artifact = Artifact(tensors, meta)
    losses = train(layers, family, artifact, trace, predictor, rank, horizon, hidden, epochs, lr, shared_width,
                   shared_blocks)
    statistics = {"quasi": sum(tensors[f"default_vectors.{l.index}"].numel() for l in layers),
                  "frequency": sum(tensors[f"frequency.{l.index}"].numel() for l in layers)}
    meta.update(fingerprint=fingerprint(model, layers), model=model.config._name_or_path or model.config.model_type,
                model_type=arch.model_type(model), predictor=predictor, rank=rank, horizon=horizon, hidden=hidden,
                layers=[l.index for l in layers], tokens=int(trace[0]["x"].shape[0]), final_loss=losses,
                recall=recalls(layers, family, artifact, trace, predictor, horizon),
                next_token_recall=next_token_recalls(layers, family, artifact, trace, predictor),
                parameters=trainable_parameters(artifact, predictor), statistics=statistics,
                heldout_batches=len(held), heldout_tokens=int(held_trace[0]["x"].shape[0]) if held else 0,
                heldout_recall=recalls(layers, family, artifact, held_trace, predictor, horizon) if held else {},
                heldout_next_token_recall=next_token_recalls(layers, family, artifact, held_trace, predictor)
                if held else {})
    return artifact


def calibration_texts(data: str | None, limit: int) -> list[str]:
    """Texts from a JSONL file (fields text, prompt+completion or question+answer), or by
    default the project's own generated training data (never its held-out tasks)."""
    import json
    import os

    if data is None:
        from ..taskgen.corpus import training_corpus

        items = training_corpus(seed=7, size_per_skill=max(1, limit // 4))
    else:
        if not os.path.isfile(data):
            raise FileNotFoundError(f"calibration data {data!r} not found: give a JSONL file of texts")
        with open(data) as f:
            try:
                items = [json.loads(line) for line in f if line.strip()]
            except json.JSONDecodeError as exc:
                raise ValueError(f"calibration data {data!r} is not JSONL ({exc.msg} at line {exc.lineno})") from None
    if not all(isinstance(item, dict) for item in items):
        raise ValueError(f"calibration data {data!r}: every line must be a JSON object")
    texts = [item.get("text") or (item.get("prompt", "") + item.get("completion", "")) or
             (item.get("question", "") + "\n" + str(item.get("answer", ""))) for item in items[:limit]]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"no calibration text in {data!r}: rows need a text, prompt or question field")
    return texts


def token_batches(texts, tokenizer, vocab_size: int, batch_size: int = 8, max_len: int = 128):
    """(ids, mask) batches, right-padded; random ids when the model has no tokenizer."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(3, vocab_size, (max_len // 2,), generator=g) for _ in texts]
    else:
        rows = [torch.tensor(tokenizer(t)["input_ids"][:max_len]) for t in texts]
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        width = max(len(r) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(chunk):
            ids[i, :len(r)], mask[i, :len(r)] = r, 1
        yield ids, mask
