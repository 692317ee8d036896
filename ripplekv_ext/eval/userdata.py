"""A user's own JSONL of ``{"context": ..., "question": ..., "answers": [...]}`` records, scored like LongBench QA."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ripplekv_ext.jsonio import read_jsonl
from ripplekv_ext.eval.example import (Example, context_token_count, encode, has_chat_template, prompt_ids,
                                       render_prompt, truncate_middle)

# LongBench's multifieldqa_en template, with the field names of this format.
DEFAULT_TEMPLATE = ("Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question "
                    "based on the above text, only give me the answer and do not output any other words.\n\n"
                    "Question: {question}\nAnswer:")


def load_user_jsonl(path, tokenizer, max_prompt_tokens: Optional[int] = None, template: str = DEFAULT_TEMPLATE,
                    metric: str = "qa_f1", max_new_tokens: int = 64, chat: Optional[bool] = None,
                    task: Optional[str] = None, limit: Optional[int] = None) -> list[Example]:
    """Examples from ``path``. ``answers`` may be one string or a list; ``id`` is optional.

    ``template`` must contain ``{context}`` and ``{question}``; ``max_prompt_tokens`` truncates the filled
    template in the middle (None: no truncation); ``chat`` wraps it in the chat template (None: when the
    tokenizer has one). ``task`` names the examples (default: the file name without extension).
    """
    path = Path(path)
    for placeholder in ("{context}", "{question}"):
        if placeholder not in template:
            raise ValueError(f"template must contain {placeholder}, got {template!r}")
    if chat is None:
        chat = has_chat_template(tokenizer)
    task = task or path.stem
    # Protocol "after": the context is the prompt up to the end of {context}, when the question comes after it.
    after_context = template.split("{context}", 1)[1]
    question_follows = "{question}" in after_context
    examples = []
    for line_number, record in read_jsonl(path, required=("context", "question", "answers")):
        where = f"{path}:{line_number}"
        answers = record["answers"]
        if isinstance(answers, str):
            answers = [answers]
        if (not isinstance(answers, list) or not answers
                or not all(isinstance(a, str) for a in answers)):
            raise ValueError(f"{where}: answers must be a string or a non-empty list of strings, "
                             f"got {record['answers']!r}")
        raw = template.format(context=record["context"], question=record["question"])
        if max_prompt_tokens is not None:
            raw = tokenizer.decode(truncate_middle(encode(tokenizer, raw), max_prompt_tokens),
                                   skip_special_tokens=True)
        text = render_prompt(tokenizer, raw, chat=chat)
        input_ids = prompt_ids(tokenizer, text)
        question_text = (after_context.format(context=record["context"], question=record["question"])
                         if question_follows else "")
        examples.append(Example(task=task, id=str(record.get("id", line_number)), prompt=text,
                                input_ids=input_ids, answers=answers,
                                max_new_tokens=max_new_tokens, metric=metric,
                                context_tokens=context_token_count(tokenizer, text, input_ids, question_text)))
        if limit is not None and len(examples) >= limit:
            break
    if not examples:
        raise ValueError(f"{path}: no records")
    return examples
