"""LongBench (v1) from a local folder of its ``<dataset>.jsonl`` files, following the benchmark's protocol.

The protocol data (prompt templates, generation lengths, metrics, categories) ships with the package in
``longbench_config/``, copied from the project's ``../shared/longbench/`` (a test keeps the copies equal). Rules:
prompts are truncated in the middle to ``max_prompt_tokens``; all datasets but ``NO_CHAT_DATASETS`` are wrapped in
the model's chat template (when it has one); ``FIRST_LINE_DATASETS`` score only the first generated line; a sample
scores the best over its answers; dataset scores are means x100, category scores means of dataset scores.

For the "after" protocol (compress once, ask many) an example's context is its prompt up to the end of the template's
``{context}``; the template's text after it (instructions, ``{input}``, answer cue) and the rest of the chat template
follow the compressed cache (``Example.context_tokens``; None where truncation cut into that text).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional

from ripplekv_ext.jsonio import read_jsonl
from ripplekv_ext.eval.example import (Example, context_token_count, encode, has_chat_template, prompt_ids,
                                       render_prompt, truncate_middle)
from ripplekv_ext.eval.runner import EvalReport

CONFIG_DIR = Path(__file__).resolve().parent / "longbench_config"
CONFIG_FILES = ("dataset2prompt.json", "dataset2maxlen.json", "dataset2metric.json", "dataset2category.json")
NO_CHAT_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
CATEGORY_ORDER = ("single_doc_qa", "multi_doc_qa", "summarization", "few_shot", "synthetic", "code")


@lru_cache(maxsize=1)
def longbench_config() -> dict[str, dict]:
    """``{"prompt": ..., "maxlen": ..., "metric": ..., "category": ...}``, each keyed by dataset name."""
    config = {}
    for name in CONFIG_FILES:
        with open(CONFIG_DIR / name, encoding="utf-8") as f:
            config[name[len("dataset2"):-len(".json")]] = json.load(f)
    return config


def longbench_datasets() -> list[str]:
    return list(longbench_config()["prompt"])


def _read_jsonl(path: Path) -> list[dict]:
    return [record for _, record in read_jsonl(path, required=("context", "input", "answers"))]


def load_longbench(folder, tokenizer, max_prompt_tokens: int, datasets: Optional[Iterable[str]] = None,
                   limit: Optional[int] = None, chat: Optional[bool] = None) -> list[Example]:
    """Examples for ``datasets`` (default: every known dataset with a ``<name>.jsonl`` in ``folder``).

    Args:
        folder: the folder of LongBench JSONL files.
        tokenizer: the model's tokenizer (truncation and encoding).
        max_prompt_tokens: the prompt (before the chat template) is cut in the middle to this many tokens;
            LongBench uses the model's window minus room for the chat template and the answer.
        limit: at most this many records per dataset (the first ones).
        chat: wrap chat datasets in the chat template; None = when the tokenizer has one (base models get the
            raw prompt, as in LongBench).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"LongBench folder {folder} does not exist")
    config = longbench_config()
    known = longbench_datasets()
    if datasets is None:
        datasets = [name for name in known if (folder / f"{name}.jsonl").is_file()]
        if not datasets:
            raise FileNotFoundError(f"no LongBench <dataset>.jsonl files in {folder} (datasets: {known})")
    datasets = list(datasets)
    for name in datasets:
        if name not in config["prompt"]:
            raise ValueError(f"unknown LongBench dataset {name!r}; known: {known}")
    if chat is None:
        chat = has_chat_template(tokenizer)

    examples = []
    for name in datasets:
        path = folder / f"{name}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"LongBench dataset {name!r}: expected {path}, not found")
        records = _read_jsonl(path)[:limit]
        for index, record in enumerate(records):
            template = config["prompt"][name]
            raw = template.format(context=record["context"], input=record["input"] or "")
            question_text = template.split("{context}", 1)[1].format(input=record["input"] or "")
            # Truncate the raw prompt in token space, then decode: the chat template is added after, as in
            # LongBench, so truncation never cuts into the template.
            truncated = truncate_middle(encode(tokenizer, raw), max_prompt_tokens)
            text = tokenizer.decode(truncated, skip_special_tokens=True)
            text = render_prompt(tokenizer, text, chat=chat and name not in NO_CHAT_DATASETS)
            answers = record["answers"]
            input_ids = prompt_ids(tokenizer, text)
            examples.append(Example(
                task=name, id=str(record.get("_id", index)), prompt=text, input_ids=input_ids,
                answers=[answers] if isinstance(answers, str) else list(answers),
                max_new_tokens=config["maxlen"][name], metric=config["metric"][name],
                all_classes=record.get("all_classes"), first_line_only=name in FIRST_LINE_DATASETS,
                meta={"category": config["category"][name], "truncated": len(truncated) < len(encode(tokenizer, raw))},
                context_tokens=context_token_count(tokenizer, text, input_ids, question_text)))
    return examples


def longbench_scores(report: EvalReport) -> dict:
    """``{"datasets": {name: score}, "categories": {category: mean}, "average": mean over datasets}``, x100.

    Categories average the dataset scores present in the report (each dataset weighs the same).
    """
    category_of = longbench_config()["category"]
    datasets = report.task_scores()
    unknown = [name for name in datasets if name not in category_of]
    if unknown:
        raise ValueError(f"report holds non-LongBench tasks {unknown}")
    by_category: dict[str, list[float]] = {}
    for name, value in datasets.items():
        by_category.setdefault(category_of[name], []).append(value)
    categories = {c: sum(by_category[c]) / len(by_category[c]) for c in CATEGORY_ORDER if c in by_category}
    return {"datasets": datasets, "categories": categories,
            "average": sum(datasets.values()) / len(datasets)}
