"""Benchmark: what router-preserving prediction costs decoding on a link where prefetching cannot pay.

On a fast link (pcie4) a tiny model's expert copies in ~0.02 ms and on-demand loading stalls a few
hundredths of a millisecond a token, so router-preserving TPOT over on-demand TPOT is the prediction
driver's own work at every sparse layer, 1-3 % of a 3-4 ms token. `evalsuite bench` repeats are ~10 s
each and their ranges span 0.7-1.6 on these machines, which cannot resolve that; this runs many short
generations instead (a fresh engine each, 32 tokens; with --warm its second request, after one of other
random ids and an emptied cache), the cases interleaved in a rotating order, and
reports per predictor the median over repeats of the ratio within a repeat, its interquartile range and
a bootstrap 95 % confidence interval of that median (scipy.stats.bootstrap). A second on-demand case, run
like the others, is reported the same way first: what the machine's noise alone makes of a ratio that is 1.
With --by-token N it also says where in the request the time over on-demand's goes: per decode step, the
median over repeats of the step's time less on-demand's at the same step, summed over the first N steps (a new
engine's verdicts judged the first time) and averaged over the rest.

    python bench/driver_overhead.py --link pcie4 --capacities 0.1,0.25,0.5 --repeats 200
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from scipy.stats import bootstrap
from tqdm import tqdm

import evalsuite.predict  # noqa: F401  (registers the predictors)
from evalsuite.engine import offload
from evalsuite.generate import load_model
from evalsuite.perf.cli import _calibrated
from evalsuite.perf.decode import greedy, other_prompt, random_prompt, serve_earlier


AGAIN = "on-demand again"  # the control case: on-demand, run as one more case


def run_case(model, ids, tokens: int, capacity: float, link: str, predictor: str | None, artifact,
             earlier=None) -> tuple[float, np.ndarray]:
    """Median TPOT (ms) of one fresh engine's greedy generation, and its decode steps' times (ms); traced, as the
    bench runs it. With `earlier` (prompt ids) the engine serves that request first and empties its cache
    (`evalsuite bench --warm`)."""
    options = dict(mode="on-demand") if predictor in (None, AGAIN) else dict(
        mode="router-preserving", predictor=predictor, artifact=artifact)
    with offload(model, cache_capacity=capacity, link=link, trace=True, **options) as engine:
        if earlier is not None:
            serve_earlier(engine, model, earlier, tokens)
        greedy(model, ids, tokens)
        steps = np.diff(engine.record.requests[-1].ends) * 1e3
        return engine.stats()["tpot_ms"]["median"], steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/tiny-qwen3-moe")
    parser.add_argument("--link", default="pcie4")
    parser.add_argument("--capacities", default="0.1,0.25,0.5")
    parser.add_argument("--predictors", default="gate,quasi,adapter,estimator")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=20, help="calibration epochs for the trained predictors")
    parser.add_argument("--by-token", type=int, default=0, metavar="N", help="also the time over on-demand's "
                        "by decode step: summed over the first N steps and averaged over the rest")
    parser.add_argument("--warm", action="store_true", help="each engine serves another request first, as "
                        "`evalsuite bench --warm`; the second is measured")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the second core serves the link, as in `evalsuite bench --threads 1`
    predictors = args.predictors.split(",")
    model, _ = load_model(args.model)
    ids = random_prompt(model, 16)  # (a vision-language model's vocabulary is its text config's)
    earlier = other_prompt(model, None, ids) if args.warm else None  # (other random ids)
    artifact, unserved = _calibrated(args.model, predictors, args.epochs)
    if unserved:
        raise SystemExit(f"{', '.join(unserved)} need a trained model to calibrate on: pass --predictors without them")
    cases = [None, AGAIN, *predictors]
    for capacity in [float(c) for c in args.capacities.split(",")]:
        tpot: dict = {case: [] for case in cases}
        steps: dict = {case: [] for case in cases}
        run_case(model, ids, args.tokens, capacity, args.link, None, artifact, earlier)  # warm-up, not counted
        for r in tqdm(range(args.repeats), desc=f"{args.link} {capacity:g}", leave=False):
            for case in cases[r % len(cases):] + cases[:r % len(cases)]:  # each case first as often
                median, times = run_case(model, ids, args.tokens, capacity, args.link, case, artifact, earlier)
                tpot[case].append(median)
                steps[case].append(times)
        on_demand = tpot[None]
        print(f"{args.link}, cache {capacity:g}: on-demand TPOT median {statistics.median(on_demand):.3f} ms "
              f"over {args.repeats} repeats{', warm engines' if args.warm else ''}; router-preserving / on-demand "
              "within a repeat:")
        for predictor in [AGAIN, *predictors]:
            ratios = np.array(tpot[predictor]) / np.array(on_demand)
            q1, q3 = np.quantile(ratios, [0.25, 0.75])
            ci = bootstrap((ratios,), np.median, confidence_level=0.95, n_resamples=2000,
                           random_state=0).confidence_interval
            print(f"  {predictor:15s} median {np.median(ratios):.4f}  IQR {q1:.3f}-{q3:.3f}  "
                  f"95 % CI of the median {ci.low:.4f}-{ci.high:.4f}")
            if args.by_token:
                print_by_token(steps[predictor], steps[None], args.by_token)


def print_by_token(steps: list, on_demand: list, first: int) -> None:
    """Per decode step, the median over repeats of its time less on-demand's (the same repeat, the same step):
    summed over the `first` steps, averaged over the rest."""
    over = np.median(np.array(steps) - np.array(on_demand), axis=0) * 1e3  # us
    print(f"  {'':15s} by step: the first {first} {over[:first].sum():+.0f} us in all, "
          f"the {len(over) - first} after {over[first:].mean():+.1f} us each")


if __name__ == "__main__":
    main()
