"""Profile files (ripplekv_ext.budgets.profile_file): the format round trip, validation, the model fingerprint, paths,
and the bad-input table of load_profile and save_profile."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from api_tables import Case, INF, table_tests
from ripplekv_ext.budgets.allocators import RippleKVAllocator, power_budgets
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.budgets.profile_file import (FORMAT_NAME, FORMAT_VERSION, Profile, ProfileError, describe_model,
                                               load_profile, save_profile)
from ripplekv_ext.profiler import profile_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def profile(model):
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    return profile_model(model, examples=ids, prefix_len=16, cont_len=4, num_examples=2, progress=False,
                         model_name="tiny-llama")


def test_round_trip(profile, model, tmp_path):
    path = tmp_path / "p.json"
    save_profile(profile, path)
    loaded = load_profile(path, model)
    assert loaded.to_dict() == profile.to_dict()
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT_NAME and data["version"] == FORMAT_VERSION
    for section, keys in {"model": ["name", "architecture", "num_layers", "num_kv_heads", "head_dim", "fingerprint"],
                          "method": ["target", "sigma", "seed", "draws", "metric"],
                          "calibration": ["source", "num_examples", "prefix_len", "cont_len"],
                          "stability": ["split_half_spearman"],
                          "cost": ["seconds", "tokens_processed", "device"]}.items():
        assert set(keys) <= set(data[section]), section
    assert data["model"]["architecture"] == "LlamaForCausalLM" and data["model"]["head_dim"] == 16
    assert len(data["stderr"]) == len(data["sensitivity"]) == 4
    # A loaded profile drives the allocator.
    assert RippleKVAllocator(loaded).budgets(4, 1000, 100, 8) == power_budgets(profile.sensitivity, 1000, 100, 8)
    # Atomic write: nothing but the file itself is left in the folder.
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


def _mutated(profile, tmp_path, mutate):
    data = profile.to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("sensitivity"), "profile field sensitivity: missing"),
    (lambda d: d["model"].pop("head_dim"), "profile field model.head_dim: missing"),
    (lambda d: d["method"].pop("sigma"), "profile field method.sigma: missing"),
    (lambda d: d["calibration"].pop("prefix_len"), "profile field calibration.prefix_len: missing"),
    (lambda d: d["cost"].pop("device"), "profile field cost.device: missing"),
    (lambda d: d.update(format="something-else"), "profile field format: expected 'ripplekv-profile'"),
    (lambda d: d.update(version=99), "profile field version: expected 1 .* got 99"),
    (lambda d: d["method"].update(target="queries"), "profile field method.target: expected one of"),
    (lambda d: d["method"].update(seed="zero"), "profile field method.seed: expected int, got 'zero'"),
    (lambda d: d.update(sensitivity=[1.0, 2.0]), "profile field sensitivity: expected 4 entries .* got '2 entries'"),
    (lambda d: d.update(stderr=[0.1, 0.1, "x", 0.1]), "profile field stderr\\[2\\]: expected a finite number"),
    (lambda d: d.update(layers=[0, 1, 2, 7]), "profile field layers: expected distinct layer indices in \\[0, 4\\)"),
    (lambda d: d.update(per_example=d["per_example"][:1]), "profile field per_example: expected 2 rows"),
    (lambda d: d["model"]["fingerprint"].pop("config_sha256"), "model.fingerprint.config_sha256: expected a hex"),
])
def test_validation_errors(profile, tmp_path, mutate, match):
    path = _mutated(profile, tmp_path, mutate)
    with pytest.raises(ProfileError, match=match):
        load_profile(path)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_rejected(profile, tmp_path, token):
    path = tmp_path / "nan.json"
    text = json.dumps(profile.to_dict())
    first = repr(profile.sensitivity[0])
    path.write_text(text.replace(first, token, 1))
    shown = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[token]
    # Named with the file and the field, as every other problem with a profile.
    with pytest.raises(ProfileError, match=rf"nan.json: profile field sensitivity\[0\]: expected a finite number, "
                                           rf"got {shown}"):
        load_profile(path)


def test_malformed_and_missing_files(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"format": "ripplekv-profile", ')
    with pytest.raises(ProfileError, match="is not valid JSON"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="not found"):
        load_profile(tmp_path / "nope.json")
    bad.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="expected a JSON object"):
        load_profile(bad)


def test_save_refuses_an_invalid_profile_and_keeps_the_old_file(profile, tmp_path):
    path = tmp_path / "p.json"
    save_profile(profile, path)
    before = path.read_text()
    broken = Profile.from_dict(profile.to_dict())
    broken.sensitivity = [math.nan] * 4
    with pytest.raises(ProfileError, match="sensitivity\\[0\\]: expected a finite number, got nan"):
        save_profile(broken, path)
    assert path.read_text() == before


def test_fingerprint_mismatch(profile, tmp_path):
    path = tmp_path / "p.json"
    save_profile(profile, path)
    other_weights = tiny_model("llama", seed=1)
    with pytest.raises(ProfileError, match="weight sample differs .* pass force=True"):
        load_profile(path, other_weights)
    other_config = tiny_model("llama", seed=0, rms_norm_eps=1e-5)
    with pytest.raises(ProfileError, match="config fingerprint expected"):
        load_profile(path, other_config)
    other_shape = tiny_model("llama", seed=0, num_layers=6)
    with pytest.raises(ProfileError, match="model.num_layers expected 4 .* got 6"):
        load_profile(path, other_shape)
    assert load_profile(path, other_weights, force=True).layers == [0, 1, 2, 3]


def test_fingerprint_survives_a_dtype_change(profile, model, tmp_path):
    path = tmp_path / "p.json"
    save_profile(profile, path)
    half = tiny_model("llama", seed=0).to(torch.bfloat16)
    assert describe_model(half)["fingerprint"]["config_sha256"] == describe_model(model)["fingerprint"]["config_sha256"]
    load_profile(path, half)


# ---- paths, folders, binary files, negative sensitivities --------------------------------------------------------

@pytest.fixture(scope="module")
def saved_profile(tmp_path_factory):
    from ripplekv_ext.profiler import profile_model

    model = tiny_model("llama", seed=0)
    ids = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    profile = profile_model(model, examples=ids, prefix_len=16, cont_len=4, num_examples=2,
                            progress=False, model_name="tiny-llama")
    path = tmp_path_factory.mktemp("profiles") / "p.json"
    save_profile(profile, path)
    return path


def test_load_profile_expands_home(saved_profile, monkeypatch):
    monkeypatch.setenv("HOME", str(saved_profile.parent))
    assert load_profile("~/p.json").layers == load_profile(saved_profile).layers


def test_load_profile_of_a_folder_or_binary_file_is_a_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="is a folder"):
        load_profile(tmp_path)
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ProfileError, match="not a text"):
        load_profile(binary)


def test_negative_sensitivity_in_a_file_is_a_profile_error(saved_profile, tmp_path):
    data = json.loads(saved_profile.read_text())
    data["sensitivity"][0] = -0.5
    bad = tmp_path / "neg.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="never negative"):
        load_profile(bad)


# ---- the bad-input table (api_tables.py): load_profile and save_profile --------------------------------------------

@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """What the table's rows call into: a model, a saved profile of it and its JSON, another model, a folder."""
    c = SimpleNamespace(model=tiny_model("llama", seed=0), other_model=tiny_model("llama", seed=0, num_layers=2),
                        tmp=tmp_path_factory.mktemp("bad-inputs"))
    ids = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    c.profile = profile_model(c.model, examples=ids, prefix_len=16, cont_len=4, num_examples=2, progress=False,
                              model_name="tiny-llama")
    c.profile_path = c.tmp / "good.json"
    save_profile(c.profile, c.profile_path)
    c.good = json.loads(c.profile_path.read_text())
    return c


def _write(ctx, name, text=None, data=None, raw=None):
    path = ctx.tmp / name
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(text if text is not None else json.dumps(data))
    return path


def _edited(ctx, name, edit):
    data = json.loads(json.dumps(ctx.good))
    edit(data)
    return _write(ctx, name, data=data)


BAD_INPUTS = [
    Case("missing file", lambda c: load_profile(c.tmp / "none.json"), ProfileError, "not found"),
    Case("folder", lambda c: load_profile(c.tmp), ProfileError, "is a folder"),
    Case("binary file", lambda c: load_profile(_write(c, "w.bin", raw=bytes(range(256)) * 4)), ProfileError,
         "not a text (UTF-8 JSON) file"),
    Case("empty file", lambda c: load_profile(_write(c, "empty.json", "")), ProfileError, "is not valid JSON"),
    Case("malformed JSON", lambda c: load_profile(_write(c, "bad.json", '{"format": ')), ProfileError,
         "is not valid JSON"),
    Case("truncated file", lambda c: load_profile(_write(c, "cut.json", c.profile_path.read_text()[:200])),
         ProfileError, "is not valid JSON"),
    Case("JSON list", lambda c: load_profile(_write(c, "list.json", "[1, 2]")), ProfileError, "a JSON object"),
    Case("other format", lambda c: load_profile(_edited(c, "fmt.json", lambda d: d.update(format="kvpress"))),
         ProfileError, "profile field format"),
    Case("newer version", lambda c: load_profile(_edited(c, "v2.json", lambda d: d.update(version=2))),
         ProfileError, "profile field version"),
    Case("missing sensitivity", lambda c: load_profile(_edited(c, "miss.json", lambda d: d.pop("sensitivity"))),
         ProfileError, "profile field sensitivity: missing"),
    Case("missing model.head_dim", lambda c: load_profile(_edited(c, "hd.json", lambda d: d["model"].pop("head_dim"))),
         ProfileError, "model.head_dim: missing"),
    Case("NaN sensitivity", lambda c: load_profile(_write(c, "nan.json", c.profile_path.read_text().replace(
        json.dumps(c.good["sensitivity"][0]), "NaN", 1))), ProfileError, "a finite number"),
    Case("Infinity stderr", lambda c: load_profile(_write(c, "inf.json", json.dumps(
        {**c.good, "stderr": [INF] * len(c.good["stderr"])}))), ProfileError, "a finite number"),
    Case("negative sensitivity", lambda c: load_profile(_edited(c, "neg.json",
                                                                lambda d: d["sensitivity"].__setitem__(0, -0.5))),
         ProfileError, "never negative"),
    Case("string sensitivity", lambda c: load_profile(_edited(c, "str.json",
                                                              lambda d: d["sensitivity"].__setitem__(0, "0.5"))),
         ProfileError, "sensitivity[0]: expected a finite number"),
    Case("sensitivity too short", lambda c: load_profile(_edited(c, "short.json", lambda d: d["sensitivity"].pop())),
         ProfileError, "one per profiled layer"),
    Case("layer out of range", lambda c: load_profile(_edited(c, "lay.json", lambda d: d["layers"].__setitem__(0, 9))),
         ProfileError, "distinct layer indices in [0, 4)"),
    Case("duplicate layers", lambda c: load_profile(_edited(c, "dup.json", lambda d: d.update(layers=[0, 0, 1, 2]))),
         ProfileError, "distinct layer indices"),
    Case("no layers", lambda c: load_profile(_edited(c, "nol.json", lambda d: d.update(
        layers=[], sensitivity=[], stderr=[], per_example=[[], []]))), ProfileError, "at least one profiled layer"),
    Case("per_example rows", lambda c: load_profile(_edited(c, "rows.json", lambda d: d["per_example"].pop())),
         ProfileError, "rows (calibration.num_examples)"),
    Case("wrong model", lambda c: load_profile(c.profile_path, model=c.other_model), ProfileError,
         "profile is for another model"),
    Case("home of a missing file", lambda c: load_profile("~/no-such-ripplekv-profile.json"), ProfileError,
         os.path.expanduser("~/no-such-ripplekv-profile.json")),
    Case("save to a folder", lambda c: save_profile(c.profile, c.tmp), ProfileError, "is a folder"),
    Case("save under a file", lambda c: save_profile(c.profile, c.profile_path / "p.json"), ProfileError,
         "cannot be written"),
    Case("save negative sensitivity", lambda c: save_profile(
        type(c.profile)(**{**vars(c.profile), "sensitivity": [-1.0] * 4}), c.tmp / "never.json"), ProfileError,
         "never negative"),
    Case("save a dict", lambda c: save_profile(c.good, c.tmp / "dict.json"), TypeError,
         "profile must be a ripplekv_ext.budgets.profile_file.Profile"),
]


test_bad_input_table, test_bad_input_table_has_distinct_ids = table_tests(BAD_INPUTS)


def test_save_profile_expands_home(ctx, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    save_profile(ctx.profile, "~/saved.json")
    assert (tmp_path / "saved.json").is_file() and not (tmp_path / "~").exists()
    assert load_profile("~/saved.json").sensitivity == ctx.profile.sensitivity


def test_refused_save_writes_nothing(ctx):
    assert not (ctx.tmp / "never.json").exists() and not (ctx.tmp / "dict.json").exists()
