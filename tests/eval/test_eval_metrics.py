"""The scoring metrics (ripplekv_ext.eval.metrics), on hand-worked examples and against independent implementations."""

import pytest
from hypothesis import given, settings, strategies as st

from ripplekv_ext.eval import metrics
from ripplekv_ext.eval.metrics import score


def test_qa_f1_hand_worked():
    # "The cat sat." -> [cat, sat]; "a cat sat on the mat" -> [cat, sat, on, mat]: P = 1, R = 1/2, F1 = 2/3.
    assert metrics.qa_f1("The cat sat.", "a cat sat on the mat") == pytest.approx(2 / 3)
    assert metrics.qa_f1("Paris", "paris!") == 1.0
    assert metrics.qa_f1("London", "Paris") == 0.0
    assert metrics.qa_f1("", "Paris") == 0.0
    # Repeated tokens count as a multiset: [the the] -> [] after article removal; [x x y] vs [x]: P=1/3, R=1.
    assert metrics.qa_f1("x x y", "x") == pytest.approx(0.5)


def test_normalize_answer():
    assert metrics.normalize_answer("  The Quick, brown fox -- an animal!  ") == "quick brown fox animal"


def test_qa_f1_zh_counts_characters():
    # [北, 京] vs [北, 京, 市]: P = 1, R = 2/3, F1 = 0.8; Chinese punctuation and spaces are dropped.
    assert metrics.qa_f1_zh("北京。", "北京市") == pytest.approx(0.8)
    assert metrics.qa_f1_zh("北 京！", "北京") == 1.0


def test_lcs_classic():
    assert metrics.lcs_length("ABCBDAB", "BDCABA") == 4
    assert metrics.lcs_length("", "abc") == 0


def test_rouge_l():
    # LCS of [the cat sat on the mat] and [the cat lay on the mat] = 5 of 6 tokens each side.
    assert metrics.rouge("the cat sat on the mat", "The cat lay on the mat") == pytest.approx(5 / 6)
    # LCS [a, c] of [a b c] and [a c d e]: P = 2/3, R = 1/2, F1 = 4/7.
    assert metrics.rouge("a b c", "a c d e") == pytest.approx(4 / 7)
    assert metrics.rouge("", "a") == 0.0
    assert metrics.rouge_zh("我爱北京", "我爱上海") == pytest.approx(0.5)


def test_classification_exact_label_wins():
    classes = ["location", "other location", "person"]
    # "location" is found too, but only as part of the reference label: it is dropped.
    assert metrics.classification("other location", "other location", classes) == 1.0
    assert metrics.classification("location or person", "person", classes) == pytest.approx(0.5)
    assert metrics.classification("person", "location", classes) == 0.0
    with pytest.raises(ValueError, match="all_classes"):
        metrics.classification("person", "person", None)


def test_retrieval_and_count():
    assert metrics.retrieval("Paragraph 3 and Paragraph 13", "Paragraph 3") == pytest.approx(0.5)
    assert metrics.retrieval("The answer is Paragraph 3.", "Paragraph 3") == 1.0
    assert metrics.retrieval("I do not know", "Paragraph 3") == 0.0
    assert metrics.retrieval_zh("答案是段落5", "段落5") == 1.0
    with pytest.raises(ValueError, match="Paragraph"):
        metrics.retrieval("3", "third paragraph")
    assert metrics.count("There are 12 unique paragraphs, not 11", "12") == pytest.approx(0.5)
    assert metrics.count("twelve", 12) == 0.0


def test_code_sim_skips_comments_and_fences():
    assert metrics.code_sim("# a comment\n// another\nx = 1\ny = 2", "x = 1") == 1.0
    assert metrics.code_sim("\n```python\nreturn a+b\n```", "return a + b") == pytest.approx(2 * 10 / 22)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcde ", max_size=30), st.text(alphabet="abcde ", max_size=30))
def test_indel_ratio_matches_rapidfuzz(a, b):
    from rapidfuzz import fuzz

    assert metrics.indel_ratio(a, b) == pytest.approx(fuzz.ratio(a, b) / 100)


def test_contains_all_whole_words():
    assert metrics.contains_all("The pass key is 12345.", "12345") == 1.0
    assert metrics.contains_all("123456", "12345") == 0.0  # a longer number is not the answer
    assert metrics.contains_all("they are: ABCDE, FGHIJ", "ABCDE|FGHIJ") == 1.0
    assert metrics.contains_all("they are: abcde", "ABCDE|FGHIJ") == 0.0
    assert metrics.contains_all("value: 0a1b2c3d", "0a1b2c3d") == 1.0
    assert metrics.contains_all("value: 0a1b2c3d4", "0a1b2c3d") == 0.0


def test_score_is_max_over_answers():
    assert score("qa_f1", "Paris", ["London", "Paris, France", "paris"]) == 1.0
    assert score("qa_f1", "Paris", ["London", "Paris France"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="non-empty list"):
        score("qa_f1", "Paris", [])
    with pytest.raises(ValueError, match="non-empty list"):
        score("qa_f1", "Paris", "Paris")
    with pytest.raises(ValueError, match="metric must be one of .*got 'bleu'"):
        score("bleu", "Paris", ["Paris"])
