"""Compression policies: an allocator (how many tokens each layer keeps) times a selector (which ones).

Any allocator combines with any selector: ``Policy(PyramidKVAllocator(), H2OSelector(), retention=0.2)`` is as
valid as the published pairings. ``Policy.full()`` (no allocator, no selector) compresses nothing.

Budgets are tokens kept per KV head, observation window included (docs/design.md §3).

Compression during decoding (``decode_every=K``): after every ``K`` generated tokens each layer selects down to its
budget again, over its whole cache (prompt + generated), with its latest ``W`` queries as the window. The budget is
a fixed total: the average per-layer budget is ``decode_budget`` tokens if given, else the prompt's
(``round(retention * n_prompt)``, fixed at prefill), and the allocator splits it over the layers for the length
seen so far (``decode_layer_budgets``), so every allocator holds the same total memory for the whole generation.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

from ripplekv_ext.budgets.allocators import (DEFAULT_EXPONENT, DEFAULT_NORMALIZE, DEFAULT_RATIO, Allocator,
                                             PyramidKVAllocator, RippleKVAllocator, RippleKVRatioAllocator,
                                             UniformAllocator, average_budget)
from ripplekv_ext.budgets.cake import DEFAULT_TAU1, DEFAULT_TAU2, CakeAllocator
from ripplekv_ext.selection.cake import DEFAULT_GAMMA, CakeSelector
from ripplekv_ext.checks import check_int, is_integer, shown
from ripplekv_ext.selection.selectors import (H2OSelector, PeakSpanSelector, Selector, SnapKVSelector,
                                              StreamingLLMSelector)

__all__ = ["Policy", "DEFAULT_WINDOW", "DEFAULT_RIPPLEKV_SELECTOR", "PromptTooShortWarning"]

DEFAULT_WINDOW = 32
# The selector inside RippleKV's layers when none is given (Policy.ripplekv, the vLLM plugin's "ripplekv"): chosen on
# calibration text and calibration retrieval prompts (docs/defaults.md).
DEFAULT_RIPPLEKV_SELECTOR = PeakSpanSelector


class PromptTooShortWarning(UserWarning):
    """A prompt too short for the policy's retention and window: it is left uncompressed."""


@dataclass(frozen=True)
class Policy:
    """``allocator x selector`` at a retention ratio, or Full (both ``None``: nothing is compressed).

    Args:
        allocator: an ``Allocator``: ``UniformAllocator()``, ``PyramidKVAllocator()``, ``RippleKVAllocator(profile)``,
            ``TieredAllocator(...)`` or a subclass of one's own.
        selector: a ``Selector``: ``SnapKVSelector()``, ``H2OSelector()``, ``StreamingLLMSelector()`` or a subclass
            of one's own (``ScoredSelector`` for a new score).
        retention: fraction of the prompt kept on average over the compressible layers, in ``(0, 1]``.
        window: observation window ``W``: the last ``W`` prompt positions are always kept.
        decode_every: ``K``, compression during decoding: after every ``K`` new tokens each layer selects down to
            its budget again (the newest ``W`` tokens always kept), so a layer never holds more than its budget plus
            ``K`` tokens however long the generation. ``None`` (default): only the prompt is compressed.
        decode_budget: with ``decode_every``, the average tokens per layer held during the whole generation (window
            included, ``> window``), from the prefill on: the prompt keeps ``round(retention * n_prompt)`` clamped
            to ``[window + 1, decode_budget]`` (``layer_budgets``), so a layer holds at most its budget plus ``K``
            tokens at every step, and more retention never means less memory. ``None`` (default): the prompt's
            average budget ``round(retention * n_prompt)``, i.e. the memory the prefill left. Give it for short
            prompts with long generations (a prompt too short for its retention is otherwise never compressed).
        prefill_chunk: ``C``, bounded prefill: inside ``compress(model, policy)``, ``model.generate`` reads a prompt
            in chunks of ``C`` tokens (transformers' ``prefill_chunk_size``) and after every chunk each layer keeps
            at most its budget for the whole prompt (``BudgetPlan.chunk``), scored by the newest ``W``
            queries; each chunk attends to the compressed cache of the chunks before it, so a prompt never holds
            more than its budget plus one chunk (docs/design.md §4, "Bounded (rolling) prefill"). ``C > window``; a
            chunk at least as long as the prompt is one-shot compression. ``None`` (default): one-shot, unless
            ``generate`` is given ``prefill_chunk_size`` itself (then it rolls the same way).
        protect: a protected prefix: the first ``protect`` tokens of every prompt (a system prompt, a shared
            document) are kept whole in every layer, and the rest is compressed as a prompt of its own: its budgets
            are those of ``n - protect`` tokens (``layer_budgets``, ``decode_layer_budgets``; each layer keeps
            ``protect`` more), and it is scored and selected without the protected keys. A serving engine keeps the
            protected blocks shared between the requests that begin with them, as without compression. ``0``
            (default): nothing protected. Needs a selector that can select again (``reselection_refusal``).
    """

    allocator: Optional[Allocator] = None
    selector: Optional[Selector] = None
    retention: float = 1.0
    window: int = DEFAULT_WINDOW
    decode_every: Optional[int] = None
    decode_budget: Optional[int] = None
    prefill_chunk: Optional[int] = None
    protect: int = 0

    def __post_init__(self):
        if (self.allocator is None) != (self.selector is None):
            raise ValueError("a Policy needs both an allocator and a selector (or neither, for Full), got "
                             f"allocator={self.allocator!r}, selector={self.selector!r}")
        for name, value, base in (("allocator", self.allocator, Allocator), ("selector", self.selector, Selector)):
            if value is not None and not isinstance(value, base):
                raise TypeError(f"{name} must be a ripplekv_ext.{base.__name__} (subclass it for one of your own), "
                                f"got {type(value).__name__}")
        if isinstance(self.retention, bool) or not (isinstance(self.retention, (int, float))
                                                    and 0.0 < float(self.retention) <= 1.0):
            raise ValueError(f"retention must be in (0, 1], got {self.retention!r}")
        # Stored as Python ints: NumPy integers are accepted, and the policy's name and equality stay the same.
        object.__setattr__(self, "window", check_int("window", self.window, 1))
        cake = [part for part in (self.allocator, self.selector) if isinstance(part, (CakeAllocator, CakeSelector))]
        if cake and self.window < 2:
            raise ValueError(f"window must be at least 2 with {cake[0]!r}: CAKE takes the variance across the "
                             f"window's queries, which one query does not have; got window={self.window}")
        self._check_decode_options()
        if self.prefill_chunk is not None:
            self.check_prefill_chunk("prefill_chunk", self.prefill_chunk)
        for name in ("decode_every", "decode_budget", "prefill_chunk"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "protect", self._check_protect())

    def _check_protect(self) -> int:
        if not is_integer(self.protect) or self.protect < 0:
            raise ValueError(f"protect must be an integer >= 0 (prompt tokens kept whole at the start of every "
                             f"prompt, e.g. a system prompt's length), got {shown(self.protect)}")
        if self.protect and self.is_full:
            raise ValueError("protect needs a compressing policy (Policy.full() keeps every token); use e.g. "
                             "Policy.snapkv(0.2, protect=256)")
        refusal = None if not self.protect else self.reselection_refusal()
        if refusal is not None:
            raise ValueError(f"protect is not supported with {refusal[0]}: {refusal[1]} (a protected prefix is "
                             "selected around, as a prompt read in parts); use SnapKV, PeakSpan or StreamingLLM")
        return int(self.protect)

    def _check_decode_options(self) -> None:
        if self.decode_every is None:
            if self.decode_budget is not None:
                raise ValueError(f"decode_budget={self.decode_budget!r} needs decode_every (compress every K "
                                 "generated tokens); set decode_every=K too, or drop decode_budget")
            return
        if not is_integer(self.decode_every) or self.decode_every < 1:
            raise ValueError(f"decode_every must be an integer >= 1 (generated tokens between re-selections, e.g. "
                             f"128) or None (off), got {shown(self.decode_every)}")
        if self.is_full:
            raise ValueError("decode_every needs a compressing policy (Policy.full() keeps every token); use e.g. "
                             "Policy.snapkv(0.2, decode_every=128)")
        refusal = self.reselection_refusal()
        if refusal is not None:
            raise ValueError(f"decode_every is not supported with {refusal[0]}: {refusal[1]}; use SnapKV, PeakSpan or "
                             "StreamingLLM")
        if self.decode_budget is not None and (not is_integer(self.decode_budget)
                                               or self.decode_budget <= self.window):
            raise ValueError(f"decode_budget must be an integer > window = {self.window} (the newest window tokens "
                             f"plus at least one more), got {shown(self.decode_budget)}")

    def check_prefill_chunk(self, name: str, chunk) -> int:
        """``chunk`` (named ``name`` in the error) as the chunk of a bounded prefill under this policy, or
        ``ValueError``: an integer longer than the window (a shorter one would select after every few tokens, its
        window mostly from earlier chunks), with a selector that needs only the newest queries."""
        if not is_integer(chunk) or chunk <= self.window:
            raise ValueError(f"{name} must be an integer > window = {self.window} (tokens of prompt read per "
                             f"forward, e.g. 512), got {shown(chunk)}")
        self.check_reads_in_chunks(f"{name}={chunk}")
        return int(chunk)

    def check_reads_in_chunks(self, what: str) -> None:
        """``ValueError`` naming ``what`` unless this policy can cut a prompt read in chunks after each chunk
        (``reselection_refusal``)."""
        refusal = self.reselection_refusal()
        if refusal is not None:
            raise ValueError(f"{what} is not supported with {refusal[0]}: {refusal[1]}; read the prompt in one "
                             "forward, or use SnapKV, PeakSpan or StreamingLLM")

    def reselection_refusal(self) -> Optional[tuple[str, str]]:
        """Why this policy can select only once, at the end of a prompt read in one forward (not after each chunk of
        a prompt, nor again during decoding, nor in an engine's chunked prefill): ``(what, reason)``, or None when
        it can. Its selector may score with every prompt query (H2O), keep a different count per KV head (AdaKV),
        or its allocator read every layer's attention to the whole prompt (CAKE)."""
        if self.is_full:
            return None
        if self.selector.needs_all_queries:
            return repr(self.selector), "it scores with every prompt query, which only a one-forward prefill has"
        if self.selector.head_wise:
            return repr(self.selector), "its heads keep different counts, and a later selection keeps one per KV head"
        if self.reads_attention:
            return repr(self.allocator), ("its budgets come from the prompt's attention over every layer, read once "
                                          "at the end of a one-forward prefill")
        return None

    def layer_alone_budget(self, planned, n_tokens, argument: str):
        """``planned``, the plan's budget of a layer compressed on its own for an ``n_tokens`` prompt (or lists of
        both, one per row), unless the allocator reads every layer's attention (CAKE) and the plan would compress:
        one layer alone cannot know those budgets."""
        rows = zip(planned, n_tokens) if isinstance(planned, list) else [(planned, n_tokens)]
        if self.reads_attention and any(budget is not None and budget < n for budget, n in rows):
            raise ValueError(f"{self.allocator!r} reads every layer's attention for its budgets: call "
                             "plan.from_attention({layer: (queries, keys, scale), ...}, n_tokens) after every layer's "
                             f"prefill and pass each layer's {argument}= (without it they would be the even plan)")
        return planned

    @property
    def is_full(self) -> bool:
        return self.selector is None

    @property
    def reads_attention(self) -> bool:
        """Whether the budgets come from the prompt's own attention (the allocator's ``reads_attention``: CAKE)."""
        return not self.is_full and self.allocator.reads_attention

    @property
    def name(self) -> str:
        if self.is_full:
            return "full"
        name = f"{self.allocator.name}+{self.selector.name}@{self.retention:g}"
        if self.decode_every is not None:
            name += f",decode_every={self.decode_every}"
        if self.decode_budget is not None:
            name += f",decode_budget={self.decode_budget}"
        if self.prefill_chunk is not None:
            name += f",prefill_chunk={self.prefill_chunk}"
        if self.protect:
            name += f",protect={self.protect}"
        return name

    def layer_budgets(self, num_layers: int, n_tokens: int, layers: Optional[Sequence[int]] = None) -> list[int]:
        """Budget of each of ``num_layers`` compressible layers for an ``n_tokens`` prompt.

        ``layers`` names those layers (ascending indices; default ``0 .. num_layers - 1``), so that an allocator
        holding per-layer data (a RippleKV profile) gives each layer its own budget.

        ``n_tokens`` for a layer means it is left uncompressed: always for Full, for a prompt no longer than the
        window or the average budget, and for a prompt too short for the policy (its average budget would not
        exceed the window): that last case warns (``PromptTooShortWarning``, once per call site) instead of
        failing in the middle of a generation.

        With a ``decode_budget`` the prompt's average budget is ``round(retention * n_tokens)`` clamped to
        ``[window + 1, decode_budget]``: the generation's budget caps the prefill too, so a layer never holds more
        than its budget plus ``K`` tokens, and a retention too low for the window keeps the window plus one token
        (not the whole prompt), so a higher retention never holds less.

        With a protected prefix (``protect``), each budget is ``protect`` plus the budget of the ``n_tokens -
        protect`` tokens after it, by these same rules.
        """
        check_int("n_tokens", n_tokens, 1)
        if not self.protect:
            return self._prompt_budgets(num_layers, n_tokens, layers)
        if n_tokens <= self.protect:
            return [n_tokens] * num_layers
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PromptTooShortWarning)
            rest = self._prompt_budgets(num_layers, n_tokens - self.protect, layers)
        for warning in caught:  # said of the whole prompt, not of the part after the prefix alone
            warnings.warn(f"{warning.message} (the tokens after a protected prefix of {self.protect}, of "
                          f"{n_tokens})", warning.category, stacklevel=2)
        return [self.protect + b for b in rest]

    def _prompt_budgets(self, num_layers: int, n_tokens: int, layers: Optional[Sequence[int]]) -> list[int]:
        """``layer_budgets``' rules for ``n_tokens`` tokens with nothing protected before them."""
        if self.is_full or n_tokens <= self.window:
            return [n_tokens] * num_layers
        avg = average_budget(self.retention, n_tokens)
        if self.decode_budget is not None:
            # The generation's bound (decode_budget + K per layer) holds from the prefill on, and a lower retention
            # never holds more: one too low for the window keeps the window plus one token.
            avg = min(max(avg, self.window + 1), self.decode_budget)
        if avg >= n_tokens:
            return [n_tokens] * num_layers
        if avg <= self.window:
            warnings.warn(f"retention {self.retention:g} of a {n_tokens}-token prompt is an average budget of {avg} "
                          f"tokens, not more than the window ({self.window}): the prompt is left uncompressed",
                          PromptTooShortWarning, stacklevel=3)  # layer_budgets' caller
            return [n_tokens] * num_layers
        return self._allocate(num_layers, n_tokens, avg, layers)

    def attention_layer_budgets(self, preferences: Sequence[float], n_tokens: int,
                                layers: Optional[Sequence[int]] = None) -> list[int]:
        """Budget of each compressible layer for an ``n_tokens`` prompt from the layers' ``preferences``, read from
        the prompt's attention (an allocator that ``reads_attention``: CAKE), one per layer; the same rules as
        ``layer_budgets`` for Full and prompts too short to compress."""
        plan = self.layer_budgets(len(preferences), n_tokens, layers)
        if not self.reads_attention or all(budget == n_tokens for budget in plan):
            return plan
        budgets = self.allocator.attention_budgets(list(preferences), n_tokens,
                                                   average_budget(self.retention, n_tokens), self.window)
        if len(budgets) != len(plan):
            raise ValueError(f"allocator {self.allocator!r} returned {len(budgets)} budgets for {len(plan)} layers")
        return [int(b) for b in budgets]

    def decode_average_budget(self, prompt_tokens: int) -> int:
        """Average tokens per layer held while generating after a ``prompt_tokens`` prompt (``decode_every`` on):
        ``decode_budget``, or else the prompt's own average budget. Not above the window: nothing is compressed."""
        if self.decode_every is None:
            raise ValueError(f"policy {self.name} does not compress during decoding: build it with decode_every=K")
        check_int("prompt_tokens", prompt_tokens, 1)
        if self.decode_budget is not None:
            return self.decode_budget
        return average_budget(self.retention, prompt_tokens)

    def decode_layer_budgets(self, num_layers: int, n_tokens: int, prompt_tokens: int,
                             layers: Optional[Sequence[int]] = None) -> list[int]:
        """Budget of each compressible layer when it re-selects during decoding, ``n_tokens`` (prompt + generated)
        having been seen after a ``prompt_tokens`` prompt: the allocator's split of ``decode_average_budget`` for
        ``n_tokens``, so the total is the same at every step and for every allocator. ``n_tokens`` for a layer
        means it keeps everything (the sequence is still within the budget, or the prompt was too short for
        its retention and no ``decode_budget`` was given).
        """
        check_int("n_tokens", n_tokens, 1)
        avg = self.decode_average_budget(prompt_tokens)
        if n_tokens < prompt_tokens:
            raise ValueError(f"n_tokens (prompt + generated) must be >= prompt_tokens = {prompt_tokens}, "
                             f"got {n_tokens}")
        if not self.protect:
            return self._decode_budgets(num_layers, n_tokens, avg, layers)
        if n_tokens <= self.protect:
            return [n_tokens] * num_layers
        # The part after the prefix, whose prompt is at least a token: a prompt within the prefix keeps everything
        # unless a decode_budget is given.
        rest_avg = self.decode_average_budget(max(prompt_tokens - self.protect, 1))
        return [self.protect + b for b in self._decode_budgets(num_layers, n_tokens - self.protect, rest_avg, layers)]

    def _decode_budgets(self, num_layers: int, n_tokens: int, avg: int, layers: Optional[Sequence[int]]) -> list[int]:
        """``decode_layer_budgets``' split of ``avg`` over ``n_tokens`` tokens with nothing protected before them."""
        if avg >= n_tokens or avg <= self.window:
            return [n_tokens] * num_layers
        return self._allocate(num_layers, n_tokens, avg, layers)

    def _allocate(self, num_layers: int, n_tokens: int, avg: int, layers: Optional[Sequence[int]]) -> list[int]:
        budgets = self.allocator.budgets(num_layers, n_tokens, avg, self.window,
                                         layers=None if layers is None else list(layers))
        if len(budgets) != num_layers:
            raise ValueError(f"allocator {self.allocator!r} returned {len(budgets)} budgets for {num_layers} layers")
        return [int(b) for b in budgets]

    # The published pairings, by name.
    @classmethod
    def full(cls) -> "Policy":
        return cls()

    # ``decode_every``/``decode_budget``: compression during decoding; ``protect``: a protected prefix (the class
    # docstring).
    @classmethod
    def snapkv(cls, retention: float, window: int = DEFAULT_WINDOW, *, decode_every: Optional[int] = None,
               decode_budget: Optional[int] = None, prefill_chunk: Optional[int] = None, protect: int = 0,
               **selector_options) -> "Policy":
        return cls(UniformAllocator(), SnapKVSelector(**selector_options), retention, window, decode_every,
                   decode_budget, prefill_chunk, protect)

    @classmethod
    def pyramidkv(cls, retention: float, window: int = DEFAULT_WINDOW, beta: int = 20, *,
                  decode_every: Optional[int] = None, decode_budget: Optional[int] = None,
                  prefill_chunk: Optional[int] = None, protect: int = 0) -> "Policy":
        return cls(PyramidKVAllocator(beta), SnapKVSelector(), retention, window, decode_every, decode_budget,
                   prefill_chunk, protect)

    @classmethod
    def ripplekv(cls, profile_or_sensitivity, retention: float, window: int = DEFAULT_WINDOW,
                 ratio: Optional[float] = None, normalize: Optional[str] = None, *,
                 exponent: Optional[float] = None, selector: Optional[Selector] = None,
                 decode_every: Optional[int] = None, decode_budget: Optional[int] = None,
                 prefill_chunk: Optional[int] = None, protect: int = 0) -> "Policy":
        """RippleKV's per-layer budgets with ``selector`` inside each layer: by default ``PeakSpanSelector``
        (sinks, a recent region each head sizes by its window's attention, then half the rest to SnapKV's
        max-pooled peaks and half to its average-pooled spans, each position's attention weighted by its value's
        norm), chosen on calibration text and retrieval prompts (docs/defaults.md); ``selector=SnapKVSelector()``
        is the paper's
        pairing. Budgets follow ``sensitivity ** exponent`` (square root by default), or the paper's clipped
        ``R ** z`` when ``ratio`` or ``normalize`` is given (``RippleKVAllocator`` and ``RippleKVRatioAllocator``)."""
        if ratio is not None or normalize is not None:
            if exponent is not None:
                raise ValueError("pass either exponent (weights s ** exponent) or ratio / normalize (weights R ** z), "
                                 "not both")
            allocator = RippleKVRatioAllocator(profile_or_sensitivity, DEFAULT_RATIO if ratio is None else ratio,
                                               DEFAULT_NORMALIZE if normalize is None else normalize)
        else:
            allocator = RippleKVAllocator(profile_or_sensitivity, DEFAULT_EXPONENT if exponent is None else exponent)
        return cls(allocator,
                   DEFAULT_RIPPLEKV_SELECTOR() if selector is None else selector, retention, window, decode_every,
                   decode_budget, prefill_chunk, protect)

    @classmethod
    def cake(cls, retention: float, window: int = DEFAULT_WINDOW, tau1: float = DEFAULT_TAU1,
             tau2: float = DEFAULT_TAU2, gamma: float = DEFAULT_GAMMA) -> "Policy":
        """CAKE (``ripplekv_ext.budgets.cake``, ``ripplekv_ext.selection.cake``): each layer's budget from its window
        attention's entropy and variance, tokens by the window's mean attention + ``gamma`` x its variance. Its budgets
        are read from the prompt, so it compresses at the end of a one-forward prefill only (no ``prefill_chunk``, no
        ``decode_every``)."""
        return cls(CakeAllocator(tau1, tau2), CakeSelector(gamma), retention, window)

    @classmethod
    def h2o(cls, retention: float, window: int = DEFAULT_WINDOW, chunk_size: int = 1024) -> "Policy":
        return cls(UniformAllocator(), H2OSelector(chunk_size), retention, window)

    @classmethod
    def streamingllm(cls, retention: float, window: int = DEFAULT_WINDOW, sink: int = 4, *,
                     decode_every: Optional[int] = None, decode_budget: Optional[int] = None,
                     prefill_chunk: Optional[int] = None, protect: int = 0) -> "Policy":
        return cls(UniformAllocator(), StreamingLLMSelector(sink), retention, window, decode_every, decode_budget,
                   prefill_chunk, protect)
