"""Run generation tasks through any ``generate_fn`` and score them.

The runner knows nothing about models or compression: a ``generate_fn(input_ids, max_new_tokens) -> text``
does the generation. :func:`greedy_generate_fn` builds one from a Hugging Face causal LM, optionally inside a
compression context (``compression=lambda: ripplekv_ext.compress(model, policy)``), entered once per example
so every prompt is compressed on its own.

Two protocols (``PROTOCOLS``), as kvpress's pipeline reports them:

- ``"inside"``: the question is part of the compressed prompt, so the observation window sees it;
- ``"after"``: compress once, ask many. The context (``Example.context_tokens``) is compressed alone, scored by
  ``compress_context``'s default question-agnostic scoring (``context.default_scoring``), before the question is
  known; the question and the rest of the prompt follow the compressed cache (:func:`context_generate_fn`, built on
  ``ripplekv_ext.compress_context``). Its ``generate_fn`` takes ``context_tokens`` too.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Optional

import torch

from ripplekv_ext.eval.example import Example
from ripplekv_ext.eval.metrics import score

GenerateFn = Callable[..., str]  # (input_ids, max_new_tokens) -> text; protocol "after": also context_tokens=
CompressionFactory = Callable[[], ContextManager]
PROTOCOLS = ("inside", "after")


def check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")


@dataclass
class ExampleResult:
    task: str
    id: str
    prediction: str
    answers: list[str]
    score: float  # in [0, 1]
    prompt_tokens: int
    protocol: str = "inside"


@dataclass
class EvalReport:
    results: list[ExampleResult] = field(default_factory=list)

    def task_scores(self) -> dict[str, float]:
        """Mean score per task, x100 (LongBench's scale)."""
        by_task = defaultdict(list)
        for r in self.results:
            by_task[r.task].append(r.score)
        return {task: 100.0 * sum(s) / len(s) for task, s in by_task.items()}

    def mean(self) -> float:
        """Mean of the task scores (each task weighs the same, whatever its number of examples)."""
        scores = self.task_scores()
        if not scores:
            raise ValueError("no results to average")
        return sum(scores.values()) / len(scores)


def prediction_for_scoring(example: Example, generated: str) -> str:
    if example.first_line_only:
        return generated.lstrip("\n").split("\n")[0]
    return generated


def evaluate(examples: Iterable[Example], generate_fn: GenerateFn, progress: bool = True,
             desc: str = "evaluating", protocol: str = "inside") -> EvalReport:
    """Generate for each example and score it. ``progress`` shows a tqdm bar (on stderr).

    ``protocol="after"`` calls ``generate_fn(input_ids, max_new_tokens, context_tokens=...)`` and needs every
    example's ``context_tokens`` (``ValueError`` naming the first example without one).
    """
    check_protocol(protocol)
    examples = list(examples)
    if protocol == "after":
        unsplit = [f"{e.task}/{e.id}" for e in examples if e.context_tokens is None]
        if unsplit:
            raise ValueError(f"protocol 'after' needs each example's context/question split (Example.context_tokens); "
                             f"{len(unsplit)} example(s) have none, first {unsplit[0]}")
    report = EvalReport()
    iterator = examples
    if progress:
        from tqdm.auto import tqdm
        iterator = tqdm(examples, desc=desc, unit="example")
    for example in iterator:
        input_ids = torch.tensor([example.input_ids], dtype=torch.long)
        if protocol == "after":
            generated = generate_fn(input_ids, example.max_new_tokens, context_tokens=example.context_tokens)
        else:
            generated = generate_fn(input_ids, example.max_new_tokens)
        if not isinstance(generated, str):
            raise TypeError(f"generate_fn must return the generated text as str, got {type(generated).__name__}")
        prediction = prediction_for_scoring(example, generated)
        report.results.append(ExampleResult(
            task=example.task, id=example.id, prediction=generated, answers=list(example.answers),
            score=score(example.metric, prediction, example.answers, example.all_classes),
            prompt_tokens=len(example.input_ids), protocol=protocol))
    return report


def _eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else eos)
    return sorted(ids)


def greedy_options(model, tokenizer) -> dict:
    """``generate`` options of greedy decoding that stops at the model's EOS tokens."""
    eos = _eos_ids(model, tokenizer)
    return dict(do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None, eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else 0)


def greedy_generate_fn(model, tokenizer, compression: Optional[CompressionFactory] = None) -> GenerateFn:
    """A ``generate_fn`` doing greedy decoding with ``model`` (stops at EOS or ``max_new_tokens``).

    ``compression`` is a zero-argument callable returning a context manager (e.g.
    ``lambda: ripplekv_ext.compress(model, policy)``); None runs the full cache.
    """
    options = greedy_options(model, tokenizer)

    def generate(input_ids: torch.Tensor, max_new_tokens: int) -> str:
        device = next(model.parameters()).device
        input_ids = input_ids.to(device)
        context = compression() if compression is not None else contextlib.nullcontext()
        with context, torch.inference_mode():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=max_new_tokens, **options)
        return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)

    return generate


def context_generate_fn(model, tokenizer, policy, probe_ids: Optional[torch.Tensor] = None,
                        default_probe: bool = True) -> GenerateFn:
    """The ``generate_fn`` of protocol "after": compress the first ``context_tokens`` ids alone with ``policy``
    (``ripplekv_ext.compress_context``, scored by ``probe_ids``, else by its default question-agnostic probe, or
    with ``default_probe=False`` by the context's own tail), then decode greedily after the rest.

    One question per example, so the answer continues the compressed cache itself (no copy).
    """
    from ripplekv_ext.transformers_front.context import compress_context, continue_context

    options = greedy_options(model, tokenizer)
    probe_tokenizer = tokenizer if default_probe else None

    def generate(input_ids: torch.Tensor, max_new_tokens: int, context_tokens: int) -> str:
        input_ids = input_ids.to(next(model.parameters()).device)
        with torch.inference_mode():
            cache = compress_context(model, input_ids[:, :context_tokens], policy, tokenizer=probe_tokenizer,
                                     probe_ids=probe_ids)
            output = continue_context(model, cache, input_ids[:, context_tokens:], copy_cache=False,
                                      max_new_tokens=max_new_tokens, **options)
        return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)

    return generate


def protocol_settings(protocol: str, policy, tokenizer) -> dict:
    """What ``protocol``'s results depend on beyond the policy, saved beside them so that a resumed run reuses them
    only for the same: protocol "after" scores the context with ``compress_context``'s default scoring, whose
    choice can change between versions."""
    check_protocol(protocol)
    if protocol != "after":
        return {}
    from ripplekv_ext.transformers_front.context import default_scoring

    return {"scoring": default_scoring(policy, tokenizer)}


def protocol_generate_fn(protocol: str, model, tokenizer, policy) -> GenerateFn:
    """The greedy ``generate_fn`` of ``protocol`` for ``policy`` (``Policy.full()``: the whole cache)."""
    check_protocol(protocol)
    if protocol == "after":
        return context_generate_fn(model, tokenizer, policy)
    from ripplekv_ext.transformers_front.compress_block import compress

    return greedy_generate_fn(model, tokenizer, None if policy.is_full else (lambda: compress(model, policy)))
