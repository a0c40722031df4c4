"""Recall@k of an expert predictor against the native router (SpecPrefetch's definition, see evalsuite.engine.metrics):
per token, |top-k(predicted scores) ∩ native top-K experts| / K, averaged over the tokens given.

    recall.compute(predictions=[[0.1, 2.3, 0.7, 1.5], ...], references=[[1, 3], ...], k=2)   # {"recall@2": ...}

Give one layer's tokens of one sample to get the number evalsuite reports per layer and sample. The
implementation is the function the engine scores its predictions with (evalsuite.engine.metrics.token_recall).
"""
import datasets
import evaluate
import torch

from evalsuite.engine.metrics import token_recall

INPUTS = """
predictions: per token, the predictor's score for every expert of the layer.
references: per token, the experts the native router chose (its top-K).
k: the predicted experts counted, an int or a list of ints (default K, the router's own top-k).
Returns {"recall@k": mean over tokens} for each k.
"""


class ExpertRecall(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__, citation="", inputs_description=INPUTS,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("float32")),
                                        "references": datasets.Sequence(datasets.Value("int64"))}))

    def _compute(self, predictions, references, k=None):
        scores, native = torch.tensor(predictions), torch.tensor(references)
        ks = [native.shape[1]] if k is None else [k] if isinstance(k, int) else list(k)
        return {f"recall@{n}": token_recall(scores, native, n).mean().item() for n in ks}
