"""RippleKV sensitivity profile files: versioned JSON, written atomically, validated on load.

A profile belongs to one checkpoint. Its model fingerprint (a hash of the config plus a small sample of
weights) is checked against the model it is applied to; the weight sample is compared with a tolerance so a
profile measured in fp32 still applies to the same checkpoint loaded in bf16.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ripplekv_ext.jsonio import write_json_atomic
from ripplekv_ext.model_info import text_config

FORMAT_NAME = "ripplekv-profile"
FORMAT_VERSION = 1
TARGETS = ("values", "keys", "both")
# Relative tolerance of the weight sample: bf16 keeps ~3 significant digits.
WEIGHT_SAMPLE_RTOL = 2e-2
# Config keys that change with how a checkpoint is loaded, not with what it is.
_VOLATILE_CONFIG_KEYS = {"dtype", "torch_dtype", "transformers_version", "use_cache", "name_or_path",
                         "architectures", "output_attentions", "output_hidden_states", "return_dict"}


class ProfileError(ValueError):
    """A profile file that is malformed, incomplete, or for another model."""


@dataclass
class Profile:
    """Per-layer sensitivity of one model, with everything needed to trust and reproduce it.

    `sensitivity[i]`, `stderr[i]` and `per_example[e][i]` belong to layer `layers[i]`.
    """

    model: dict          # name, architecture, num_layers, num_kv_heads, head_dim, fingerprint
    method: dict         # target, sigma, seed, draws, metric
    calibration: dict    # source, num_examples, prefix_len, cont_len
    layers: list         # profiled layer indices
    sensitivity: list    # mean KL per profiled layer
    stderr: list         # standard error over examples per profiled layer
    per_example: list    # [num_examples][len(layers)] per-example KL
    compressible_layers: list
    stability: dict      # split_half_spearman, until_stable, threshold
    cost: dict           # seconds, tokens_processed, device, reuse_hidden_states
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # free-form notes, carried through round trips

    def to_dict(self) -> dict:
        """A deep copy: editing it never changes the profile."""
        return copy.deepcopy({"format": self.format, "version": self.version, "model": self.model,
                "method": self.method, "calibration": self.calibration, "layers": self.layers,
                "sensitivity": self.sensitivity, "stderr": self.stderr, "per_example": self.per_example,
                "compressible_layers": self.compressible_layers, "stability": self.stability,
                "cost": self.cost, "extra": self.extra})

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        validate_profile_dict(data)
        d = copy.deepcopy(data)
        return cls(**{k: d[k] for k in _REQUIRED_TOP}, extra=d.get("extra", {}))

    @classmethod
    def from_sensitivity(cls, model, sensitivity, name: str | None = None) -> "Profile":
        """A profile of ``model`` whose sensitivities are given, not measured (one value per compressible layer,
        ascending): for budgets from a sensitivity list of one's own, and for tests of the mechanics. Its method and
        calibration say so (``"source": "given"``)."""
        from ripplekv_ext.model_info import compressible_layers

        values = [float(x) for x in sensitivity]
        layers = compressible_layers(model)
        if len(values) != len(layers):
            raise ProfileError(f"sensitivity must hold one value per compressible layer ({len(layers)}: {layers}), "
                               f"got {len(values)}")
        return cls.from_dict({
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "model": describe_model(model, name),
            "method": {"target": "values", "sigma": 0.0, "seed": 0, "draws": 0, "metric": "given"},
            "calibration": {"source": "given", "num_examples": 1, "prefix_len": 0, "cont_len": 0},
            "layers": layers, "sensitivity": values, "stderr": [0.0] * len(values), "per_example": [values],
            "compressible_layers": layers, "stability": {"split_half_spearman": None, "until_stable": False},
            "cost": {"seconds": 0.0, "tokens_processed": 0, "device": "none"}})

    def sensitivity_by_layer(self) -> dict[int, float]:
        return dict(zip(self.layers, self.sensitivity))

    def check_shape(self, shape: dict, force: bool = False, way_out: str = "pass force=True to override") -> None:
        """Raise ProfileError unless ``shape`` (``model_shape``: layers, KV heads, head size) is this profile's
        model's (skipped with force=True). Needs only a config, so a caller can check before loading weights."""
        if force:
            return
        for key in ("num_layers", "num_kv_heads", "head_dim"):
            if shape[key] != self.model[key]:
                raise ProfileError(f"profile is for another model: model.{key} expected {self.model[key]} "
                                   f"(profile of {self.model['name']}), got {shape[key]} ({way_out})")

    def check_model(self, model, force: bool = False, way_out: str = "pass force=True to override") -> None:
        """Raise ProfileError unless this profile was measured on `model` (skipped with force=True). ``way_out``
        ends the message: how the caller's user overrides the check."""
        if force:
            return
        self.check_shape(model_shape(model), way_out=way_out)
        info = describe_model(model)
        mine, theirs = self.model["fingerprint"], info["fingerprint"]
        if mine["config_sha256"] != theirs["config_sha256"]:
            raise ProfileError(f"profile is for another model: config fingerprint expected {mine['config_sha256'][:16]}"
                               f" (profile of {self.model['name']}), got {theirs['config_sha256'][:16]} ({way_out})")
        if not _samples_match(mine["weight_sample"], theirs["weight_sample"]):
            raise ProfileError(f"profile is for another model: weight sample differs from the profile of "
                               f"{self.model['name']} (same config, other weights; {way_out})")


# ---- model description ---------------------------------------------------------------------------

def config_sha256(model) -> str:
    config = text_config(model).to_dict()
    clean = {k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()


def weight_sample(model, num_tensors: int = 16, per_tensor: int = 8) -> list[float]:
    """The first few elements of evenly spaced parameter tensors, as floats (dtype-independent)."""
    named = list(model.named_parameters())
    if not named:
        return []
    step = max(1, len(named) // num_tensors)
    out = []
    for name, p in named[::step][:num_tensors]:
        if p.device.type == "meta":  # offloaded by accelerate: the values live in its hook's weights map
            p = _offloaded_weight(model, name)
        out.extend(float(f"{x:.6g}") for x in p.detach().flatten()[:per_tensor].float().tolist())
    return out


def _offloaded_weight(model, name: str):
    """The stored values of parameter `name` of a model whose weights accelerate offloaded (device_map with "cpu"
    or "disk" entries, cpu_offload): its hooks keep them in a weights map under names relative to the module."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):  # the innermost module holding a weights map first
        module = model.get_submodule(".".join(parts[:cut]))
        weights = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        if weights is not None:
            try:
                return weights[".".join(parts[cut:])]
            except KeyError:
                continue
    raise ValueError(f"parameter {name} is on the meta device and no accelerate offload hook holds its values; "
                     "load the model's weights before describing or profiling it")


def _samples_match(a, b) -> bool:
    if len(a) != len(b):
        return False
    scale = max([abs(x) for x in a] + [1e-12])
    return all(abs(x - y) <= WEIGHT_SAMPLE_RTOL * max(abs(x), 0.05 * scale) for x, y in zip(a, b))


def model_shape(model_or_config) -> dict:
    """The layer count, KV heads and head size of a model or of its config (no weights needed)."""
    config = text_config(model_or_config)
    heads = config.num_attention_heads
    return {"num_layers": int(config.num_hidden_layers),
            "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // heads)}


def describe_model(model, name: str | None = None) -> dict:
    config = text_config(model)
    return {
        "name": name or getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", "") or "unnamed",
        "architecture": type(model).__name__,
        **model_shape(model),
        "fingerprint": {"config_sha256": config_sha256(model), "weight_sample": weight_sample(model)},
    }


# ---- validation ----------------------------------------------------------------------------------

_REQUIRED_TOP = ("model", "method", "calibration", "layers", "sensitivity", "stderr", "per_example",
                 "compressible_layers", "stability", "cost")
_REQUIRED_FIELDS = {
    "model": {"name": str, "architecture": str, "num_layers": int, "num_kv_heads": int, "head_dim": int,
              "fingerprint": dict},
    "method": {"target": str, "sigma": float, "seed": int, "draws": int, "metric": str},
    "calibration": {"source": str, "num_examples": int, "prefix_len": int, "cont_len": int},
    "stability": {"split_half_spearman": (float, type(None)), "until_stable": bool},
    "cost": {"seconds": float, "tokens_processed": int, "device": str},
}


def _fail(where: str, expected: str, got) -> None:
    raise ProfileError(f"profile field {where}: expected {expected}, got {got!r}")


def _check_type(where, value, typ):
    types = typ if isinstance(typ, tuple) else (typ,)
    if float in types:
        types = types + (int,)
    if isinstance(value, bool) and bool not in types:
        _fail(where, " or ".join(t.__name__ for t in types), value)
    if not isinstance(value, types):
        _fail(where, " or ".join(t.__name__ for t in types), value)
    if isinstance(value, float) and not math.isfinite(value):
        _fail(where, "a finite number", value)


def _check_number_list(where, values, length=None):
    if not isinstance(values, list):
        _fail(where, "a list of numbers", values)
    if length is not None and len(values) != length:
        _fail(where, f"{length} entries (one per profiled layer)", f"{len(values)} entries")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            _fail(f"{where}[{i}]", "a finite number", v)


def validate_profile_dict(data) -> None:
    """Raise ProfileError naming the first problem in a profile dictionary."""
    if not isinstance(data, dict):
        _fail("<root>", "a JSON object", type(data).__name__)
    if data.get("format") != FORMAT_NAME:
        _fail("format", repr(FORMAT_NAME), data.get("format"))
    if data.get("version") != FORMAT_VERSION:
        _fail("version", f"{FORMAT_VERSION} (this ripplekv_ext reads version {FORMAT_VERSION})", data.get("version"))
    for key in _REQUIRED_TOP:
        if key not in data:
            raise ProfileError(f"profile field {key}: missing")
    for section, fields in _REQUIRED_FIELDS.items():
        if not isinstance(data[section], dict):
            _fail(section, "an object", data[section])
        for name, typ in fields.items():
            if name not in data[section]:
                raise ProfileError(f"profile field {section}.{name}: missing")
            _check_type(f"{section}.{name}", data[section][name], typ)
    fp = data["model"]["fingerprint"]
    if not isinstance(fp.get("config_sha256"), str):
        _fail("model.fingerprint.config_sha256", "a hex string", fp.get("config_sha256"))
    _check_number_list("model.fingerprint.weight_sample", fp.get("weight_sample"))
    if data["method"]["target"] not in TARGETS:
        _fail("method.target", f"one of {TARGETS}", data["method"]["target"])
    num_layers = data["model"]["num_layers"]
    for key in ("layers", "compressible_layers"):
        layers = data[key]
        if not isinstance(layers, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
            _fail(key, "a list of layer indices", layers)
        if any(not 0 <= x < num_layers for x in layers) or len(set(layers)) != len(layers):
            _fail(key, f"distinct layer indices in [0, {num_layers})", layers)
    if not data["layers"]:
        _fail("layers", "at least one profiled layer", data["layers"])
    n = len(data["layers"])
    _check_number_list("sensitivity", data["sensitivity"], n)
    _check_number_list("stderr", data["stderr"], n)
    # KL divergences and their standard errors are never negative.
    for key in ("sensitivity", "stderr"):
        if any(x < 0 for x in data[key]):
            _fail(key, "numbers >= 0 (a KL divergence is never negative)", data[key])
    per_example = data["per_example"]
    if not isinstance(per_example, list) or len(per_example) != data["calibration"]["num_examples"]:
        _fail("per_example", f"{data['calibration']['num_examples']} rows (calibration.num_examples)",
              f"{len(per_example)} rows" if isinstance(per_example, list) else per_example)
    for e, row in enumerate(per_example):
        _check_number_list(f"per_example[{e}]", row, n)


# ---- files ---------------------------------------------------------------------------------------

def save_profile(profile: Profile, path) -> None:
    """Write ``profile`` atomically to ``path`` (``~`` is expanded, as ``load_profile`` does)."""
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a ripplekv_ext.budgets.profile_file.Profile, got {type(profile).__name__}")
    path = Path(os.path.expanduser(os.fspath(path)))
    if path.is_dir():
        raise ProfileError(f"profile file {path} is a folder; give a file path (such as {path / 'profile.json'})")
    data = profile.to_dict()
    validate_profile_dict(data)  # never write a file that would not load
    try:
        write_json_atomic(path, data)
    except OSError as e:  # a parent that is a file, a read-only folder, a full disk
        raise ProfileError(f"profile file {path} cannot be written: {e.strerror or e}") from None


def load_profile(path, model=None, force: bool = False) -> Profile:
    """Read and validate a profile (`~` is expanded); with `model`, also check it was measured on that model.

    Every problem with the file (missing, a folder, unreadable, not UTF-8 JSON, malformed) is a ProfileError.
    """
    path = Path(os.path.expanduser(os.fspath(path)))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProfileError(f"profile file {path} not found") from None
    except IsADirectoryError:
        raise ProfileError(f"profile file {path} is a folder, not a profile JSON file") from None
    except UnicodeDecodeError:
        raise ProfileError(f"profile file {path} is not a text (UTF-8 JSON) file") from None
    except OSError as e:
        raise ProfileError(f"profile file {path} cannot be read: {e.strerror or e}") from None
    try:
        # NaN / Infinity are not JSON; Python reads them, and the validation below refuses them by field.
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"profile file {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    try:
        profile = Profile.from_dict(data)
    except ProfileError as e:
        raise ProfileError(f"{path}: {e}") from None
    if model is not None:
        profile.check_model(model, force=force)
    return profile
