"""The supported torch and transformers ranges, and the adapters for transformers' differences within them.

Imports only torch at its top (transformers lazily), so the package can name the supported range when
transformers is missing. Supported: the ranges below (also declared in pyproject.toml and docs/install.md).
``check_versions()`` runs when a ``compress(...)`` block opens and raises one ``RuntimeError`` naming the installed and
the supported versions, instead of a traceback from deep inside transformers. ``RIPPLEKV_ALLOW_UNSUPPORTED=1`` turns
that error into a warning, for trying a stack outside the ranges (a GPU image with an older torch, say) at one's own
risk.

Within the range, the cache and attention APIs the hook uses changed in three places; each is detected from the
installed transformers itself (not from its version number), so a release in between works whichever side of a
change it is on:

* the cache argument of the models' ``forward`` and the field of their outputs: ``past_key_values`` (5.2), then
  ``cache`` (5.24 still accepts the old name, with a deprecation warning);
* ``CacheLayer.get_mask_sizes``: given the ``cache_position`` tensor of the new tokens (5.2), then their count;
* ``CacheLayer.crop``: a target length, or minus the number of tokens to remove (5.2), then only the latter.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import warnings

import torch

# Keep in step with pyproject.toml (`dependencies`, the `eval` extra) and docs/install.md.
SUPPORTED_TORCH = ((2, 13), None)  # >= 2.13
SUPPORTED_TRANSFORMERS = ((5, 2), (6, 0))  # >= 5.2, < 6
SUPPORTED_TORCH_TEXT = "torch>=2.13"
SUPPORTED_TRANSFORMERS_TEXT = "transformers>=5.2,<6"


def _release(version: str) -> tuple[int, ...]:
    """``"5.24.0"`` -> ``(5, 24, 0)``; local and pre-release suffixes (``+cpu``, ``.dev0``, ``rc1``) dropped."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != part:
            break
    return tuple(parts)


def _in_range(version: str, bounds) -> bool:
    low, high = bounds
    release = _release(version)
    return release >= low and (high is None or release < high)


def installed_versions() -> dict:
    """The installed torch and transformers versions (transformers: None when it is not installed)."""
    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {"torch": torch.__version__, "transformers": transformers_version}


ALLOW_UNSUPPORTED_VARIABLE = "RIPPLEKV_ALLOW_UNSUPPORTED"


class UnsupportedVersionWarning(UserWarning):
    """torch or transformers is outside the supported ranges and RIPPLEKV_ALLOW_UNSUPPORTED=1 lets it go on."""


def check_versions() -> None:
    """Raise one clear error when the installed torch or transformers is outside the supported ranges."""
    installed = installed_versions()
    problems = []
    if not _in_range(installed["torch"], SUPPORTED_TORCH):
        problems.append(f"torch {installed['torch']} is installed, ripplekv_ext supports {SUPPORTED_TORCH_TEXT}")
    if installed["transformers"] is None:
        problems.append(f"transformers is not installed, ripplekv_ext.compress needs {SUPPORTED_TRANSFORMERS_TEXT}")
    elif not _in_range(installed["transformers"], SUPPORTED_TRANSFORMERS):
        problems.append(f"transformers {installed['transformers']} is installed, ripplekv_ext.compress supports "
                        f"{SUPPORTED_TRANSFORMERS_TEXT}")
    if not problems:
        return
    message = "ripplekv_ext: unsupported versions: " + "; ".join(problems)
    if os.environ.get(ALLOW_UNSUPPORTED_VARIABLE) == "1" and installed["transformers"] is not None:
        warnings.warn(message + f" ({ALLOW_UNSUPPORTED_VARIABLE}=1: going on, untested)", UnsupportedVersionWarning)
        return
    raise RuntimeError(message + f". Install supported ones, e.g. `pip install '{SUPPORTED_TRANSFORMERS_TEXT}'` "
                       f"(or set {ALLOW_UNSUPPORTED_VARIABLE}=1 to try anyway).")


# -- adapters, detected from the installed transformers --------------------------------------------------------

@functools.lru_cache(maxsize=None)
def cache_argument() -> str:
    """The name under which models take the KV cache and return it: ``"cache"`` or ``"past_key_values"``."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    fields = getattr(BaseModelOutputWithPast, "__dataclass_fields__", {})
    return "cache" if "cache" in fields else "past_key_values"


def output_cache(output):
    """The cache a model call returned (``output.cache``, or ``output.past_key_values`` before the rename)."""
    return getattr(output, cache_argument())


def query_length(query_length_or_cache_position) -> int:
    """The argument of ``CacheLayer.get_mask_sizes`` as a token count (older releases pass ``cache_position``)."""
    if isinstance(query_length_or_cache_position, torch.Tensor):
        return query_length_or_cache_position.shape[0]
    return int(query_length_or_cache_position)


@functools.lru_cache(maxsize=None)
def _crop_takes_target_length() -> bool:
    from transformers.cache_utils import DynamicLayer

    return "max_length" in inspect.signature(DynamicLayer.crop).parameters


def tokens_to_remove(crop_argument: int, seq_length: int) -> int:
    """How many tokens ``CacheLayer.crop(crop_argument)`` removes from a layer holding ``seq_length`` tokens.

    Older releases pass a target length (minus a count when negative), newer ones only minus a count.
    """
    if crop_argument < 0:
        return -crop_argument
    if _crop_takes_target_length():
        return max(seq_length - crop_argument, 0)
    if crop_argument > 0:
        raise ValueError(f"crop takes minus the number of tokens to remove, got {crop_argument}")
    return 0
