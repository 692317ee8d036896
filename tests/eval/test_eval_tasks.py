"""Task construction (ripplekv_ext.eval: longbench, userdata, synthetic) with the real SmolLM2 tokenizer: LongBench
from small JSONL files written here, the user's own JSONL, and the synthetic suite (sizing, determinism, needles). No
generation: fake generate_fns stand in."""

import json

import pytest

from ripplekv_ext.eval import (EvalReport, ExampleResult, evaluate, load_longbench, load_user_jsonl,
                               longbench_config, longbench_scores, make_synthetic, truncate_middle)
from ripplekv_ext.eval.synthetic import SYNTHETIC_TASKS


@pytest.fixture(scope="module")
def tokenizer():
    from ripplekv_ext.eval.models import load_smollm2

    return load_smollm2()[1]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


# ---------------------------------------------------------------- LongBench protocol data


# LongBench v1's published generation lengths and metrics (its config/dataset2maxlen.json and the metric each
# dataset's score uses), written out here as facts independent of the packaged copy. The copy itself is checked
# against the project's shared/longbench by .ci/run, which always has it beside the checkout.
LONGBENCH_MAXLEN = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32, "2wikimqa": 32,
    "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512, "trec": 64,
    "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32, "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64}
LONGBENCH_METRIC_FAMILY = {"qa_f1": {"narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
                                     "triviaqa"},
                           "rouge": {"gov_report", "qmsum", "multi_news", "samsum"},
                           "classification": {"trec", "lsht"}, "code_sim": {"lcc", "repobench-p"}}


def test_packaged_config_has_longbench_lengths_metrics_and_templates():
    config = longbench_config()
    assert config["maxlen"] == LONGBENCH_MAXLEN
    for metric, datasets in LONGBENCH_METRIC_FAMILY.items():
        assert {d for d, m in config["metric"].items() if m == metric} == datasets, metric
    for name, template in config["prompt"].items():
        assert "{context}" in template, name
    assert "{input}" not in config["prompt"]["passage_count"]  # the one task without a question


def test_config_is_consistent():
    config = longbench_config()
    assert len(config["prompt"]) == 21
    for part in ("maxlen", "metric", "category"):
        assert set(config[part]) == set(config["prompt"]), part
    assert set(config["category"].values()) == {"single_doc_qa", "multi_doc_qa", "summarization", "few_shot",
                                                "synthetic", "code"}


def test_truncate_middle():
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert truncate_middle(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert truncate_middle([1, 2, 3], 5) == [1, 2, 3]
    with pytest.raises(ValueError, match="max_tokens must be >= 2, got 1"):
        truncate_middle([1, 2, 3], 1)


# ---------------------------------------------------------------- LongBench loading and scoring


@pytest.fixture
def longbench_folder(tmp_path):
    long_context = " ".join(f"w{i}" for i in range(1500))
    write_jsonl(tmp_path / "hotpotqa.jsonl", [
        {"input": "Who wrote it?", "context": "Passage 1: Ann wrote the book.", "answers": ["Ann"],
         "all_classes": None, "_id": "h0", "length": 6, "dataset": "hotpotqa", "language": "en"},
        {"input": "Which word is last?", "context": long_context, "answers": ["w1499"], "all_classes": None,
         "_id": "h1"},
    ])
    write_jsonl(tmp_path / "trec.jsonl", [
        {"input": "What city is the capital of France?", "context": "Question: Who is he?\nType: Individual",
         "answers": ["City"], "all_classes": ["City", "Individual", "Country"], "_id": "t0"},
    ])
    write_jsonl(tmp_path / "passage_retrieval_en.jsonl", [
        {"input": "An abstract.", "context": "Paragraph 1: a.\n\nParagraph 2: b.", "answers": ["Paragraph 2"],
         "all_classes": None, "_id": "p0"},
    ])
    (tmp_path / "notes.txt").write_text("not a dataset")
    return tmp_path


def test_longbench_prompts_follow_the_protocol(longbench_folder, tokenizer):
    examples = load_longbench(longbench_folder, tokenizer, max_prompt_tokens=300)
    by_id = {e.id: e for e in examples}
    assert sorted(by_id) == ["h0", "h1", "p0", "t0"]
    config = longbench_config()
    # Chat template for hotpotqa and passage retrieval, none for trec (a few-shot dataset).
    assert by_id["h0"].prompt.startswith("<|im_start|>system") and by_id["h0"].prompt.endswith("assistant\n")
    assert "Question: Who wrote it?\nAnswer:" in by_id["h0"].prompt
    assert by_id["t0"].prompt == config["prompt"]["trec"].format(
        context="Question: Who is he?\nType: Individual", input="What city is the capital of France?")
    assert by_id["t0"].first_line_only and not by_id["h0"].first_line_only
    assert by_id["t0"].all_classes == ["City", "Individual", "Country"]
    for e in examples:
        assert e.max_new_tokens == config["maxlen"][e.task]
        assert e.metric == config["metric"][e.task]
        assert e.input_ids == tokenizer(e.prompt, add_special_tokens=False)["input_ids"]
    # The long record is cut in the middle: both instructions and the question survive, the middle does not.
    long_prompt = by_id["h1"].prompt
    assert by_id["h1"].meta["truncated"] and not by_id["h0"].meta["truncated"]
    assert long_prompt.count("Answer the question based on the given passages.") == 2
    assert "Question: Which word is last?" in long_prompt and "\nw0 w1 " in long_prompt
    assert " w1499" in long_prompt and " w750 " not in long_prompt
    chat_overhead = len(tokenizer.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True,
                                                      tokenize=False))
    assert len(by_id["h1"].input_ids) <= 300 + chat_overhead


def test_longbench_selection_and_limit(longbench_folder, tokenizer):
    examples = load_longbench(longbench_folder, tokenizer, max_prompt_tokens=300, datasets=["hotpotqa"], limit=1)
    assert [e.id for e in examples] == ["h0"]
    base = load_longbench(longbench_folder, tokenizer, max_prompt_tokens=300, datasets=["hotpotqa"], chat=False)
    assert not base[0].prompt.startswith("<|im_start|>")


def test_longbench_errors(longbench_folder, tmp_path, tokenizer):
    with pytest.raises(ValueError, match="unknown LongBench dataset 'hotpot'"):
        load_longbench(longbench_folder, tokenizer, 300, datasets=["hotpot"])
    with pytest.raises(FileNotFoundError, match="qasper.jsonl"):
        load_longbench(longbench_folder, tokenizer, 300, datasets=["qasper"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_longbench(tmp_path / "missing", tokenizer, 300)
    bad = tmp_path / "bad"
    bad.mkdir()
    write_jsonl(bad / "qasper.jsonl", [{"input": "q", "context": "c", "answers": ["a"]},
                                       {"input": "q", "context": "c"}])
    with pytest.raises(ValueError, match=r"qasper.jsonl:2: missing field\(s\) \['answers'\]"):
        load_longbench(bad, tokenizer, 300)


def test_longbench_end_to_end_with_fake_generation(longbench_folder, tokenizer):
    examples = load_longbench(longbench_folder, tokenizer, max_prompt_tokens=300)
    predictions = {"h0": "Ann", "h1": "I think w12", "t0": "\nCity\nCountry", "p0": "Paragraph 2, not 1"}
    lookup = {tuple(e.input_ids): predictions[e.id] for e in examples}
    report = evaluate(examples, lambda ids, n: lookup[tuple(ids[0].tolist())], progress=False)
    scores = longbench_scores(report)
    # hotpotqa: 1 and 0 -> 50; trec: first line "City" only -> 100 (the whole text would match 2 labels: 50);
    # passage retrieval: numbers [2, 1] -> 1/2 -> 50.
    assert scores["datasets"] == {"hotpotqa": 50.0, "trec": 100.0, "passage_retrieval_en": 50.0}
    assert scores["categories"] == {"multi_doc_qa": 50.0, "few_shot": 100.0, "synthetic": 50.0}
    assert scores["average"] == pytest.approx(200 / 3)


def test_longbench_category_averages_by_hand():
    report = EvalReport([ExampleResult(task, str(i), "", ["x"], s, 10) for i, (task, s) in enumerate(
        [("hotpotqa", 1.0), ("hotpotqa", 0.0), ("2wikimqa", 1.0), ("qasper", 0.25)])])
    scores = longbench_scores(report)
    assert scores["datasets"] == {"hotpotqa": 50.0, "2wikimqa": 100.0, "qasper": 25.0}
    assert scores["categories"] == {"single_doc_qa": 25.0, "multi_doc_qa": 75.0}
    assert list(scores["categories"]) == ["single_doc_qa", "multi_doc_qa"]
    with pytest.raises(ValueError, match="non-LongBench"):
        longbench_scores(EvalReport([ExampleResult("passkey", "0", "", ["x"], 1.0, 10)]))


# ---------------------------------------------------------------- user JSONL


def test_user_jsonl(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "mine.jsonl", [
        {"context": "The vault code is 4812.", "question": "What is the vault code?", "answers": "4812"},
        {"context": "Bob is 7.", "question": "How old is Bob?", "answers": ["7", "seven"], "id": "bob"},
    ])
    examples = load_user_jsonl(path, tokenizer, max_new_tokens=8)
    assert [e.id for e in examples] == ["1", "bob"]
    assert examples[0].task == "mine" and examples[0].answers == ["4812"]
    assert examples[0].prompt.startswith("<|im_start|>system")
    assert "The vault code is 4812." in examples[0].prompt and "Question: What is the vault code?" in examples[0].prompt
    report = evaluate(examples, lambda ids, n: "seven" if "Bob" in tokenizer.decode(ids[0]) else "4812",
                      progress=False)
    assert report.task_scores() == {"mine": 100.0}
    short = load_user_jsonl(path, tokenizer, chat=False, template="{context} Q: {question} A:",
                            max_prompt_tokens=4, limit=1)
    assert len(short) == 1 and len(short[0].input_ids) <= 6  # 4 tokens, decode/encode may merge or split one


def test_user_jsonl_errors(tmp_path, tokenizer):
    missing = write_jsonl(tmp_path / "m.jsonl", [{"context": "c", "answers": ["a"]}])
    with pytest.raises(ValueError, match=r"m.jsonl:1: missing field\(s\) \['question'\]"):
        load_user_jsonl(missing, tokenizer)
    empty_answers = write_jsonl(tmp_path / "e.jsonl", [{"context": "c", "question": "q", "answers": []}])
    with pytest.raises(ValueError, match="answers must be a string or a non-empty list"):
        load_user_jsonl(empty_answers, tokenizer)
    with pytest.raises(ValueError, match=r"template must contain \{question\}"):
        load_user_jsonl(missing, tokenizer, template="{context}")
    broken = tmp_path / "b.jsonl"
    broken.write_text('{"context": "c",\n')
    with pytest.raises(ValueError, match="b.jsonl:1: not valid JSON"):
        load_user_jsonl(broken, tokenizer)


# ---------------------------------------------------------------- synthetic suite


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_synthetic_prompts_are_sized_seeded_and_hold_the_answer(task, tokenizer):
    length = 300
    examples = make_synthetic(task, tokenizer, length, num_examples=3, seed=0)
    again = make_synthetic(task, tokenizer, length, num_examples=3, seed=0)
    other_seed = make_synthetic(task, tokenizer, length, num_examples=3, seed=1)
    longer = make_synthetic(task, tokenizer, 600, num_examples=3, seed=0)
    assert [e.input_ids for e in examples] == [e.input_ids for e in again]
    assert [e.answers for e in examples] != [e.answers for e in other_seed]
    assert [e.answers for e in examples] == [e.answers for e in longer]  # same needles at every length
    assert len({tuple(e.answers) for e in examples}) == 3
    for e, e_long in zip(examples, longer):
        # Filler is added until one more unit would not fit (units are <= 40 tokens).
        assert length - 40 < len(e.input_ids) <= length
        assert 600 - 40 < len(e_long.input_ids) <= 600
        assert e.input_ids == tokenizer(e.prompt, add_special_tokens=False)["input_ids"]
        assert e.prompt.startswith("<|im_start|>system")
        assert e.metric == "contains_all"
        body = e.prompt.split("<|im_start|>assistant")[0]
        for needle in e.meta["needles"]:
            assert needle in body
        for value in e.answers[0].split("|"):
            assert value in body


def test_synthetic_task_structure(tokenizer):
    multikey = make_synthetic("multikey", tokenizer, 400, num_examples=1)[0]
    assert multikey.prompt.count("One of the special magic numbers for") == 4
    vt = make_synthetic("variable_tracking", tokenizer, 400, num_examples=1)[0]
    names = vt.answers[0].split("|")
    assert f"VAR {names[1]} = VAR {names[0]}." in vt.prompt
    assert vt.prompt.index(f"VAR {names[0]} =") < vt.prompt.index(f"VAR {names[1]} =")
    kv = make_synthetic("kv_retrieval", tokenizer, 400, num_examples=1)[0]
    assert kv.prompt.count('": "') >= 10  # the context is made of key-value pairs
    base = make_synthetic("passkey", tokenizer, 200, num_examples=1, chat=False)[0]
    assert not base.prompt.startswith("<|im_start|>") and base.prompt.endswith("The pass key is")


def test_synthetic_errors(tokenizer):
    with pytest.raises(ValueError, match="task must be one of"):
        make_synthetic("needle", tokenizer, 300)
    with pytest.raises(ValueError, match=r"passkey: length must be >= \d+ tokens .*got 20"):
        make_synthetic("passkey", tokenizer, 20)
    with pytest.raises(ValueError, match="num_examples must be >= 1, got 0"):
        make_synthetic("passkey", tokenizer, 300, num_examples=0)


# ---------------------------------------------------------------- fidelity text


def test_fidelity_examples_come_from_the_evaluation_split(tokenizer):
    from ripplekv_ext.eval.corpus import kjv_text
    from ripplekv_ext.eval import fidelity_examples

    windows = fidelity_examples(tokenizer, prefix_len=32, cont_len=8, num_examples=2)
    assert windows.shape == (2, 40) and windows.dtype.is_floating_point is False
    text = tokenizer.decode(windows[0, 1:-1])  # inner tokens: the ends may be partial words
    assert text.strip() in kjv_text("evaluation")
    assert text.strip() not in kjv_text("calibration")
