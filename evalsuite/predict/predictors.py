"""Next-layer expert predictors. While sparse layer p runs, each scores the experts of layer p+h.

A predictor returns [T, E] scores (higher = more likely) for the target layer; its top-k is the
predicted expert set. Router-space predictors turn logits into scores with the family's
`selection_scores`, so their top-k is what that router would choose from those logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engine.pass_state.layer_state import LayerState  # noqa: F401  (what predictors read; calibrate builds them)
from ..engine.prediction.registry import ranked_scores
from ..engine.prediction.scheduler import ranked
from ..engine.pass_state.input_taps import untapped


def router_logits(router, x: torch.Tensor) -> torch.Tensor:
    bias = getattr(router, "bias", None)
    return F.linear(_float(x), _float(router.weight), None if bias is None else _float(bias))


def _float(t: torch.Tensor) -> torch.Tensor:
    """`t.float()`, without the dispatch when `t` is float32 already (predictions run at every layer)."""
    return t if t.dtype == torch.float32 else t.float()


def fused_norm(norm):
    """What `norm` computes, as one call where that is an RMS norm (`F.rms_norm`: one call where the
    families' norms make eight), else its `forward`. Never a module call, nor the forward the engine's tap
    wraps: either would run the hooks or the tap on the norm (the engine's, which record the residual stream
    the model passes it), costing time and recording a prediction's state as if it were the model's. The fused call is used only where it
    agrees with the norm's own forward on a probe, to the rounding of the norm's dtype: a norm of another
    form (a LayerNorm, an offset weight as in Gemma) keeps its forward, without the engine's tap on it."""
    forward = untapped(norm)
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.is_meta or not isinstance(eps, float):
        return forward
    shape = (weight.shape[0],)

    def rms_norm(x):
        return F.rms_norm(x, shape, weight, eps)

    probe = torch.randn(3, shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype) * 3
    with torch.no_grad():
        own, fused = forward(probe).float(), rms_norm(probe).float()
    tolerance = 4 * torch.finfo(weight.dtype).eps
    return rms_norm if torch.allclose(fused, own, rtol=tolerance, atol=tolerance) else forward


class Predictor:
    name = ""
    horizons = (1,)  # how far ahead it can predict
    parts: tuple[str, ...] = ()  # what it reads from a calibration artifact
    reads = ("x",)  # the LayerState fields scores() reads (the residual needs a tap per layer to record it)
    stateless = True  # scores() depends on its arguments alone, so it may be called after the request

    def __init__(self, layers, family, artifact=None):
        self.layers, self.family, self.artifact = layers, family, artifact

    def scores(self, state: LayerState, h: int) -> torch.Tensor:
        raise NotImplementedError

    def on_token(self, decoding: bool) -> None:
        """A forward pass starts (a prefill, or one decode step); predictors that replay a run count them."""

    def next_token_scores(self, x: torch.Tensor) -> torch.Tensor | None:
        """The next token's first sparse layer, from the last sparse layer's router input `x`:
        its router applied to `x` (the gate rule across the token boundary); None if unknown."""
        return self._from_logits(0, router_logits(self.layers[0].router, x))

    def _from_logits(self, target: int, logits: torch.Tensor) -> torch.Tensor:
        return self.family.selection_scores(self.layers[target].router, logits)


class GatePredictor(Predictor):
    """Layer p+h's router applied to layer p's router input (FATE, "Fate: Fast Edge Inference of
    Mixture-of-Experts Models via Cross-Layer Gate"; mixtral-offloading)."""

    name, horizons = "gate", (1, 2)

    def scores(self, state, h):
        target = state.pos + h
        return self._from_logits(target, router_logits(self.layers[target].router, state.x))


def shared_experts_of(block):
    """What `block`'s shared experts add to the layer's output, as a function of the router input x: DeepSeek's and
    GLM-4.5's unweighted `shared_experts`, Qwen2-MoE's `shared_expert` scaled by sigmoid(`shared_expert_gate` x); None
    where the block has none. Their forwards without a tap (as fused_norm's), so a prediction feeds no reader."""
    experts = getattr(block, "shared_experts", None)
    if isinstance(experts, torch.nn.Module):
        return untapped(experts)
    expert = getattr(block, "shared_expert", None)
    if not isinstance(expert, torch.nn.Module):
        return None
    run, gate = untapped(expert), getattr(block, "shared_expert_gate", None)
    if not isinstance(gate, torch.nn.Module):
        return run
    scale = untapped(gate)
    return lambda x: torch.sigmoid(scale(x)) * run(x)


class QuasiPredictor(Predictor):
    """Speculating Experts (arXiv:2603.19289): q = LN_{p+1}(r_p + d_p), d_p = sum over executed experts
    of w_e * default_vector[e]; layer p+1's router applied to q.

    In a model with shared experts (DeepSeek, GLM-4.5, Qwen2-MoE) layer p's output is r_p + routed + shared(x_p),
    and the paper's d_p leaves the shared part out. With `shared_experts` (the artifact's `quasi_shared_experts`,
    which calibration sets; an artifact without it predates the option and was made without them) q adds the shared
    experts' output on the router input x_p: exactly the term layer p adds to the residual stream, as they are
    resident and need no prediction (their mean output, a default vector, would shift every token alike). Included
    is the calibration default: on the shipped tiny GLM-4.5-style model it raised quasi's held-out recall@K above
    leaving them out, where the mean vector lowered it; it costs one shared-expert MLP per prediction."""

    name, parts, reads = "quasi", ("default_vectors",), ("residual", "ids", "weights")

    def __init__(self, layers, family, artifact=None, shared_experts: bool | None = None):
        super().__init__(layers, family, artifact)
        if shared_experts is None:
            shared_experts = bool(artifact.meta.get("quasi_shared_experts", False)) if artifact is not None else False
        # position -> its block's shared experts (shared_experts_of), where included and the block has them
        self._shared = {pos: run for pos, layer in enumerate(layers)
                        if shared_experts and (run := shared_experts_of(layer.block)) is not None}
        self.shared_experts = bool(self._shared)
        if self.shared_experts:
            self.reads = ("x",) + type(self).reads  # the shared experts' input (an instance's: the engine reads it)
        self._norms: dict[int, object] = {}  # position -> the function its norm computes (fused_norm)
        self._offsets: dict[torch.Size, torch.Tensor] = {}  # ids' shape -> where each row's ids start, flat

    def quasi_state(self, state: LayerState) -> torch.Tensor:
        vectors = self.artifact.default_vectors(self.layers[state.pos].index)  # [E, H] float32
        # the weighted sum of each row's default vectors in one call (a gather, a product and a sum took three),
        # on flat ids with the rows' offsets kept (given 2-d ids, embedding_bag builds them at every call)
        ids = state.ids
        offsets = self._offsets.get(ids.shape)
        if offsets is None or offsets.device != ids.device:
            offsets = self._offsets[ids.shape] = torch.arange(0, ids.numel(), ids.shape[1], device=ids.device)
        d = F.embedding_bag(ids.reshape(-1), vectors, offsets, mode="sum",
                            per_sample_weights=_float(state.weights).reshape(-1))
        residual = state.residual  # as the layer got it (LayerState): rows then tokens first, as the ids
        if residual.dim() != 2:
            residual = residual.reshape(-1, residual.shape[-1])
        q = _float(residual) + d
        shared = self._shared.get(state.pos)
        if shared is not None:  # what the shared experts add to layer p's output, on its router input
            x = state.x
            q = q + _float(shared(x if x.dim() == 2 else x.reshape(-1, x.shape[-1])))
        pos = state.pos + 1
        norm = self._norms.get(pos)
        if norm is None:
            norm = self._norms[pos] = fused_norm(self.layers[pos].norm)
        return norm(q if q.dtype == residual.dtype else q.to(residual.dtype))

    def scores(self, state, h):
        target = state.pos + 1
        return self._from_logits(target, router_logits(self.layers[target].router, self.quasi_state(state)))


class EstimatorPredictor(QuasiPredictor):
    """Speculating Experts' lightweight estimator (arXiv:2603.19289): a small feed-forward net from q to
    layer p+1's logits, with the GELU form it was trained with (Artifact.estimator_gelu)."""

    name, parts = "estimator", ("default_vectors", "estimator")

    def __init__(self, layers, family, artifact=None):
        super().__init__(layers, family, artifact)
        self.gelu = artifact.estimator_gelu() if artifact is not None else None

    def scores(self, state, h):
        net = self.artifact.estimator(self.layers[state.pos].index)
        return self._from_logits(state.pos + 1, self._estimate(self.quasi_state(state), net))

    def next_token_scores(self, x):
        """The next token's first sparse layer: its estimator on the last sparse layer's router input `x` (no
        quasi state reaches across the token boundary), or the gate rule where the artifact has none."""
        net = self.artifact.next_token_estimator() if self.artifact is not None else None
        if net is None:
            return super().next_token_scores(x)
        return self._from_logits(0, self._estimate(x, net))

    def _estimate(self, q: torch.Tensor, net: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The logits the estimator `net` (w1, b1, w2, b2) gives for input `q`."""
        w1, b1, w2, b2 = net
        return F.linear(F.gelu(F.linear(_float(q), w1, b1), approximate=self.gelu), w2, b2)


class AdapterPredictor(Predictor):
    """SpecPrefetch (arXiv:2607.24787): logits = (W_gate^{p+h} + B A) x_p, one low-rank adapter per (layer, horizon)."""

    name, horizons, parts = "adapter", (1, 2), ("adapter",)

    def scores(self, state, h):
        target = state.pos + h
        a, b = self.artifact.adapter(self.layers[state.pos].index, h)
        return self._from_logits(target, _adapted(self.layers[target].router, state.x, a, b))

    def next_token_scores(self, x):
        """The next token's first sparse layer: the gate rule across the token boundary plus the adapter trained
        for it (B A x), or the gate rule alone where the artifact has none."""
        trained = self.artifact.next_token_adapter() if self.artifact is not None else None
        if trained is None:
            return super().next_token_scores(x)
        return self._from_logits(0, _adapted(self.layers[0].router, x, *trained))


def _adapted(router, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(W_gate + B A) x: the router's logits for `x` plus the low-rank adapter's correction."""
    return router_logits(router, x) + F.linear(F.linear(_float(x), a), b)


# The shared adapter's GELU: the tanh form, as the estimators' (calibrate.ESTIMATOR_GELU), for the same reason
SHARED_ADAPTER_GELU = "tanh"


def shared_correction(x: torch.Tensor, proj: torch.Tensor, first: torch.Tensor, blocks, norm, head) -> torch.Tensor:
    """The shared adapter's correction to the next router's logits (SharedAdapterPredictor): h = proj x + first
    (the projection's bias plus the anchor layer's embedding, [d] or one row per token), then each residual block
    h += W2 gelu(W1 LN(h) + b1) + b2, then head LN(h). `blocks` holds (ln weight, ln bias, W1, b1, W2, b2) each,
    `norm` (weight, bias), `head` (weight, bias). Training (calibrate) and prediction both compute it here."""
    h = F.linear(_float(x), proj) + first
    width = (h.shape[-1],)
    for ln_w, ln_b, w1, b1, w2, b2 in blocks:
        h = h + F.linear(F.gelu(F.linear(F.layer_norm(h, width, ln_w, ln_b), w1, b1), approximate=SHARED_ADAPTER_GELU),
                         w2, b2)
    return F.linear(F.layer_norm(h, width, norm[0], norm[1]), head[0], head[1])


class SharedAdapterPredictor(Predictor):
    """SpecPrefetch's `correction` fusion (arXiv:2607.24787, its public modeling code): ONE small network shared by
    every anchor layer, its output added to the next layer's native router logits:
    logits = W_gate^{p+1} x_p + head(LN(blocks(proj x_p + embed[p]))), with residual MLP blocks (LayerNorm, a
    2d-wide GELU layer, back to d) at width d and a zero-initialised head (untrained = the gate predictor exactly).
    One step ahead; across the token boundary the gate rule (Predictor.next_token_scores)."""

    name, parts = "adapter-shared", ("adapter_shared",)

    def __init__(self, layers, family, artifact=None):
        super().__init__(layers, family, artifact)
        self._net: tuple | None = None  # (proj, per position its first bias, blocks, norm, head), read at first use

    def _network(self) -> tuple:
        if self._net is None:
            net = self.artifact.shared_adapter()
            firsts = [net["proj.bias"] + net["embed"][pos] for pos in range(len(net["embed"]))]
            self._net = (net["proj.weight"], firsts, net["blocks"], net["norm"], net["head"])
        return self._net

    def scores(self, state, h):
        target = state.pos + 1
        proj, firsts, blocks, norm, head = self._network()
        logits = router_logits(self.layers[target].router, state.x)
        return self._from_logits(target, logits + shared_correction(state.x, proj, firsts[state.pos], blocks, norm,
                                                                    head))


class FrequencyPredictor(Predictor):
    """The floor: each layer's most used experts on calibration data, whatever the input."""

    name, horizons, parts = "frequency", (1, 2), ("frequency",)

    def scores(self, state, h):
        counts = self.artifact.frequency(self.layers[state.pos + h].index)
        return counts.float().expand(state.x.shape[0], -1)


class OraclePredictor(Predictor):
    """The upper bound: the routing a look-ahead pass recorded for this very forward pass."""

    name, horizons = "oracle", (1, 2)
    stateless = False  # reads the routing its look-ahead pass recorded for this forward pass

    def __init__(self, layers, family, artifact=None):
        super().__init__(layers, family, artifact)
        self.trace: dict[int, torch.Tensor] = {}  # position -> [T, K] ids, filled by the look-ahead pass

    def scores(self, state, h):
        # scores K, K-1, ... keep the router's own order under top-k
        return ranked_scores(self.trace[state.pos + h], self.layers[state.pos + h].num_experts)

    def next_token_scores(self, x):
        return None  # the look-ahead pass sees this forward pass only, not the next token's


def _ranked_scores(ids: list[int], experts: int, rows: int, device) -> torch.Tensor:
    """Scores K, K-1, ... for `ids` in order (0 elsewhere), one row per token; built in Python and made a
    tensor in one call (five tensor ops took 46 us per prediction, more than a learned predictor's call)."""
    scores = [0.0] * experts
    for rank, e in enumerate(ids):
        scores[e] = float(len(ids) - rank)
    return torch.tensor(scores, device=device).expand(rows, -1)


def _ranked_table(lists: list[list[int]], experts: int, device) -> tuple:
    """_ranked_scores of each of `lists`, as [1, E] views of one table made with a few tensor calls
    (lists of one length, as a batch-1 trace's routing is; others one by one)."""
    if not lists:
        return ()
    if len({len(ids) for ids in lists}) > 1:
        return tuple(_ranked_scores(ids, experts, 1, device) for ids in lists)
    ids = torch.tensor(lists, device=device)
    ranks = torch.arange(ids.shape[1], 0, -1, dtype=torch.float32, device=device).expand_as(ids)
    return torch.zeros(len(lists), experts, device=device).scatter_(1, ids, ranks).split(1)


class TraceOraclePredictor(Predictor):
    """A free, perfect predictor: replays the routing a resident run recorded (offload(...,
    trace=True)) on the same token stream, request by request and decode step by decode step.
    Batch-1 decode only, as traces are; a prefill is predicted as the experts its layer ran.
    A request's decode scores are built at its prefill, a few tensor calls per layer, so a decode
    prediction is a lookup: it shows the engine's own ceiling, and building them per call (46-55 us,
    at every layer) was a third of the stall there is to remove on a fast link with a tiny model."""

    name, horizons = "trace-oracle", (1, 2)
    stateless = False  # follows the recorded run step by step

    def __init__(self, layers, family, trace):
        super().__init__(layers, family, None)
        self.routing, self.request, self.step = trace, -1, -1
        starts = [start for start, _ in trace.prefills]
        self._ends = starts[1:] + [len(trace.steps)]  # per request, the first decode step after it
        self._decode: tuple | None = None  # ((request, device), per sparse layer its decode steps' [1, E] scores)
        self._last: tuple | None = None  # (the decode scores returned last, their experts ranked)

    def on_token(self, decoding):
        if not decoding:
            self.request += 1
            if self.request >= len(self.routing.prefills):
                raise ValueError(f"the routing trace holds {len(self.routing.prefills)} requests and this run has "
                                 "more: record the trace on the same token stream")
            self.step = self.routing.prefills[self.request][0] - 1
        else:
            self.step += 1

    def _decode_scores(self, target: int, device) -> tuple:
        """The [1, E] scores of the running request's decode steps for sparse layer `target`, by step from the
        request's start: built for the whole request at its first call (its prefill), on `device`."""
        key = (self.request, device)
        if self._decode is None or self._decode[0] != key:
            steps = self.routing.steps[self.routing.prefills[self.request][0]:self._ends[self.request]]
            self._decode = (key, [_ranked_table([step[pos].native for step in steps], layer.num_experts, device)
                                  for pos, layer in enumerate(self.layers)])
        return self._decode[1][target]

    def _native(self, target: int, rows: int, device) -> torch.Tensor:
        start = self.routing.prefills[self.request][0]
        decode = self._decode_scores(target, device)  # (built here at the prefill, outside the decode steps)
        if self.step < start:  # the prefill
            experts = self.layers[target].num_experts
            return _ranked_scores(self.routing.prefills[self.request][1][target], experts, rows, device)
        if rows != 1 or self.step >= self._ends[self.request]:
            raise ValueError("trace-oracle replays batch-1 decode steps of the recorded run: run the same "
                             "requests one at a time with the same number of new tokens")
        scores = decode[self.step - start]
        self._last = (scores, self.routing.steps[self.step][target].native)
        return scores

    def ranked(self, scores: torch.Tensor, budget: int) -> list[int]:
        """scheduler.ranked of `scores`, without its tensor calls where they are the decode scores returned last
        and hold at least `budget` experts (the recorded ones, ranked K, K-1, ...: their order is the ranking)."""
        if self._last is not None and scores is self._last[0] and budget <= len(self._last[1]):
            return list(self._last[1][:budget])
        return ranked(scores, budget)

    def scores(self, state, h):
        return self._native(state.pos + h, state.x.shape[0], state.x.device)

    def next_token_scores(self, x):
        if self.step + 1 >= self._ends[self.request]:
            return None  # the request ends here
        self.step += 1
        try:
            return self._native(0, x.shape[0], x.device)
        finally:
            self.step -= 1


class HybridPredictor(QuasiPredictor):
    """Speculating Experts' Hybrid-PF (arXiv:2603.19289): the estimator in high-drift layers, the quasi
    predictor elsewhere."""

    name, parts = "hybrid", ("default_vectors", "estimator")

    def __init__(self, layers, family, artifact, drift_layers):
        super().__init__(layers, family, artifact)
        self.drift_layers = set(drift_layers)  # decoder indices of the target layers
        self.estimator = EstimatorPredictor(layers, family, artifact)

    def scores(self, state, h):
        if self.layers[state.pos + 1].index in self.drift_layers:
            return self.estimator.scores(state, h)
        return super().scores(state, h)

    def next_token_scores(self, x):
        return self.estimator.next_token_scores(x)  # (the quasi state does not reach across the token boundary)


PREDICTORS = {p.name: p for p in (GatePredictor, QuasiPredictor, EstimatorPredictor, AdapterPredictor,
                                   SharedAdapterPredictor, FrequencyPredictor, OraclePredictor, TraceOraclePredictor)}
NEEDS_ARTIFACT = {"quasi", "estimator", "adapter", "adapter-shared", "frequency", "hybrid"}
