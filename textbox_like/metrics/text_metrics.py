"""ROUGE and BLEU of generated text, as sums that add over batches and ranks.

A task's stats are sums (see ``Task.loss``/``Task.metrics`` in tasks/base.py):
the trainer adds them over micro-batches, updates and ranks, then asks the
task for metrics once. Generation metrics follow the same contract, so a
validation split over ranks in unlike pieces scores exactly as one process
over the whole split:

- ROUGE (TextBox's ``rouge``): the SUM over samples of rouge_score's per-sample
  F-measure, and the sample count; the metric is their mean, as TextBox
  averages per-sample scores.
- BLEU (TextBox's ``bleu``): sacreBLEU's sufficient statistics (matched and
  total n-grams for n = 1..4, hypothesis and reference lengths), which are
  sums over segments; the metric is sacreBLEU's own ``BLEU.compute_bleu`` on
  their totals, i.e. corpus BLEU, not a mean of sentence BLEUs.

The libraries are imported inside the functions: task modules are imported to
build the command line, which must stay fast.
"""
from __future__ import annotations

from functools import lru_cache

from textbox_like.core.errors import unknown

#: TextBox's ``--metrics`` names (lowercase) -> the metrics each reports, by
#: the names ``--metrics_for_best_model`` takes; all on TextBox's 0-100 scale
GENERATION_METRICS = {
    "rouge": ("ROUGE-1", "ROUGE-2", "ROUGE-L"),
    "bleu": ("BLEU",),
}

#: the reported ROUGE metric -> rouge_score's type. ROUGE-L is the summary-level
#: LCS (``rougeLsum``), as ROUGE-1.5.5 (files2rouge, TextBox's default) scores
#: it and as TextBox's own ``rouge-score`` path does: a text's sentences are
#: its lines. On one-line texts it equals sentence-level ``rougeL``.
ROUGE_TYPES = {"ROUGE-1": "rouge1", "ROUGE-2": "rouge2", "ROUGE-L": "rougeLsum"}

#: BLEU's n-gram orders (sacreBLEU's default, and BLEU-4 as TextBox reports it)
BLEU_MAX_ORDER = 4

#: the sums' keys: prefixed so they never meet a task's own ``loss_sum``/``nsamples``
NSAMPLES_KEY = "gen_nsamples"
ROUGE_KEYS = {metric: f"gen_{rouge_type}_fmeasure_sum" for metric, rouge_type in ROUGE_TYPES.items()}
BLEU_SYS_LEN_KEY = "gen_bleu_sys_len"
BLEU_REF_LEN_KEY = "gen_bleu_ref_len"
BLEU_CORRECT_KEYS = tuple(f"gen_bleu_correct_{n}" for n in range(1, BLEU_MAX_ORDER + 1))
BLEU_TOTAL_KEYS = tuple(f"gen_bleu_total_{n}" for n in range(1, BLEU_MAX_ORDER + 1))


def _metric_names(metrics) -> tuple:
    """``metrics`` as GENERATION_METRICS keys (TextBox writes them lowercase;
    any case is taken); an unknown name is the user's mistake: UserError."""
    if isinstance(metrics, str):
        metrics = (metrics,)
    names = []
    for metric in metrics:
        name = str(metric).lower()
        if name not in GENERATION_METRICS:
            raise unknown("--metrics name", metric, GENERATION_METRICS)
        if name not in names:
            names.append(name)
    return tuple(names)


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer
    # Porter stemming as ROUGE-1.5.5's -m and TextBox (stemming=True); no
    # split_summaries: that needs nltk's punkt data, a download
    return rouge_scorer.RougeScorer(list(ROUGE_TYPES.values()), use_stemmer=True)


@lru_cache(maxsize=1)
def _bleu():
    from sacrebleu.metrics import BLEU
    # sacreBLEU's defaults (13a tokenizer, exp smoothing, cased), those of
    # sacrebleu.corpus_bleu and TextBox's sacrebleu path
    return BLEU(max_ngram_order=BLEU_MAX_ORDER)


def generation_sums(predictions: list[str], references: list[str],
                    metrics=("rouge", "bleu")) -> dict[str, float]:
    """Sums over these samples (one reference each) that add over batches and
    ranks; ``generation_metrics`` turns their totals into metrics."""
    names = _metric_names(metrics)
    predictions, references = list(predictions), list(references)
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references: "
                         "give one reference per prediction")
    sums = {NSAMPLES_KEY: float(len(predictions))}
    if "rouge" in names:
        fmeasures = dict.fromkeys(ROUGE_TYPES, 0.0)
        scorer = _rouge_scorer() if predictions else None
        for prediction, reference in zip(predictions, references):
            scores = scorer.score(reference, prediction)  # (target, prediction)
            for metric, rouge_type in ROUGE_TYPES.items():
                fmeasures[metric] += scores[rouge_type].fmeasure
        sums.update({ROUGE_KEYS[metric]: value for metric, value in fmeasures.items()})
    if "bleu" in names:
        if predictions:
            # sacreBLEU's public corpus score carries the corpus's sufficient statistics
            score = _bleu().corpus_score(predictions, [references])
            counts, totals = score.counts, score.totals
            sys_len, ref_len = score.sys_len, score.ref_len
        else:  # sacreBLEU cannot score an empty corpus; its statistics are zeros
            counts = totals = [0] * BLEU_MAX_ORDER
            sys_len = ref_len = 0
        sums[BLEU_SYS_LEN_KEY] = float(sys_len)
        sums[BLEU_REF_LEN_KEY] = float(ref_len)
        sums.update({key: float(value) for key, value in zip(BLEU_CORRECT_KEYS, counts)})
        sums.update({key: float(value) for key, value in zip(BLEU_TOTAL_KEYS, totals)})
    return sums


def generation_metrics(sums: dict, metrics=("rouge", "bleu")) -> dict[str, float]:
    """The metrics (0-100) from ``generation_sums`` added over batches and
    ranks; no samples give 0."""
    names = _metric_names(metrics)
    out = {}
    if "rouge" in names:
        n = sums.get(NSAMPLES_KEY, 0.0)
        for metric, key in ROUGE_KEYS.items():
            out[metric] = 100.0 * sums.get(key, 0.0) / n if n > 0 else 0.0
    if "bleu" in names:
        from sacrebleu.metrics import BLEU
        bleu = _bleu()
        # the statistics are whole numbers carried as floats (the trainer sums in float64)
        score = BLEU.compute_bleu(
            correct=[round(sums.get(key, 0.0)) for key in BLEU_CORRECT_KEYS],
            total=[round(sums.get(key, 0.0)) for key in BLEU_TOTAL_KEYS],
            sys_len=round(sums.get(BLEU_SYS_LEN_KEY, 0.0)),
            ref_len=round(sums.get(BLEU_REF_LEN_KEY, 0.0)),
            smooth_method=bleu.smooth_method, smooth_value=bleu.smooth_value,
            effective_order=bleu.effective_order, max_ngram_order=bleu.max_ngram_order)
        out["BLEU"] = score.score
    return out
