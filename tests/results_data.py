"""Constructed runs for the results-store tests."""
from evalsuite.results import ResultsDB


def open_db(tmp_path, name="results.db") -> ResultsDB:
    return ResultsDB(f"sqlite:///{tmp_path / name}")


def make_run(db, *, mode="resident", predictor=None, model="tiny:qwen3_moe", task="arith", correct=(1, 0, 1, 1),
             predictions=None, tpot_ms=10.0, recall=None, hit_rate=0.5, cache_capacity=0.5, layer_recall=None,
             k=2, status="complete", metric="exact_match", sample_recall=None, limit=None, expert_bits=None) -> int:
    """A finished run with one task: binary per-sample scores, a whole-model engine row and optional per-layer recall
    (and each sample's own recall@k, `sample_recall`)."""
    run_id = db.start_run({"model": model, "mode": mode, "predictor": predictor, "cache_capacity": cache_capacity,
                           "cache_policy": "lru", "seed": 1234, **({"limit": limit} if limit is not None else {}),
                           **({"expert_bits": expert_bits} if expert_bits is not None else {})})
    predictions = predictions or [f"answer {i}" for i in range(len(correct))]
    samples = [{"doc_id": i, "metric": metric, "filter": "none", "score": float(c), "correct": bool(c),
                "prediction": p, "target": f"answer {i}"} for i, (c, p) in enumerate(zip(correct, predictions))]
    for sample, own in zip(samples, sample_recall or []):
        sample.update(recall_at_k=own, k=k, recall_per_layer={"1": own})
    accuracy = sum(correct) / len(correct)
    engine = [{"layer": None, "k": k, "recall_at_k": recall, "hit_rate": hit_rate, "tpot_ms": tpot_ms,
               "ttft_ms": 5 * tpot_ms, "tokens": 100}]
    engine += [{"layer": layer, "k": k, "recall_at_k": value} for layer, value in enumerate(layer_recall or [])]
    db.add_task(run_id, task, [{"metric": metric, "filter": "none", "value": accuracy, "stderr": 0.01,
                                "n": len(correct)}], engine, samples)
    db.finish_run(run_id, status)
    return run_id
