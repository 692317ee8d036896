import json
import math

import pytest
import torch

from ripplekv_ext.allocation import RippleKVAllocator, ripplekv_budgets
from ripplekv_ext.eval.models import tiny_model
from ripplekv_ext.profile_file import (FORMAT_NAME, FORMAT_VERSION, Profile, ProfileError, describe_model,
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
    assert RippleKVAllocator(loaded).budgets(4, 1000, 100, 8) == ripplekv_budgets(profile.sensitivity, 1000, 100, 8)
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
    with pytest.raises(ProfileError, match=f"expected a finite number, got '{token}'"):
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
