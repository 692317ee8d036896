"""What every generation task produces: tokenized examples with their references and how to score them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ripplekv_ext.eval.metrics import get_metric


@dataclass
class Example:
    """One prompt to generate from, and how to score what comes back.

    ``input_ids`` is the full model input (chat template and answer prefix included); ``prompt`` is the same
    text, kept for inspection. The prediction is the decoded continuation only, scored with ``metric`` as the
    maximum over ``answers``.

    ``context_tokens`` splits the prompt for the "after" protocol (compress once, ask many): the first
    ``context_tokens`` ids are the context, compressed before the question is known; the rest (question, end of the
    user turn, assistant opening, answer prefix) follows the compressed cache. None: the prompt has no such split.
    """

    task: str
    id: str
    prompt: str
    input_ids: list[int]
    answers: list[str]
    max_new_tokens: int
    metric: str
    all_classes: Optional[list[str]] = None
    first_line_only: bool = False  # LongBench's few-shot tasks score only the first line
    meta: dict[str, Any] = field(default_factory=dict)
    context_tokens: Optional[int] = None

    def __post_init__(self):
        get_metric(self.metric)  # fails early, naming the valid metrics
        if isinstance(self.answers, str) or not self.answers:
            raise ValueError(f"{self.task}/{self.id}: answers must be a non-empty list of strings, "
                             f"got {self.answers!r}")
        if not self.input_ids:
            raise ValueError(f"{self.task}/{self.id}: input_ids is empty")
        if self.max_new_tokens < 1:
            raise ValueError(f"{self.task}/{self.id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.context_tokens is not None and not 0 < self.context_tokens < len(self.input_ids):
            raise ValueError(f"{self.task}/{self.id}: context_tokens must leave a context and a question, i.e. be in "
                             f"[1, {len(self.input_ids) - 1}], got {self.context_tokens}")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer, user_text: str, chat: bool, answer_prefix: str = "") -> str:
    """The text the model sees: the user turn wrapped in the tokenizer's chat template (with the assistant
    turn opened) when ``chat``, then ``answer_prefix`` which the model continues."""
    if not chat:
        return user_text + answer_prefix
    if not has_chat_template(tokenizer):
        raise ValueError("chat=True but the tokenizer has no chat_template; pass chat=False for a base model")
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                         add_generation_prompt=True, tokenize=False)
    return text + answer_prefix


def encode(tokenizer, text: str) -> list[int]:
    """A piece of text's ids, no special tokens added (haystacks, needles, raw prompts to truncate)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def leading_special_ids(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text by default: ``[bos]`` for Gemma or Llama-2, nothing for
    SmolLM2. A model trained with a BOS token reads text without it as a different, worse-predicted input
    (gemma-3-270m: 3.78 instead of 3.04 nats per token on held-out KJV text)."""
    return list(tokenizer("", add_special_tokens=True)["input_ids"])


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A whole model input's ids: ``text`` encoded, after the tokenizer's leading special tokens unless the text
    already starts with them (a chat template that writes its own ``<bos>``). Token counts (the sizing of
    synthetic and needle prompts) are counted on these ids, so they stay exact."""
    ids, lead = encode(tokenizer, text), leading_special_ids(tokenizer)
    return ids if ids[:len(lead)] == lead else lead + ids


def truncate_middle(token_ids: Sequence[int], max_tokens: int) -> list[int]:
    """Keep the first ``max_tokens // 2`` and the last ``max_tokens - max_tokens // 2`` tokens (LongBench's rule:
    the instructions sit at both ends of a prompt, the document in the middle)."""
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    token_ids = list(token_ids)
    if len(token_ids) <= max_tokens:
        return token_ids
    head = max_tokens // 2
    return token_ids[:head] + token_ids[len(token_ids) - (max_tokens - head):]


def context_token_count(tokenizer, prompt: str, input_ids: Sequence[int], question_text: str) -> Optional[int]:
    """How many leading ``input_ids`` of ``prompt`` hold the text before its last ``question_text`` (the context).

    Counted on the prompt's own tokens, so both protocols see the very same ids: the context part is encoded alone
    and the ids it shares with the prompt's start are the context (a token merged across the boundary goes to the
    question). None when ``question_text`` is not in the prompt (e.g. cut by truncation) or leaves either part empty.
    """
    boundary = prompt.rfind(question_text) if question_text else -1
    if boundary <= 0:
        return None
    shared = 0
    for context_id, prompt_id in zip(prompt_ids(tokenizer, prompt[:boundary]), input_ids):
        if context_id != prompt_id:
            break
        shared += 1
    return shared if 0 < shared < len(input_ids) else None
