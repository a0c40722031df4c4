"""Hardware profiles: what a device's memory, compute and expert link cost per decode token.

A profile is a YAML file (shipped ones live in evalsuite/perf/profiles/, with the sources of
their figures). Either rates, from which costs follow for any model shape:

    memory_bandwidth_gbs, peak_tflops, link: {bandwidth_gbs, latency_us},
    optional bandwidth_efficiency (share of peak bandwidth decode kernels reach, default 0.7),
    layer_overhead_us / expert_overhead_us / step_overhead_us (launch and dispatch costs)

or costs measured on one machine for one model (what `evalsuite bench --profile-out` writes):

    measured: {dense_ms, expert_ms, step_ms, transfer_ms, handoff_ms, lookup_ms, miss_ms, prefetch_ms,
               predictor_ms: {case: ms per prediction}, predictor_step_ms: {case: ms per step},
               predict_call_ms: {case: ms the engine's scheduler times a prediction at},
               put_off_ms: {case: ms it times a prediction put off at}}

    where a case is `<mode>/<predictor>` (router-preserving/gate, speculative/quasi), `hybrid` or
    `oracle prefetch`: a prediction costs what the mode does around it too.

At batch 1 a decode step reads every weight it uses once, so a part's time is
max(bytes / effective bandwidth, flops / peak) plus its fixed overhead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..engine.modes import MODES
from .shapes import ModelShape
from .simulate import Costs

PROFILE_DIR = Path(__file__).parent / "profiles"
WEIGHT_BYTES = 2  # bf16 predictor weights


@dataclass
class Profile:
    name: str
    memory_bandwidth_gbs: float | None = None
    peak_tflops: float | None = None
    link_bandwidth_gbs: float | None = None
    link_latency_us: float = 0.0
    bandwidth_efficiency: float = 0.7
    layer_overhead_us: float = 30.0
    expert_overhead_us: float = 10.0
    step_overhead_us: float = 100.0
    measured: dict | None = None
    sources: list = field(default_factory=list)


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(spec: str) -> Profile:
    """A shipped profile by name (see profile_names()) or a YAML file path."""
    path = PROFILE_DIR / f"{spec}.yaml" if (PROFILE_DIR / f"{spec}.yaml").exists() else Path(spec)
    if not path.exists():
        raise ValueError(f"unknown hardware profile {spec!r}: use one of {', '.join(profile_names())} or a YAML file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
        link = data.pop("link", None) or {}
        profile = Profile(**{k: v for k, v in data.items()},
                          link_bandwidth_gbs=link.get("bandwidth_gbs"), link_latency_us=link.get("latency_us", 0.0))
    except (yaml.YAMLError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a hardware profile ({exc}); see docs/performance.md") from exc
    if profile.measured is None and None in (profile.memory_bandwidth_gbs, profile.peak_tflops,
                                             profile.link_bandwidth_gbs):
        raise ValueError(f"{path}: a profile needs memory_bandwidth_gbs, peak_tflops and link.bandwidth_gbs, "
                         "or measured costs")
    return profile


def predictor_bytes(predictor: str | None, shape: ModelShape, rank: int = 64, hidden: int = 256, width: int = 64,
                    blocks: int = 2) -> int:
    """Weights one prediction reads (bf16): the next layer's gate plus the predictor's own (adapter-shared: its
    projection, one layer embedding, `blocks` residual MLP blocks of `width` and its head)."""
    if predictor in (None, "oracle", "frequency"):
        return 0
    gate = shape.hidden * shape.experts
    extra = {"gate": 0, "quasi": shape.top_k * shape.hidden + shape.hidden,
             "adapter": rank * (shape.hidden + shape.experts),
             "adapter-shared": width * (shape.hidden + shape.experts + 4) + blocks * (4 * width ** 2 + 5 * width)
             + shape.experts,
             "estimator": shape.hidden * hidden + hidden * shape.experts - gate,
             "hybrid": shape.hidden * hidden + hidden * shape.experts - gate}.get(predictor, 0)
    return (gate + extra) * WEIGHT_BYTES


def case_label(mode: str | None, predictor: str | None) -> str | None:
    """The bench's name for a (mode, predictor) case, which keys a measured profile's prediction costs."""
    if predictor is None:
        return None
    if predictor == "oracle":
        return "oracle prefetch"
    if mode is not None and MODES[mode].own_predictor:  # the mode names its one predictor
        return mode
    return f"{mode or 'router-preserving'}/{predictor}"


def costs(profile: Profile, shape: ModelShape | None = None, predictor: str | None = None,
          mode: str | None = None) -> Costs:
    """Per-token Costs of `shape` on `profile` (a measured profile ignores the shape); a measured
    profile prices the prediction of `mode` (default router-preserving) with `predictor`."""
    if profile.measured is not None:
        m = profile.measured
        label = case_label(mode, predictor)
        per_prediction = m.get("predictor_ms", {}).get(label, 0.0)  # {case: ms per prediction}
        per_step = m.get("predictor_step_ms", {}).get(label, 0.0)  # {case: ms per step} (an oracle's look-ahead)
        call = m.get("predict_call_ms", {}).get(label)  # {case: ms}: the scheduler's own timing of a prediction
        put_off = m.get("put_off_ms", {}).get(label, 0.0)  # {case: ms}: its timing of one put off
        return Costs(dense_s=m["dense_ms"] / 1e3, expert_s=m["expert_ms"] / 1e3, step_s=m["step_ms"] / 1e3,
                     transfer_s=m["transfer_ms"] / 1e3, predictor_s=per_prediction / 1e3,
                     predict_call_s=None if call is None else call / 1e3,
                     predictor_step_s=per_step / 1e3, put_off_s=put_off / 1e3, handoff_s=m.get("handoff_ms", 0.0) / 1e3,
                     lookup_s=m.get("lookup_ms", 0.0) / 1e3, miss_s=m.get("miss_ms", 0.0) / 1e3,
                     prefetch_s=m["prefetch_ms"] / 1e3 if "prefetch_ms" in m else None)
    bw = profile.memory_bandwidth_gbs * 1e9 * profile.bandwidth_efficiency
    flops = profile.peak_tflops * 1e12

    def read(nbytes: int, overhead_us: float) -> float:  # 2 flops per weight, bf16 weights
        return max(nbytes / bw, nbytes / WEIGHT_BYTES * 2 / flops) + overhead_us * 1e-6

    dense = shape.dense_layers * read(shape.dense_layer_bytes, profile.layer_overhead_us)
    pbytes = predictor_bytes(predictor, shape)
    return Costs(dense_s=read(shape.sparse_layer_bytes, profile.layer_overhead_us),
                 expert_s=read(shape.expert_bytes, profile.expert_overhead_us),
                 step_s=dense + read(shape.head_bytes, profile.step_overhead_us),
                 transfer_s=profile.link_latency_us * 1e-6 + shape.expert_bytes / (profile.link_bandwidth_gbs * 1e9),
                 predictor_s=read(pbytes, profile.expert_overhead_us) if pbytes else 0.0)
