"""What a compressed context carries and how it is checked, saved and loaded: the ``ContextStamp`` that
``compress_context`` puts on its cache (the model's identity, the policy, the context's ids and a digest of the cache),
``check_context`` (the model continuing it is the model that compressed it), and ``load_context`` (a saved context,
read back with ``torch.load(..., weights_only=True)``)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ripplekv_ext.transformers_front.digests import cache_digest, weights_digest
from ripplekv_ext.policies import Policy

__all__ = ["ContextStamp", "STAMP_ATTRIBUTE", "check_context", "check_model", "load_context", "model_identity"]

STAMP_ATTRIBUTE = "ripplekv_context"
# What identifies a model for a cache: another model of this shape would take the cache silently and answer
# from keys it never computed, so the config hash and a digest of every weight are compared too (a fine-tuning step
# or a merged LoRA on one projection changes the keys and values the cache would need).
_IDENTITY_FIELDS = ("architecture", "num_layers", "num_kv_heads", "head_dim", "config_sha256", "weight_sample",
                    "weights_digest")


def model_identity(model) -> dict:
    """The fields of ``profile_file.describe_model`` that tell one model from another (the name may differ), and the
    digest of all its weights (``weights_digest``)."""
    from ripplekv_ext.budgets.profile_file import describe_model

    info = describe_model(model)
    fingerprint = info.pop("fingerprint")
    info.update(fingerprint)
    info["weights_digest"] = weights_digest(model)
    return {key: info[key] for key in _IDENTITY_FIELDS}


@dataclass(frozen=True, eq=False)
class ContextStamp:
    """What a compressed context cache carries (``cache.ripplekv_context``).

    ``context_ids`` ``[B, n]`` and ``attention_mask`` (``[B, n]``, None when no row is padded) are the context's
    tokens; ``policy`` compressed it (its own window, even when a probe scored it); ``probe_tokens`` is the probe's
    length (0: the context's tail was the window); ``model`` is ``model_identity`` of the model it belongs to.
    """

    model: dict
    policy: Policy
    context_ids: Tensor
    attention_mask: Optional[Tensor]
    probe_tokens: int
    cache_digest: Optional[str] = None  # cache_digest of the cache compress_context returned (None: saved before it)

    def __deepcopy__(self, memo):
        # Immutable and shared: a copied cache answers for the same context, model and policy.
        return self


def check_model(model) -> None:
    if not (hasattr(model, "config") and hasattr(model, "generate")):
        raise TypeError(f"model must be a transformers causal LM (with .config and .generate), got "
                        f"{type(model).__name__}")


def check_context(model, cache) -> ContextStamp:
    """The cache's ``ContextStamp``, after checking that ``compress_context`` made it on this model: same architecture,
    layer and head counts, config and weight sample (``model_identity``), so a replica of the model may continue it."""
    stamp = getattr(cache, STAMP_ATTRIBUTE, None)
    if not isinstance(stamp, ContextStamp):
        raise TypeError(f"cache must be what ripplekv_ext.compress_context returned, got {type(cache).__name__} "
                        "without a context stamp")
    check_model(model)
    mine = model_identity(model)
    # A context saved before a field existed is checked on the fields it has.
    differ = [key for key in _IDENTITY_FIELDS if key in stamp.model and mine[key] != stamp.model[key]]
    if differ:
        shown = ", ".join(f"{key}: {stamp.model[key]} vs {mine[key]}" for key in differ
                          if key not in ("weight_sample", "weights_digest"))
        raise ValueError(f"this compressed context belongs to another model ({shown or 'same config, other weights'}"
                         "); compress the context again with this model")
    return stamp


def _saved_classes() -> list:
    """The classes a saved context is made of: transformers' cache and layers, this package's layer, stamp, policy
    and profile, and every allocator and selector the package defines (found as subclasses, so that a new one cannot
    be left out)."""
    from ripplekv_ext.budgets import cake, tiers  # noqa: F401  (they define allocators too)
    from ripplekv_ext.selection import adakv, cake as cake_selector  # noqa: F401  (and selectors)
    from ripplekv_ext.budgets.allocators import Allocator
    from ripplekv_ext.integrations.transformers import cache_classes
    from ripplekv_ext.budgets.profile_file import Profile
    from ripplekv_ext.selection.selectors import Selector

    classes = [*cache_classes(), ContextStamp, Policy, Profile, *_package_subclasses(Allocator),
               *_package_subclasses(Selector)]
    return classes + _old_paths(classes)


def _old_paths(classes: list) -> list[tuple]:
    """``(class, "old.module.Name")`` for each class of a module the package moved: a context saved before the move
    names its classes by their old modules."""
    from ripplekv_ext._old_names import MOVED_MODULES

    return [(cls, f"{old}.{cls.__qualname__}") for old, places in MOVED_MODULES.items() for cls in classes
            if cls.__module__ in places]


def _package_subclasses(base: type) -> list[type]:
    """``base``'s subclasses, at any depth, that this package defines (a user's own are theirs to allow)."""
    found, todo = [], [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                todo.append(sub)
                if sub.__module__.split(".")[0] == "ripplekv_ext":
                    found.append(sub)
    return found


def load_context(path, *, map_location=None):
    """A compressed context saved with ``torch.save(cache, path)``, loaded with ``weights_only=True``.

    Only the classes such a cache is made of are allowed in; a policy with a custom allocator or selector names it
    in torch's error: load it within ``torch.serialization.safe_globals([...])`` naming that class too (or, for a
    file you trust, ``torch.load(path, weights_only=False)``). ``map_location`` is ``torch.load``'s (the model's
    device: ``continue_context`` wants the cache where the model is).
    """
    try:
        with torch.serialization.safe_globals(_saved_classes()):
            cache = torch.load(path, map_location=map_location, weights_only=True)
    except (EOFError, pickle.UnpicklingError, OSError, RuntimeError) as err:
        if isinstance(err, FileNotFoundError) or "weights_only" in str(err):
            raise  # a missing file, or a class a policy of one's own needs allowed: torch's message says it
        raise ValueError(f"{path} is not a readable saved context (truncated, empty or damaged: "
                         f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no data'}); save it "
                         "again with torch.save(cache, path)") from err
    stamp = getattr(cache, STAMP_ATTRIBUTE, None)
    if not isinstance(stamp, ContextStamp):
        raise TypeError(f"{path} holds a {type(cache).__name__}, not a context saved from "
                        "ripplekv_ext.compress_context")
    if stamp.cache_digest is not None and cache_digest(cache) != stamp.cache_digest:
        raise ValueError(f"{path}: the cache's tensors differ from what compress_context made (their digest does "
                         "not match the stamp's): the file is damaged, or the context was continued with "
                         "copy_cache=False before it was saved. Compress the context again")
    return cache
