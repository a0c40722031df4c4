"""Prediction: which experts the next sparse layers will want, and what the engine does with the guess.

registry.py          predictors register here by name (evalsuite.predict fills it); a checkpoint's own artifact
driver.py            PredictionDriver: at each sparse layer, score the last prediction, speculate or prefetch
scheduler.py         PrefetchScheduler: which candidates are worth a copy, and in what order
worth.py             whether a prediction is worth making now, or can be put off until its request ends
put_off.py           predictions (and whole decode tokens) put off until their request ends
request_recall.py    a request's recall@k, exact@K and next-token recall, once it ends
prompt_precision.py  prefetch precision counted per prompt row
shadows.py           predictors scored beside a run without acting on it
row_groups.py        several predictors in one batched generation, one per group of rows
"""
from evalsuite.engine.prediction.registry import (ARTIFACT_FILE, PREDICTORS, PredictorKind, artifact_beside,
                                                  experts_in, ranked_scores, register_predictor,
                                                  register_predictor_family)

__all__ = ["ARTIFACT_FILE", "PREDICTORS", "PredictorKind", "artifact_beside", "experts_in", "ranked_scores",
           "register_predictor", "register_predictor_family"]
