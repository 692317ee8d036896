"""Run generation tasks through any ``generate_fn`` and score them.

The runner knows nothing about models or compression: a ``generate_fn(input_ids, max_new_tokens) -> text``
does the generation. :func:`greedy_generate_fn` builds one from a Hugging Face causal LM, optionally inside a
compression context (``compression=lambda: ripplekv_ext.compress(model, policy)``), entered once per example
so every prompt is compressed on its own.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Optional

import torch

from ripplekv_ext.eval.example import Example
from ripplekv_ext.eval.metrics import score

GenerateFn = Callable[[torch.Tensor, int], str]
CompressionFactory = Callable[[], ContextManager]


@dataclass
class ExampleResult:
    task: str
    id: str
    prediction: str
    answers: list[str]
    score: float  # in [0, 1]
    prompt_tokens: int


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
             desc: str = "evaluating") -> EvalReport:
    """Generate for each example and score it. ``progress`` shows a tqdm bar (on stderr)."""
    examples = list(examples)
    report = EvalReport()
    iterator = examples
    if progress:
        from tqdm.auto import tqdm
        iterator = tqdm(examples, desc=desc, unit="example")
    for example in iterator:
        input_ids = torch.tensor([example.input_ids], dtype=torch.long)
        generated = generate_fn(input_ids, example.max_new_tokens)
        if not isinstance(generated, str):
            raise TypeError(f"generate_fn must return the generated text as str, got {type(generated).__name__}")
        prediction = prediction_for_scoring(example, generated)
        report.results.append(ExampleResult(
            task=example.task, id=example.id, prediction=generated, answers=list(example.answers),
            score=score(example.metric, prediction, example.answers, example.all_classes),
            prompt_tokens=len(example.input_ids)))
    return report


def _eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else eos)
    return sorted(ids)


def greedy_generate_fn(model, tokenizer, compression: Optional[CompressionFactory] = None) -> GenerateFn:
    """A ``generate_fn`` doing greedy decoding with ``model`` (stops at EOS or ``max_new_tokens``).

    ``compression`` is a zero-argument callable returning a context manager (e.g.
    ``lambda: ripplekv_ext.compress(model, policy)``); None runs the full cache.
    """
    eos = _eos_ids(model, tokenizer)
    pad = eos[0] if eos else 0

    def generate(input_ids: torch.Tensor, max_new_tokens: int) -> str:
        device = next(model.parameters()).device
        input_ids = input_ids.to(device)
        context = compression() if compression is not None else contextlib.nullcontext()
        with context, torch.inference_mode():
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                    temperature=None, top_p=None, top_k=None,
                                    eos_token_id=eos or None, pad_token_id=pad)
        return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)

    return generate
