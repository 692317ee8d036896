"""Fidelity: how far compression moves the model's next-token distributions on a teacher-forced continuation.

For each example ``(prefix of P tokens, continuation of T tokens)`` both a full and a compressed run read the
prefix (the compressed run compresses its cache there), then the continuation is fed teacher-forced against that
cache. At the T continuation positions we compare the distributions: ``KL(P_full || P_compressed)`` (natural log)
and the NLL of the true continuation tokens under each.

The runs are ``logits_fn(prefix_ids [1, P], continuation_ids [1, T]) -> logits [T, V]`` callables, where row ``t``
predicts continuation token ``t``; :func:`continuation_logits_fn` builds one from a Hugging Face causal LM and an
optional compression context factory.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ripplekv_ext.policies import DEFAULT_WINDOW

LogitsFn = Callable[[Tensor, Tensor], Tensor]


def continuation_logits_fn(model, compression: Optional[Callable[[], ContextManager]] = None) -> LogitsFn:
    """A ``logits_fn`` running ``model``: one forward over the prefix (the prefill, where a compression hook
    compresses the cache), then one forward over the whole continuation against the resulting cache.

    ``compression`` is a zero-argument callable returning a context manager (e.g.
    ``lambda: ripplekv_ext.compress(model, policy)``), entered once per example; None keeps the full cache.
    """

    def logits_fn(prefix_ids: Tensor, continuation_ids: Tensor) -> Tensor:
        from ripplekv_ext.integrations.transformers import cache_argument, output_cache
        device = next(model.parameters()).device
        context = compression() if compression is not None else contextlib.nullcontext()
        with context, torch.inference_mode():
            # Only the prefix's last position is scored: its [n, vocab] logits would be most of the prefill's
            # memory (about 1 GB for gemma-3-270m's 262K-token vocabulary at 1K tokens).
            prefill = model(prefix_ids.to(device), use_cache=True, logits_to_keep=1)
            rest = model(continuation_ids.to(device), **{cache_argument(): output_cache(prefill)},
                         use_cache=True)
        # The prefix's last position predicts continuation token 0; continuation position t predicts t + 1.
        return torch.cat([prefill.logits[0, -1:], rest.logits[0, :-1]]).float()

    return logits_fn


class SharedPrefill:
    """Fidelity runs of many policies from one prefill per prompt.

    Compression does not change what the prefill computes, only the cache it leaves. So each prefix is prefilled
    once under a capturing SnapKV policy that keeps every compressed layer's full keys, values and window
    queries (its ``on_compress`` steps); a policy's run then selects from those with its own ``KVCompressor`` --
    what ``compress(model, policy)`` does inside the prefill -- and feeds only the continuation. A grid of M
    methods x R retentions costs one prefill per example instead of M x R (the continuation is the cheap part).
    ``tests/eval/test_eval_fidelity.py`` checks the logits against plain runs under the hook for every kind of policy.

    Policies it cannot serve (``supports``): a selector that needs every prompt query (H2O), another window, or
    compression during decoding; use :func:`continuation_logits_fn` for those. Memory: each distinct prefix's
    full cache and last logit stay held as long as the object lives (``run_grid`` keeps one per grid).
    """

    def __init__(self, model, window: int = DEFAULT_WINDOW, capture_retention: float = 0.01):
        from ripplekv_ext.policies import Policy

        self.model, self.window = model, window
        self.device = next(model.parameters()).device
        # The smallest retention: every layer the hook compresses at any larger retention is captured too.
        self.capture_policy = Policy.snapkv(capture_retention, window)
        self._prefills: dict = {}

    def supports(self, policy) -> bool:
        return (policy.is_full or (policy.window == self.window and not policy.selector.needs_all_queries
                                   and policy.decode_every is None))

    def _prefill(self, prefix_ids: Tensor):
        """(logit of the prefix's last position, cache after the prefill, {layer: CompressionStep})."""
        from ripplekv_ext.integrations.transformers import output_cache
        from ripplekv_ext.transformers_front.compress_block import compress

        key = prefix_ids.numpy().tobytes()
        if key not in self._prefills:
            steps = {}
            with compress(self.model, self.capture_policy, on_compress=lambda s: steps.__setitem__(s.layer_idx, s)), \
                    torch.inference_mode():
                out = self.model(prefix_ids.to(self.device), use_cache=True, logits_to_keep=1)
            self._prefills[key] = (out.logits[0, -1:].float(), output_cache(out), steps)
        return self._prefills[key]

    def logits_fn(self, policy) -> LogitsFn:
        """``logits_fn`` of ``policy`` (``Policy.full()``: every layer keeps every captured token)."""
        from ripplekv_ext.selection.compressor import KVCompressor
        from ripplekv_ext.transformers_front.compress_block import compress

        if not self.supports(policy):
            raise ValueError(f"{policy.name}: SharedPrefill needs window {self.window}, a selector that reads only "
                             "the window's queries and no decode_every; use continuation_logits_fn")
        compressor = None if policy.is_full else KVCompressor.for_model(self.model, policy)
        run_policy = self.capture_policy if policy.is_full else policy

        def logits_fn(prefix_ids: Tensor, continuation_ids: Tensor) -> Tensor:
            from ripplekv_ext.integrations.transformers import cache_argument, compressed_cache
            last_logit, captured, steps = self._prefill(prefix_ids)
            cache = compressed_cache(captured, steps, compressor)
            with compress(self.model, run_policy), torch.inference_mode():
                rest = self.model(continuation_ids.to(self.device), **{cache_argument(): cache}, use_cache=True)
            return torch.cat([last_logit, rest.logits[0, :-1].float()])

        return logits_fn


def kl_per_position(reference_logits: Tensor, other_logits: Tensor) -> Tensor:
    """``KL(softmax(reference) || softmax(other))`` per row, in nats, computed in fp32: ``[T, V] -> [T]``."""
    if reference_logits.shape != other_logits.shape or reference_logits.dim() != 2:
        raise ValueError(f"logits must both be [T, V] with the same shape, got {tuple(reference_logits.shape)} "
                         f"and {tuple(other_logits.shape)}")
    log_p = F.log_softmax(reference_logits.float(), dim=-1)
    log_q = F.log_softmax(other_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def nll_per_position(logits: Tensor, targets: Tensor) -> Tensor:
    """Negative log-likelihood (nats) of ``targets [T]`` under ``logits [T, V]``."""
    log_q = F.log_softmax(logits.float(), dim=-1)
    return -log_q.gather(-1, targets.view(-1, 1).to(log_q.device)).squeeze(-1)


@dataclass
class FidelityReport:
    kl: list[float] = field(default_factory=list)  # per example: mean over continuation positions
    nll_full: list[float] = field(default_factory=list)
    nll_compressed: list[float] = field(default_factory=list)

    @staticmethod
    def _mean(values):
        return sum(values) / len(values)

    @staticmethod
    def _stderr(values):
        n = len(values)
        if n < 2:
            return float("nan")
        mean = sum(values) / n
        return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)

    def summary(self) -> dict[str, float]:
        """Means over examples (every example has the same number of positions), with standard errors, and a
        95% bootstrap interval of the mean KL (NaN with fewer than two examples)."""
        from ripplekv_ext.profiler.stats import bootstrap_mean_ci

        low, high = bootstrap_mean_ci(self.kl) if len(self.kl) >= 2 else (float("nan"), float("nan"))
        return {
            "kl": self._mean(self.kl), "kl_stderr": self._stderr(self.kl), "kl_ci_low": low, "kl_ci_high": high,
            "nll_full": self._mean(self.nll_full), "nll_compressed": self._mean(self.nll_compressed),
            "ppl_full": math.exp(self._mean(self.nll_full)),
            "ppl_compressed": math.exp(self._mean(self.nll_compressed)),
            "examples": len(self.kl),
        }


def paired_kl_comparison(kl: Sequence[float], other_kl: Sequence[float], confidence: float = 0.95) -> dict:
    """Per-example comparison of two methods' KL on the same examples (lower is better): how many examples each
    wins, and the mean difference ``kl - other_kl`` with a paired bootstrap interval (negative: ``kl`` is
    better; an interval excluding 0 is a difference the examples support, not noise)."""
    from ripplekv_ext.profiler.stats import paired_bootstrap_ci

    if len(kl) != len(other_kl) or not kl:
        raise ValueError(f"kl and other_kl must hold one value per example of the same examples, got "
                         f"{len(kl)} and {len(other_kl)} values")
    low, high = paired_bootstrap_ci(kl, other_kl, confidence) if len(kl) >= 2 else (float("nan"), float("nan"))
    return {"examples": len(kl), "wins": sum(a < b for a, b in zip(kl, other_kl)),
            "losses": sum(a > b for a, b in zip(kl, other_kl)), "ties": sum(a == b for a, b in zip(kl, other_kl)),
            "mean_difference": sum(a - b for a, b in zip(kl, other_kl)) / len(kl), "ci_low": low, "ci_high": high}


def evaluate_fidelity(examples: Tensor, prefix_len: int, full_fn: LogitsFn, compressed_fn: LogitsFn,
                      progress: bool = True) -> FidelityReport:
    """Compare ``full_fn`` and ``compressed_fn`` on ``examples`` ``[E, prefix_len + T]`` (token ids, e.g. from
    ``ripplekv_ext.eval.corpus.token_examples``)."""
    if examples.dim() != 2 or examples.dtype != torch.long:
        raise ValueError(f"examples must be an int64 [E, P + T] tensor, got {examples.dtype} "
                         f"{tuple(examples.shape)}")
    if not 1 <= prefix_len < examples.shape[1]:
        raise ValueError(f"prefix_len must be in [1, {examples.shape[1] - 1}] for examples of "
                         f"{examples.shape[1]} tokens, got {prefix_len}")
    report = FidelityReport()
    rows = range(examples.shape[0])
    if progress:
        from tqdm.auto import tqdm
        rows = tqdm(rows, desc="fidelity", unit="example")
    for i in rows:
        prefix, continuation = examples[i:i + 1, :prefix_len], examples[i:i + 1, prefix_len:]
        full = full_fn(prefix, continuation)
        compressed = compressed_fn(prefix, continuation)
        expected = (continuation.shape[1], full.shape[-1])
        if tuple(full.shape) != expected or tuple(compressed.shape) != expected:
            raise ValueError(f"logits functions must return [T, V] = {list(expected)}, got full "
                             f"{list(full.shape)} and compressed {list(compressed.shape)}")
        targets = continuation[0]
        report.kl.append(kl_per_position(full, compressed).mean().item())
        report.nll_full.append(nll_per_position(full, targets).mean().item())
        report.nll_compressed.append(nll_per_position(compressed, targets).mean().item())
    return report


def fidelity_examples(tokenizer, prefix_len: int, cont_len: int, num_examples: int,
                      source="kjv:evaluation") -> Tensor:
    """Token windows ``[num_examples, prefix_len + cont_len]`` from ``source`` (default: the evaluation split of
    the bundled King James Bible, which never overlaps the calibration split the profiler uses)."""
    from ripplekv_ext.eval.corpus import load_texts, token_examples

    texts, _ = load_texts(source)
    return token_examples(tokenizer, texts, prefix_len, cont_len, num_examples)
