"""The plugin's settings: ``Settings.from_config(additional_config["ripplekv"])`` reads and checks what a user wrote
(imports nothing from vLLM); ``plan.plan_for`` turns them into the engine's plan."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from ripplekv_ext.checks import check_int, is_integer
from ripplekv_ext.methods import check_method, needs_profile
from ripplekv_ext.policies import DEFAULT_WINDOW

__all__ = ["CONFIG_KEY", "Settings"]

# additional_config[CONFIG_KEY] holds the settings (``--additional-config '{"ripplekv": {...}}'``).
CONFIG_KEY = "ripplekv"
_KEYS = ("method", "retention", "window", "profile", "tiers", "prefill_chunk", "decode_every", "decode_budget",
         "protect_prefix", "compress_prefix")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a user asks for, as ``additional_config["ripplekv"]`` holds it; docs/vllm.md ("vLLM settings") explains
    each key: ``method`` (a name of ``ripplekv_ext.methods``), ``retention`` in (0, 1], ``window`` (``W``),
    ``profile`` (``ripplekv`` only), ``tiers`` (``T``; default one for uniform methods, one per layer otherwise),
    ``prefill_chunk`` (``R``), ``decode_every`` (``K``), ``decode_budget``, ``protect_prefix`` (``P``: kept whole, as
    ``Policy.protect``) and ``compress_prefix`` (``P``: compressed once and shared,
    ``plan.EnginePlan.compacts_prefix``)."""

    method: str
    retention: float
    window: int = DEFAULT_WINDOW
    profile: Optional[str] = None
    tiers: Optional[int] = None
    prefill_chunk: Optional[int] = None
    decode_every: Optional[int] = None
    decode_budget: Optional[int] = None
    protect_prefix: int = 0
    compress_prefix: int = 0

    @classmethod
    def from_config(cls, config) -> "Settings":
        """Settings from ``additional_config["ripplekv"]`` (a dict); every problem is a ``ValueError`` naming the
        key, what it must be and what it was."""
        where = f'additional_config["{CONFIG_KEY}"]'
        if not isinstance(config, dict):
            raise ValueError(f"{where} must be a dict like {{\"method\": \"snapkv\", \"retention\": 0.2}}, got "
                             f"{type(config).__name__}")
        unknown = sorted(set(config) - set(_KEYS))
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; the keys are {list(_KEYS)}")
        if "method" not in config or "retention" not in config:
            raise ValueError(f"{where} must give \"method\" (e.g. \"snapkv\" or \"ripplekv\") and \"retention\" "
                             "(in (0, 1])")
        try:
            method = check_method(config["method"])
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}[\"method\"]: {err}") from None
        if method == "full":
            raise ValueError(f"{where}[\"method\"] full compresses nothing: drop additional_config[\"{CONFIG_KEY}\"] "
                             "to run stock vLLM")
        retention = config["retention"]
        if isinstance(retention, bool) or not isinstance(retention, (int, float)) or not 0 < retention <= 1:
            raise ValueError(f"{where}[\"retention\"] must be a number in (0, 1], got {retention!r}")
        window = check_int(f'{where}["window"]', config.get("window", DEFAULT_WINDOW), 1)
        profile = config.get("profile")
        if needs_profile(method):
            if not isinstance(profile, str) or not profile:
                raise ValueError(f"{where}[\"profile\"] must be the path of a RippleKV profile JSON file for method "
                                 f"{method} (`ripplekv profile` writes one), got {profile!r}")
            profile = os.path.abspath(os.path.expanduser(profile))  # every vLLM process reads the same file
        elif profile is not None:
            raise ValueError(f"{where}[\"profile\"] is only read by RippleKV's budgets, not {method}: drop it")
        tiers = config.get("tiers")
        if tiers is not None and (not is_integer(tiers) or tiers < 1):
            raise ValueError(f"{where}[\"tiers\"] must be an integer >= 1 (it must divide the number of layers), "
                             f"got {tiers!r}")
        chunk = config.get("prefill_chunk")
        if chunk is not None and (not is_integer(chunk) or chunk <= window):
            raise ValueError(f"{where}[\"prefill_chunk\"] must be an integer > window = {window} (prompt tokens "
                             f"between compactions, a multiple of the block size, e.g. 512), got {chunk!r}")
        decode = {}
        for key in ("decode_every", "decode_budget"):
            value = config.get(key)
            if value is not None and (not is_integer(value) or value < 1):
                raise ValueError(f"{where}[\"{key}\"] must be an integer >= 1 (tokens; e.g. 128), got {value!r}")
            decode[key] = None if value is None else int(value)
        protect = config.get("protect_prefix", 0)
        if not is_integer(protect) or protect < 0:
            raise ValueError(f"{where}[\"protect_prefix\"] must be an integer >= 0 (prompt tokens kept whole, a "
                             f"multiple of the block size, e.g. a system prompt's 512), got {protect!r}")
        prefix = config.get("compress_prefix", 0)
        if not is_integer(prefix) or prefix < 0:
            raise ValueError(f"{where}[\"compress_prefix\"] must be an integer >= 0 (prompt tokens compressed once and "
                             f"shared, a multiple of the block size, e.g. a system prompt's 1536), got {prefix!r}")
        if prefix:
            # The prefix's compacted blocks are shared as they are: nothing may compact them again, and a request
            # reads nothing else in chunks.
            clash = [key for key in ("protect_prefix", "prefill_chunk", "decode_every", "decode_budget")
                     if config.get(key)]
            if clash:
                raise ValueError(f"{where}[\"compress_prefix\"] compresses each prompt once, at its prefix, and "
                                 f"keeps the rest whole: it cannot run with {clash}; drop "
                                 f"{'it' if len(clash) == 1 else 'them'} or compress_prefix")
        return cls(method, float(retention), window, profile, None if tiers is None else int(tiers),
                   None if chunk is None else int(chunk), **decode, protect_prefix=int(protect),
                   compress_prefix=int(prefix))

    def to_json(self) -> str:
        """Canonical JSON: it travels inside vLLM's KV cache specs to the scheduler process."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        return cls(**json.loads(text))
