"""The text corpora (ripplekv_ext.eval.corpus): the KJV splits, the file loaders, and token windows cut from them."""

import json

import pytest
import torch

from ripplekv_ext.eval.corpus import (kjv_books, kjv_split_books, kjv_text, load_jsonl, load_text_file, load_texts,
                                 token_examples)


class CharTokenizer:
    """One token per character: makes token counts checkable by hand."""
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_kjv_splits_are_disjoint_and_cover_every_book():
    names = [name for name, _ in kjv_books()]
    cal, ev = kjv_split_books("calibration"), kjv_split_books("evaluation")
    assert not set(cal) & set(ev) and sorted(cal + ev) == sorted(names)
    assert names[0] == "Genesis" and "Genesis" in cal and "Exodus" in ev and "Revelation" in ev
    assert len(ev) == len(names) // 4 + (1 if len(names) % 4 > 1 else 0)
    assert kjv_split_books("calibration") == cal  # deterministic


def test_kjv_text_is_clean_prose():
    cal, ev = kjv_text("calibration"), kjv_text("evaluation")
    assert cal.startswith("In the beginning God created the heaven")
    assert ev.startswith("Now these are the names of the children of Israel")  # Exodus 1:1
    assert "1:2 " not in cal[:2000]  # inline verse references stripped
    assert ev[:200] not in cal and len(cal) > 2 * len(ev)
    with pytest.raises(ValueError, match="split must be one of .* got 'train'"):
        kjv_text("train")


def test_loaders(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world")
    assert load_text_file(txt) == ["hello world"]
    jl = tmp_path / "a.jsonl"
    jl.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert load_jsonl(jl) == ["one", "two"]
    assert load_texts(jl) == (["one", "two"], f"jsonl:{jl}")
    assert load_texts(["x", "y"]) == (["x", "y"], "texts:2 documents")
    assert load_texts("kjv:evaluation")[1] == "kjv:evaluation" and load_texts(None)[1] == "kjv:calibration"
    jl.write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="a.jsonl:1: expected an object with a string field 'text'"):
        load_jsonl(jl)
    jl.write_text('{"text": \n')
    with pytest.raises(ValueError, match="a.jsonl:1: not valid JSON"):
        load_jsonl(jl)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_text_file(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="non-empty list of strings"):
        load_texts([1, 2])


def test_token_examples_cut_by_tokens():
    ex = token_examples(CharTokenizer(), ["abcdef", "ghij"], prefix_len=3, cont_len=1, num_examples=2)
    # Stream: a b c d e f <eos> g h i j -> windows of 4 tokens.
    assert ex.tolist() == [[97, 98, 99, 100], [101, 102, 0, 103]]
    assert ex.dtype == torch.long
    # 10 characters + an EOS after each document = 12 tokens: 3 examples fit, 4 do not.
    assert token_examples(CharTokenizer(), ["abcdef", "ghij"], 3, 1, 3).shape == (3, 4)
    with pytest.raises(ValueError, match="calibration text has 12 tokens; 4 examples of prefix_len \\+ cont_len "
                                         "= 4 tokens need 16"):
        token_examples(CharTokenizer(), ["abcdef", "ghij"], 3, 1, 4)
    with pytest.raises(ValueError, match="prefix_len must be an integer >= 1, got 0"):
        token_examples(CharTokenizer(), ["abc"], 0, 1, 1)


class BosCharTokenizer(CharTokenizer):
    """Adds a BOS (id 1) in front of any text by default, as Gemma's tokenizer does."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}


def test_token_examples_start_every_window_with_the_tokenizers_bos():
    ex = token_examples(BosCharTokenizer(), ["abcdef", "ghij"], prefix_len=3, cont_len=1, num_examples=2)
    # The stream a b c d e f <eos> g ... fills 3 tokens of each window after the BOS.
    assert ex.tolist() == [[1, 97, 98, 99], [1, 100, 101, 102]]
    with pytest.raises(ValueError, match="4 examples of prefix_len \\+ cont_len = 4 tokens need 16"):
        token_examples(BosCharTokenizer(), ["abcdef"], 3, 1, 4)
    with pytest.raises(ValueError, match="prefix_len must exceed the tokenizer's 1 leading special tokens, got 1"):
        token_examples(BosCharTokenizer(), ["abcdef"], 1, 3, 1)


def test_prompt_ids_add_the_bos_once():
    from ripplekv_ext.eval.example import context_token_count, prompt_ids

    assert prompt_ids(CharTokenizer(), "ab") == [97, 98]  # no BOS: nothing added (SmolLM2)
    assert prompt_ids(BosCharTokenizer(), "ab") == [1, 97, 98]
    assert prompt_ids(BosCharTokenizer(), "\x01ab") == [1, 97, 98]  # a template that wrote its own BOS
    # The context/question split counts the BOS with the context.
    ids = prompt_ids(BosCharTokenizer(), "ctx Q?")
    assert context_token_count(BosCharTokenizer(), "ctx Q?", ids, "Q?") == 5


def test_token_examples_reads_only_what_it_needs():
    long_doc = "word " * 200_000
    ex = token_examples(CharTokenizer(), [long_doc], prefix_len=10, cont_len=5, num_examples=3)
    assert ex.shape == (3, 15) and "".join(map(chr, ex.flatten().tolist())) == long_doc[:45]
