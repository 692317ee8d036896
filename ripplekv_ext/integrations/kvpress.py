"""RippleKV inside kvpress: two presses a kvpress user adds to ``with press(model)`` or to kvpress's pipeline.

* ``RippleKVPress(compression_ratio, profile)``: the package's default method, ``Policy.ripplekv`` (a RippleKV profile's
  per-layer budgets, the value-weighted PeakSpan selection through the fused scoring, top-k and gather kernels).
* ``RippleKVBudgetPress(press, profile)``: any kvpress ``ScorerPress`` (SnapKV, ExpectedAttention, KnormPress, TOVA,
  ...) choosing the tokens, RippleKV choosing how many each layer keeps; every layer keeps the observation window
  (its last ``window`` tokens), as every RippleKV selector does. ``press`` may be an ``AdaKVPress`` over a scorer:
  its head-wise budgets then split each layer's RippleKV budget across the layer's KV heads (``AdaKVSelector``).

At a compression ratio ``c`` both keep ``L * n_kept`` tokens over the ``L`` compressed layers, ``n_kept`` being what
kvpress's uniform press keeps per layer (``kvpress.utils.compute_n_kept``), split over the layers by the profile
(``profile``: a ``ripplekv profile`` JSON file, a loaded ``Profile``, or one sensitivity per compressible layer).

Per-layer budgets leave layers of different lengths, which stock SDPA attention cannot mask (kvpress's
``PerLayerCompressionPress`` needs flash attention for that reason): a press runs a ``ripplekv_ext.compress`` block,
whose attention masks each layer by its own length, on any attention implementation. The presses are
``PrefillDecodingPress``es so that kvpress's pipeline keeps them open while it decodes; like kvpress's decoding
presses they take one question per pipeline call (ask again for another, or use ``ripplekv_ext.compress_context``
to compress a context once for many questions).

Imported only on demand (``import ripplekv_ext`` does not import kvpress); written for kvpress ``SUPPORTED_KVPRESS``.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Optional

from torch import Tensor

from ripplekv_ext.budgets.allocators import Allocator, RippleKVAllocator
from ripplekv_ext.selection.adakv import AdaKVSelector
from ripplekv_ext.policies import DEFAULT_RIPPLEKV_SELECTOR, DEFAULT_WINDOW, Policy
from ripplekv_ext.selection.selectors import ScoredSelector

SUPPORTED_KVPRESS = ("0.5.5",)

try:
    from kvpress.presses.adakv_press import AdaKVPress
    from kvpress.presses.prefill_decoding_press import PrefillDecodingPress
    from kvpress.presses.scorer_press import ScorerPress
    from kvpress.utils import compute_n_kept
except ImportError as error:  # pragma: no cover - exercised in an environment without kvpress
    raise ImportError("ripplekv_ext.integrations.kvpress needs kvpress: pip install kvpress==0.5.5 (it requires "
                      "transformers<5.3)") from error

def _installed_kvpress() -> str:
    from importlib.metadata import version

    return version("kvpress")


if _installed_kvpress() not in SUPPORTED_KVPRESS:
    raise ImportError(f"ripplekv_ext.integrations.kvpress was written for kvpress {', '.join(SUPPORTED_KVPRESS)} (its "
                      f"press and pipeline internals); kvpress {_installed_kvpress()} is installed: "
                      f"pip install kvpress=={SUPPORTED_KVPRESS[-1]}")

__all__ = ["RippleKVPress", "RippleKVBudgetPress", "KVPressTotal", "ScorerPressSelector", "SUPPORTED_KVPRESS"]


def _check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise ValueError(f"compression_ratio must be a number in [0, 1) (the fraction of the cache removed, as in "
                         f"kvpress), got {ratio!r}")
    return float(ratio)


class KVPressTotal(Allocator):
    """``base``'s split of kvpress's total: each layer's average is ``compute_n_kept(N, compression_ratio)``, what a
    uniform kvpress press keeps, instead of ``round(retention * N)``."""

    def __init__(self, base: Allocator, compression_ratio: float):
        self.base = base
        self.compression_ratio = _check_ratio(compression_ratio)
        self.name = base.name

    def budgets(self, num_layers, n_tokens, avg_budget, window, layers=None):
        return self.base.budgets(num_layers, n_tokens, compute_n_kept(n_tokens, self.compression_ratio), window,
                                 layers=layers)

    def __repr__(self):
        return f"KVPressTotal({self.base!r}, compression_ratio={self.compression_ratio:g})"


_CALL = threading.local()  # the attention module, its hidden states and kwargs of the layer being compressed


class ScorerPressSelector(ScoredSelector):
    """A kvpress ``ScorerPress``'s ``score`` as the selector of a ``Policy``: the top scores before the window, and
    the window. Scorers reading attention weights (``ObservedAttentionPress``) are refused: none are computed."""

    needs_values = True

    def __init__(self, press):
        if not isinstance(press, ScorerPress):
            raise TypeError(f"press must be a kvpress ScorerPress (SnapKVPress, ExpectedAttentionPress, KnormPress, "
                            f"TOVAPress, ...), got {type(press).__name__}")
        if type(press).__name__ == "ObservedAttentionPress":
            raise ValueError("ObservedAttentionPress scores with the attention weights of an eager forward, which a "
                             "ripplekv_ext.compress block does not keep; choose another ScorerPress")
        self.press = press
        self.name = f"kvpress-{type(press).__name__}"

    def score(self, queries: Tensor, keys: Tensor, window: int, scale=None, lengths=None, values=None) -> Tensor:
        if lengths is not None:
            raise ValueError("kvpress scorers take unpadded batches: compress the prompts of a padded batch one at a "
                             "time")
        module, hidden_states, kwargs = getattr(_CALL, "layer", (None, None, None))
        if module is None:
            raise RuntimeError("a kvpress scorer runs inside a RippleKVBudgetPress block only")
        scores = self.press.score(module, hidden_states, keys, values, None, kwargs)
        return scores[..., :keys.shape[2] - window].float().contiguous()

    def __repr__(self):
        return f"ScorerPressSelector({self.press!r})"


def _sensitivity(profile):
    from ripplekv_ext.budgets.profile_file import load_profile

    if isinstance(profile, (str, bytes)) or hasattr(profile, "__fspath__"):
        return load_profile(profile)
    return profile


@dataclass(kw_only=True)
class _BlockPress(PrefillDecodingPress):
    compression_ratio: float = 0.0
    profile: object = None
    window: int = DEFAULT_WINDOW
    force: bool = False  # use a profile measured on another model (its shape must still fit)

    def __post_init__(self):
        _check_ratio(self.compression_ratio)
        if self.profile is None:
            raise ValueError("profile must be a RippleKV profile of the model (a `ripplekv profile` JSON file, a "
                             "loaded Profile, or one sensitivity per compressible layer)")

    def policy(self, model) -> Policy:
        """What the press runs on ``model``: its ``ripplekv_ext.compress`` policy."""
        from ripplekv_ext.model_info import compressible_layers

        profile = _sensitivity(self.profile)
        if hasattr(profile, "check_model"):
            profile.check_model(model, force=self.force, way_out="pass force=True to use it anyway")
        elif len(list(profile)) != len(compressible_layers(model)):
            raise ValueError(f"profile must hold one sensitivity per compressible layer "
                             f"({len(compressible_layers(model))}), got {len(list(profile))}")
        allocator = KVPressTotal(RippleKVAllocator(profile), self.compression_ratio)
        return Policy(allocator, self.selector(), 1.0 - self.compression_ratio if self.compression_ratio else 1.0,
                      self.window)

    def selector(self):
        raise NotImplementedError

    def _refuse_nesting(self, *args):
        # kvpress's wrappers (ComposedPress, ...) run a press through its per-layer hook or compress(); this press
        # compresses through its own block instead, so inside one it would compress nothing and report its ratio.
        raise ValueError(f"{type(self).__name__} compresses through its own ripplekv_ext.compress block and cannot "
                         "run inside another press (ComposedPress, a decoding or chunk wrapper): use it alone, "
                         "`with press(model):` or as the pipeline's press=")

    forward_hook = compress = _refuse_nesting

    @contextlib.contextmanager
    def __call__(self, model):
        from ripplekv_ext.transformers_front.compress_block import compress

        if self.compression_ratio == 0:
            yield
            return
        with compress(model, self.policy(model)), self._layer_calls(model):
            yield

    @contextlib.contextmanager
    def _layer_calls(self, model):
        yield


@dataclass(kw_only=True)
class RippleKVPress(_BlockPress):
    """RippleKV as a kvpress press: ``Policy.ripplekv``'s budgets and selection at kvpress's ``compression_ratio``."""

    def selector(self):
        return DEFAULT_RIPPLEKV_SELECTOR()


@dataclass(kw_only=True)
class RippleKVBudgetPress(_BlockPress):
    """``press`` (a kvpress ``ScorerPress``) choosing the tokens, RippleKV's per-layer budgets at ``press``'s
    ``compression_ratio`` (or this press's, when given)."""

    press: Optional[object] = field(default=None)

    def __post_init__(self):
        self.selector()  # the press's own checks, before any model is seen
        if not self.compression_ratio:
            self.compression_ratio = self.press.compression_ratio
        super().__post_init__()

    def selector(self):
        if isinstance(self.press, AdaKVPress):  # its head-wise budgets inside each of our layer budgets
            return AdaKVSelector(ScorerPressSelector(self.press.press), alpha=self.press.alpha_safeguard)
        return ScorerPressSelector(self.press)

    @contextlib.contextmanager
    def _layer_calls(self, model):
        # kvpress scorers read the attention module, its input hidden states and forward kwargs (position
        # embeddings, cache position), which the block's attention does not see: kept for the layer being run.
        self.press.post_init_from_model(model)  # an AdaKVPress passes it to its scorer
        language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
        handles = []

        def keep(module, args, kwargs):
            _CALL.layer = (module, kwargs.get("hidden_states", args[0] if args else None), kwargs)

        added = []
        try:
            for layer in language_model.layers:
                if not hasattr(layer.self_attn, "rotary_emb"):  # some kvpress scorers read it there
                    layer.self_attn.rotary_emb = language_model.rotary_emb
                    added.append(layer.self_attn)
                handles.append(layer.self_attn.register_forward_pre_hook(keep, with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for attention in added:
                del attention.rotary_emb
            _CALL.layer = None
