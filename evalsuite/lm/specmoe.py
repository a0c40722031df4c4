"""`specmoe` and `specmoe-vlm`: lm-eval's HF models with their experts offloaded by the engine.

Every argument of lm-eval's `hf` (text) or `hf-multimodal` (vision-language) model keeps
working; the engine's options are extra model_args. lm-eval hands the model all tasks'
requests at once, interleaved; these adapters run each task's requests as their own group, so
the engine's measurements are attributed to the task that caused them.

On a device other than the CPU, or with `store=disk`, the model is never loaded whole: it is built
with its experts on the meta device and only its non-expert weights are read onto the device
(evalsuite.engine.placement.loading), so a model larger than the device (and, with the disk store, than host
memory) runs. `pretrained` may be a Hugging Face Hub id, resolved through the local cache.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.hf_vlms import HFMultimodalLM
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import get_dtype
from tqdm import tqdm

from ..engine import offload
from ..engine.config import EngineConfig, check_device
from ..engine.placement.loading import load_skeleton
from ..engine.metrics import EngineRecord, merge_scores
from ..engine.modes import MODES
from ..hub import local_model
from ..predict import fingerprint
from .dropping import batch_one_length, eos_ids, generate_dropping_ended, plain_cache
from .engine_metrics import TASK_SUMMARIES, GeneratedText

ENGINE_ARGS = EngineConfig.model_args()  # model_args the engine takes (a list's items separated by ';')
LM_EVAL_DEFAULT_DEVICE = "cuda:0"  # lm_eval's EvaluatorConfig default
# what lm-eval hands its loader that does not change the weights; any other loading option (peft, delta,
# parallelize, quantization, gguf_file, from_pretrained keywords) acts on from_pretrained, which a model built
# without its experts never calls
LOADER_IGNORED = ("revision", "trust_remote_code", "gpus", "max_memory_per_gpu", "max_cpu_memory", "offload_folder")


def check_engine_args(args: dict) -> None:
    """The engine's model_args checked as an EngineConfig, before any model is loaded."""
    try:
        EngineConfig(**args)
    except ValueError as exc:
        raise ValueError(f"specmoe: {exc}") from None


class RowContext(str):
    """A request's context text that carries the request's position. lm-eval sorts and batches requests itself;
    the texts its encoder is handed name the rows of the batch, so each row's engine metrics reach its sample."""

    def __new__(cls, text: str, position: int | None = None):
        made = super().__new__(cls, text)
        made.position = position
        return made


def _with_row_context(request, position: int):
    """A copy of an lm-eval request whose context carries its position (the caller's request is left as it is)."""
    context, *rest = request.args
    return dataclasses.replace(request, arguments=(RowContext(context, position), *rest))


class EngineAdapter:
    """What both adapters add to their lm-eval base class: the engine, metrics per task and per sample."""

    def _start(self, pretrained, kwargs: dict, mode, cache_capacity, experts_implementation):
        """Before lm-eval's __init__ loads anything: the checked engine options, the device, and the model's
        local directory (a Hub id resolved); decides whether the model is loaded without its experts."""
        self.engine_args = _engine_args(kwargs, mode, cache_capacity)
        self.experts_implementation = experts_implementation
        self.engine = None
        # off the CPU, or with the disk store, the experts must never be read whole
        self.builds_without_experts = (torch.device(kwargs["device"]).type != "cpu"
                                       or self.engine_args.get("store") == "disk")
        if isinstance(pretrained, str):
            pretrained = local_model(pretrained, kwargs.get("revision"), flag="pretrained=DIR")
        return pretrained

    def _create_model(self, pretrained, dtype="auto", **kwargs) -> None:
        """lm-eval's loader, or (see builds_without_experts) the model built with its experts on the meta device
        and offloaded at once, so that lm-eval's later `model.to(device)` finds only device tensors."""
        if not self.builds_without_experts:
            return super()._create_model(pretrained, dtype=dtype, **kwargs)
        given = [name for name, value in kwargs.items() if value and name not in LOADER_IGNORED]
        if given:
            raise ValueError(f"specmoe: {given[0]}= cannot be applied to a model loaded without its experts "
                             f"(device={self.device} or store=disk); leave it out, or use device=cpu with store=host")
        self._model = load_skeleton(pretrained, self._dtype(dtype), self.device, self.AUTO_MODEL_CLASS)
        self._offload()

    def _dtype(self, dtype) -> torch.dtype:
        """lm-eval's dtype; 'auto' is the checkpoint's own (its config's dtype), float32 where it names none."""
        dtype = get_dtype(dtype)
        if dtype != "auto":
            return dtype
        named = getattr(self.config, "dtype", None) or getattr(self.config.get_text_config(), "dtype", None)
        return get_dtype(named) if isinstance(named, str) else (named or torch.float32)

    def _offload(self) -> None:
        if self.engine is not None:  # offloaded while loading (builds_without_experts)
            return
        # The engine reproduces the eager kernel bit for bit; compare with `hf` running eager too.
        self.model.set_experts_implementation(self.experts_implementation)
        self.engine = offload(self.model, device=self.device, **self.engine_args)
        self.records: dict[str, EngineRecord] = defaultdict(EngineRecord)
        self.shadow_records: dict[str, ShadowRecord] = defaultdict(ShadowRecord)  # with shadows=...
        self._batch_positions: list | None = None  # the requests in the batch being encoded, row by row
        self._batch_texts: list[str] | None = None  # their contexts
        self.answering: int | None = None  # row_predictors: the group whose stored generations lm-eval gets
        self.answers: dict[int, list] = defaultdict(list)  # group -> [(context, generated)], batch by batch
        self._plain_cache: bool | None = None  # whether ended rows can leave a batch (evalsuite.lm.dropping)
        self.generated_lengths: dict[str, int] = {}  # context -> tokens its batch-1 generation made (with shadows)
        self.length_hints: dict[str, int] | None = None  # see `_in_batches`

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        """lm-eval's generation; with shadow predictors, each row's steps are cut where its batch-1
        generation would have stopped (lm-eval stops a batch only once every row met its stop sequence).
        With `row_predictors`, the batch is generated once per predictor in one call (see `answer_as`)."""
        if self.answering is not None:
            return self._answer(context)
        groups = len(self.engine_args.get("row_predictors") or ()) or 1
        if groups > 1:
            generation_kwargs["attention_mask"] = generation_kwargs["attention_mask"].repeat(groups, 1)
        if self._drops_ended_rows(context.shape[0] * groups, generation_kwargs):
            generation_kwargs.pop("do_sample", None), generation_kwargs.pop("temperature", None)
            out, lengths = generate_dropping_ended(self.model, self.engine, self.tokenizer, context.repeat(groups, 1),
                                                   max_length=max_length, stop=stop, groups=groups,
                                                   pad=self.tokenizer.pad_token_id, do_sample=False, **generation_kwargs)
            self._note_lengths(lengths, groups)
            self._name_batch_rows()
            if self.engine.shadows is not None:
                self.engine.shadows.end_request([n - 1 for n in lengths])
        else:
            out = super()._model_generate(context.repeat(groups, 1), max_length, stop, **generation_kwargs)
            self._note_lengths(self._cut_rows(out[:, context.shape[1]:], stop), groups)
            self._name_batch_rows()
        rows = context.shape[0]
        for group in range(1, groups):
            self.answers[group].append((context, out[group * rows:(group + 1) * rows]))
        return out[:rows]

    def _drops_ended_rows(self, rows: int, generation_kwargs: dict) -> bool:
        """Whether this batch is generated with its ended rows leaving it (evalsuite.lm.dropping): a pass of the
        plan (its shadows record every sequence; a measured run keeps lm-eval's generation, so that its TPOT is
        per step of the whole batch like every other measured mode's), greedy, several rows, a plain key/value
        cache, and an engine that neither moves experts nor traces."""
        greedy = not generation_kwargs.get("do_sample") and not generation_kwargs.get("temperature")
        engine = self.engine
        if not (greedy and rows > 1 and engine.shadows is not None and engine.cache is None and engine.tracer is None):
            return False
        if self._plain_cache is None:
            self._plain_cache = plain_cache(self.model)
        return self._plain_cache

    def answer_as(self, group: int | None) -> None:
        """With `row_predictors` (speculative, every expert kept): each batch is generated once for every
        predictor in one call, row group g executing predictor g (a speculative decision is per token, so a row
        does not depend on the others). lm-eval then scores group 0; after `answer_as(g)` the same evaluation
        gets group g's generations back, batch for batch, instead of generating. None: generate again."""
        self.answering = group

    def _answer(self, context):
        stashed, out = self.answers[self.answering].pop(0)
        if not torch.equal(stashed, context):
            raise RuntimeError("specmoe: a row group's evaluation asked for other batches than the generation made")
        return out

    def _model_multimodal_generate(self, inputs, max_length, stop, **generation_kwargs):
        out = super()._model_multimodal_generate(inputs, max_length, stop, **generation_kwargs)
        self._name_batch_rows()
        self._cut_rows(out[:, inputs["input_ids"].shape[1]:], stop)
        return out

    def _cut_rows(self, generated: torch.Tensor, stop: list[str]) -> list[int] | None:
        """With shadows: each row's steps cut at its batch-1 end; returns the rows' batch-1 lengths."""
        if self.engine.shadows is None:
            return None
        eos = eos_ids(self.model)
        tokenizer = getattr(self, "tokenizer", None) or self.processor.tokenizer
        lengths = [batch_one_length(tokenizer, row, stop, eos) for row in generated.tolist()]
        self.engine.shadows.end_request([n - 1 for n in lengths])
        return lengths

    def _note_lengths(self, lengths: list[int] | None, groups: int) -> None:
        """Each context of the batch just generated -> its batch-1 length (the longest over row groups)."""
        texts = self._batch_texts or []
        if lengths is None or len(texts) * groups != len(lengths):
            return
        for row, text in enumerate(texts):
            self.generated_lengths[text] = max(lengths[row::len(texts)])

    def _in_batches(self, run, group: list, disable_tqdm: bool) -> list:
        """lm-eval's generation of `group`, one call per batch, the requests ordered by `length_hints` (how long
        another pass's generation of each context ran, longest first): a batch runs as long as its longest row,
        so batching rows of like length saves steps (lm-eval orders by context length). Each row's tokens are
        its own, whatever its batch (a speculative pass; the plan's tests check batch = batch 1)."""
        hints, size = self.length_hints, self.batch_size
        if not hints or not isinstance(size, int) or size < 2 or len(group) <= size:
            return run(group, disable_tqdm=disable_tqdm)
        longest = max(hints.values())
        order = sorted(range(len(group)), key=lambda i: -hints.get(str(group[i].args[0]), longest + 1))
        results = [None] * len(group)
        for start in tqdm(range(0, len(order), size), disable=disable_tqdm, desc="Running generate_until batches"):
            chunk = order[start:start + size]
            for i, out in zip(chunk, run([group[i] for i in chunk], disable_tqdm=True)):
                results[i] = out
        return results

    def generate_until(self, requests, disable_tqdm: bool = False):
        return self._by_task(super().generate_until, requests, disable_tqdm, per_sample=True)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return self._by_task(super().loglikelihood, requests, disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return self._by_task(super().loglikelihood_rolling, requests, disable_tqdm)

    def _by_task(self, run, requests, disable_tqdm, per_sample: bool = False):
        """Run each task's requests as a group. `per_sample` (generating requests): name each batch row after its
        request, and hand each response back with its row's engine metrics (GeneratedText), which lm-eval keeps
        with the request's sample (loglikelihood requests have no decode tokens to score recall on, and lm-eval
        may answer several of them with one row)."""
        groups = defaultdict(list)
        for position, request in enumerate(requests):
            groups[request.task_name].append(position)
        results = [None] * len(requests)
        for task, positions in groups.items():
            # each task starts from a cold cache, so its engine metrics do not depend on what ran before
            self.engine.clear_cache()
            self.engine.take_record()  # whatever ran before belongs to no task
            group = [_with_row_context(requests[p], p) if per_sample else requests[p] for p in positions]
            outputs = self._in_batches(run, group, disable_tqdm) if per_sample else run(group, disable_tqdm=disable_tqdm)
            record = self.engine.take_record()
            self.records[task].merge(record)
            if self.engine.shadows is not None:
                self.shadow_records[task].merge(*self.engine.take_shadows())
            for p, out in zip(positions, outputs):
                results[p] = out
            for position, metrics in record.per_row():
                results[position] = GeneratedText(results[position], metrics)
        return results

    def _note_batch(self, contexts) -> None:
        """The batch about to be generated: which request each row is (None for a text that is no RowContext)."""
        self._batch_positions = [getattr(context, "position", None) for context in contexts]
        self._batch_texts = [str(context) for context in contexts]

    def _name_batch_rows(self) -> None:
        """After a batch's generation: its rows named in the engine's record (its latest request)."""
        positions, self._batch_positions = self._batch_positions, None
        if positions and None not in positions:
            self.engine.record.label_last_request(positions)

    def tok_batch_encode(self, strings, *args, **kwargs):
        self._note_batch(strings)
        return super().tok_batch_encode(strings, *args, **kwargs)

    def engine_summaries(self) -> dict[str, dict]:
        """Per task: the engine's summary (see evalsuite.engine.metrics) and configuration."""
        describe = self.engine.describe()
        by_construction = MODES[self.engine.mode].speculates
        return {task: {**record.summary(precision_by_construction=by_construction), **describe}
                for task, record in self.records.items()}

    def fingerprint(self) -> str:
        """A hash of the model's configuration and router weights (see evalsuite.predict)."""
        return fingerprint(self.model, self.engine.layers)

    def get_model_info(self) -> dict:
        """lm-eval merges this into results["config"]: the engine's configuration (as asked and as run, and the
        model's fingerprint), and the per-task engine summaries that `add_engine_metrics` moves into the results."""
        from .runs import engine_config  # the cache and store the engine runs with

        info = super().get_model_info()
        info["evalsuite_engine"] = {**{k: str(v) for k, v in self.engine_args.items()}, **self.engine.describe(),
                                    **engine_config(self.engine), "model_fingerprint": self.fingerprint()}
        info[TASK_SUMMARIES] = self.engine_summaries()
        return info


class ShadowRecord:
    """A task's shadow predictors: their scores (predictor -> metric -> k -> layer -> per sample, as
    EngineRecord.scores) and its sequences."""

    def __init__(self):
        self.scores: dict = {}
        self.sequences: list = []

    def merge(self, scores: dict, sequences: list) -> "ShadowRecord":
        for name, table in scores.items():
            merge_scores(self.scores.setdefault(name, {}), table)
        self.sequences += sequences
        return self


def _engine_args(kwargs: dict, mode, cache_capacity) -> dict:
    """The engine's model_args taken out of `kwargs` (lists as lists), checked as an EngineConfig."""
    try:
        parsed = EngineConfig.parse_model_args({k: kwargs.pop(k) for k in ENGINE_ARGS if k in kwargs})
    except ValueError as exc:
        raise ValueError(f"specmoe: {exc}") from None
    engine_args = {k: list(v) if isinstance(v, tuple) else v for k, v in parsed.items()}
    # lm-eval parses model_args: '0.25' arrives as 0.25, '8' as 8, '512MiB' and 'all' as text
    engine_args.update(mode=mode, cache_capacity=cache_capacity)
    check_engine_args(engine_args)
    # lm-eval's command fills in device=cuda:0 when --device is not given, and its hf model then runs on the CPU
    # where there is no GPU; any other device this machine lacks (device=cuda) is one line, before anything loads
    if kwargs.get("device") is None or (kwargs["device"] == LM_EVAL_DEFAULT_DEVICE and not torch.cuda.is_available()):
        kwargs["device"] = "cpu"
    try:
        check_device(kwargs["device"])
    except ValueError as exc:
        raise ValueError(f"specmoe: {exc}") from None
    return engine_args


@register_model("specmoe")
class SpecMoELM(EngineAdapter, HFLM):
    """model_args: pretrained, the engine's options (EngineConfig.model_args(); lists separated by ';':
    `recall_k=1;2;8`), plus every HFLM argument."""

    def __init__(self, pretrained, mode: str = "on-demand", cache_capacity=0.5, experts_implementation="eager",
                 **kwargs):
        pretrained = self._start(pretrained, kwargs, mode, cache_capacity, experts_implementation)
        super().__init__(pretrained=pretrained, **kwargs)
        self._offload()


@register_model("specmoe-vlm")
class SpecMoEVLM(EngineAdapter, HFMultimodalLM):
    """The vision-language counterpart (lm-eval's hf-multimodal): same engine model_args, plus
    every hf-multimodal argument. Metrics are also split by token kind (image vs text)."""

    def __init__(self, pretrained, mode: str = "on-demand", cache_capacity=0.5, experts_implementation="eager",
                 **kwargs):
        pretrained = self._start(pretrained, kwargs, mode, cache_capacity, experts_implementation)
        if self.engine_args.get("row_predictors"):  # its image inputs are not repeated once per row group
            raise ValueError("specmoe-vlm: row_predictors is for text models; run each speculative predictor "
                             "on its own (predictor=NAME)")
        super().__init__(pretrained=pretrained, **kwargs)
        self._offload()

    def tok_batch_multimodal_encode(self, strings, *args, **kwargs):
        self._note_batch(strings)
        return super().tok_batch_multimodal_encode(strings, *args, **kwargs)
