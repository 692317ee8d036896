"""Scoring functions: the LongBench metrics (as defined in ../shared/longbench/README.md) and exact match.

Every metric has the signature ``metric(prediction, reference, all_classes=None) -> float in [0, 1]`` and scores
one prediction against one reference; :func:`score` takes the maximum over a sample's references, as LongBench does.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Optional, Sequence

# Chinese punctuation LongBench's normalize_zh_answer removes, plus the ASCII set.
_ZH_PUNCTUATION = set(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
) | set(string.punctuation)
_EN_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")


def normalize_answer(text: str) -> str:
    """Lowercase, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace (SQuAD style)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _EN_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Lowercase, drop Chinese and ASCII punctuation, drop all whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _ZH_PUNCTUATION)
    return "".join(text.split())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when either is empty or nothing overlaps)."""
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, all_classes=None) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh(prediction: str, reference: str, all_classes=None) -> float:
    # Character tokens instead of jieba words: no segmenter dependency, and stable across jieba versions.
    return token_f1(list(normalize_zh_answer(prediction)), list(normalize_zh_answer(reference)))


def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence, O(len(a) * len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """ROUGE-L F-measure (beta = 1): harmonic mean of LCS precision and recall."""
    if not prediction_tokens or not reference_tokens:
        return 0.0
    lcs = lcs_length(prediction_tokens, reference_tokens)
    if lcs == 0:
        return 0.0
    precision = lcs / len(prediction_tokens)
    recall = lcs / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def rouge(prediction: str, reference: str, all_classes=None) -> float:
    # Lowercased whitespace tokens; sentence-level LCS (not the summary-level union-LCS variant).
    return rouge_l_f1(prediction.lower().split(), reference.lower().split())


def rouge_zh(prediction: str, reference: str, all_classes=None) -> float:
    return rouge_l_f1(list(normalize_zh_answer(prediction)), list(normalize_zh_answer(reference)))


def classification(prediction: str, reference: str, all_classes: Optional[Sequence[str]] = None) -> float:
    """1/len(matches) when the reference label is among the labels found in the prediction, else 0.

    A label that only occurs because it is a substring of the reference label (e.g. "location" inside
    "other location") is dropped, so the exact label wins.
    """
    if not all_classes:
        raise ValueError("classification: all_classes must be a non-empty list of labels, got "
                         f"{all_classes!r}")
    matches = [label for label in all_classes if label in prediction]
    matches = [label for label in matches if not (label in reference and label != reference)]
    return 1.0 / len(matches) if reference in matches else 0.0


def _number_share(prediction: str, target: str) -> float:
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == target) / len(numbers)


def _retrieval(pattern: str, prediction: str, reference: str) -> float:
    match = re.search(pattern, reference)
    if match is None:
        raise ValueError(f"retrieval: reference must look like {pattern!r}, got {reference!r}")
    return _number_share(prediction, match.group(1))


def retrieval(prediction: str, reference: str, all_classes=None) -> float:
    return _retrieval(r"Paragraph (\d+)", prediction, reference)


def retrieval_zh(prediction: str, reference: str, all_classes=None) -> float:
    return _retrieval(r"段落(\d+)", prediction, reference)


def count(prediction: str, reference, all_classes=None) -> float:
    return _number_share(prediction, str(reference).strip())


def indel_ratio(a: str, b: str) -> float:
    """Normalized InDel similarity in [0, 1]: 2 * LCS / (len(a) + len(b)); rapidfuzz's fuzz.ratio / 100."""
    if not a and not b:
        return 1.0
    return 2.0 * lcs_length(a, b) / (len(a) + len(b))


def code_sim(prediction: str, reference: str, all_classes=None) -> float:
    """Fuzzy ratio of the first line of the prediction that is not a comment or a code fence."""
    first_code_line = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first_code_line = line
            break
    return indel_ratio(first_code_line, reference)


_WORD_CHARS = r"[0-9A-Za-z_\-]"


def contains_all(prediction: str, reference: str, all_classes=None) -> float:
    """Exact match for the synthetic tasks: 1 if every ``|``-separated value occurs in the prediction as a whole
    word (case-insensitive; "12345" does not match inside "123456"), else 0."""
    lowered = prediction.lower()
    for value in reference.split("|"):
        pattern = rf"(?<!{_WORD_CHARS}){re.escape(value.lower())}(?!{_WORD_CHARS})"
        if re.search(pattern, lowered) is None:
            return 0.0
    return 1.0


def phrase_recall(prediction: str, reference: str, all_classes=None) -> float:
    """The fraction of the ``|``-separated phrases of ``reference`` that occur in the prediction
    (case-insensitive, runs of whitespace matched as one space): the needle-in-a-haystack test's score, without
    the LLM judge of the original (see ``ripplekv_ext.eval.needle``)."""
    lowered = " ".join(prediction.lower().split())
    phrases = [" ".join(p.lower().split()) for p in reference.split("|")]
    return sum(1 for p in phrases if p in lowered) / len(phrases)


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge": rouge,
    "rouge_zh": rouge_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
    "contains_all": contains_all,
    "phrase_recall": phrase_recall,
}


def get_metric(name: str) -> Callable[..., float]:
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {name!r}") from None


def score(metric: str, prediction: str, answers: Sequence[str],
          all_classes: Optional[Sequence[str]] = None) -> float:
    """A sample's score: the best score of ``prediction`` over its reference ``answers``."""
    if isinstance(answers, str) or len(answers) == 0:
        raise ValueError(f"answers must be a non-empty list of strings, got {answers!r}")
    fn = get_metric(metric)
    return max(fn(prediction, answer, all_classes) for answer in answers)
