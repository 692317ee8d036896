"""The `ripplekv` command line end to end on a tiny model folder (real tokenizer, random weights)."""

import json

import pytest
import torch

from ripplekv_ext import cli
from ripplekv_ext.eval.models import load_smollm2, tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_smollm2()[1]


def _save_tiny(folder, tokenizer, seed):
    model = tiny_model("llama", seed=seed, vocab_size=len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), tokenizer, seed=0)


@pytest.fixture(scope="module")
def profile_path(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    assert cli.main(["profile", "--model", str(tiny_dir), "--prefix-len", "48", "--cont-len", "8", "--examples", "2",
                     "--out", str(path)]) == 0
    return path


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_profile_writes_json_and_png(profile_path):
    data = json.loads(profile_path.read_text())
    assert data["calibration"]["num_examples"] == 2 and len(data["sensitivity"]) == 4
    assert all(s > 0 for s in data["sensitivity"])  # noise on any layer's values moves the output
    assert profile_path.with_suffix(".png").stat().st_size > 0


def test_allocate_totals_match(tiny_dir, profile_path, tmp_path, capsys):
    code, out, _ = run(["allocate", "--model", str(tiny_dir), "--profile", str(profile_path), "--prompt-len", "500",
                        "--retention", "0.2", "--out-dir", str(tmp_path)], capsys)
    assert code == 0, out
    budgets = json.loads((tmp_path / "budgets.json").read_text())["budgets"]
    assert set(budgets) == {"uniform", "pyramidkv", "ripplekv"}
    assert all(sum(b) == 4 * 100 for b in budgets.values())  # 4 layers x round(0.2 * 500)
    assert budgets["uniform"] == [100] * 4 and budgets["ripplekv"] != budgets["uniform"]
    assert (tmp_path / "budgets.png").stat().st_size > 0


def test_eval_grid_and_resume(tiny_dir, profile_path, tmp_path, capsys, monkeypatch):
    argv = ["eval", "--model", str(tiny_dir), "--profile", str(profile_path), "--methods", "full,snapkv,ripplekv+h2o",
            "--retentions", "0.3", "--tasks", "fidelity,passkey", "--examples", "1", "--prefix-len", "160",
            "--cont-len", "8", "--length", "200", "--out-dir", str(tmp_path)]
    # Interrupt the second cell: the first must already be on disk, and a rerun must resume after it.
    import ripplekv_ext.eval.grid as experiment

    calls = {"n": 0}
    real = experiment.evaluate_fidelity

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(experiment, "evaluate_fidelity", interrupting)
    code, _, err = run(argv, capsys)
    assert code == 130 and "interrupted" in err
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert list(saved["cells"]) == ["full"]

    monkeypatch.setattr(experiment, "evaluate_fidelity", real)
    code, out, _ = run(argv, capsys)
    assert code == 0
    assert "full: already in" in out
    cells = json.loads((tmp_path / "eval.json").read_text())["cells"]
    assert set(cells) == {"full", "snapkv@0.3", "ripplekv+h2o@0.3"}
    assert cells["full"]["fidelity"]["kl"] == 0.0
    assert cells["snapkv@0.3"]["fidelity"]["kl"] > 0.0 and cells["ripplekv+h2o@0.3"]["fidelity"]["kl"] > 0.0
    assert set(cells["snapkv@0.3"]["tasks"]) == {"passkey"}
    assert (tmp_path / "eval.png").stat().st_size > 0


@pytest.mark.parametrize("argv, message", [
    (["eval", "--methods", "snapkv,bogus"], "unknown method 'bogus'"),
    (["eval", "--methods", "pyramidkv+nothing"], "unknown method 'pyramidkv+nothing'"),
    (["allocate", "--model", "/no/such/model", "--prompt-len", "10", "--retention", "0.5"],
     "--model must be 'smollm2' or a local transformers model folder"),
])
def test_bad_arguments_one_line(argv, message, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1


def test_prompt_too_short_for_retention(capsys):
    code, _, err = run(["eval", "--retentions", "0.1,0.5", "--length", "200", "--tasks", "passkey"], capsys)
    assert code == 2
    assert "--length 200 is too short: retention 0.1 with window 32 needs prompts of at least 330 tokens" in err


@pytest.mark.parametrize("retention", ["0", "1.5", "-0.1", "abc"])
def test_retention_outside_range(retention, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--retentions", retention])
    assert exc.value.code == 2
    assert "retention" in capsys.readouterr().err


def test_missing_profile(tiny_dir, tmp_path, capsys):
    code, _, err = run(["allocate", "--model", str(tiny_dir), "--prompt-len", "100", "--retention", "0.2",
                        "--profile", str(tmp_path / "none.json")], capsys)
    assert code == 2 and "no profile at" in err and "ripplekv profile" in err


def test_profile_from_another_model(tiny_dir, profile_path, tmp_path, tokenizer, capsys):
    other = _save_tiny(tmp_path / "other", tokenizer, seed=1)
    code, _, err = run(["allocate", "--model", str(other), "--profile", str(profile_path), "--prompt-len", "500",
                        "--retention", "0.2", "--out-dir", str(tmp_path)], capsys)
    assert code == 2 and "profile is for another model" in err
    # --force accepts it knowingly.
    code, _, err = run(["allocate", "--model", str(other), "--profile", str(profile_path), "--prompt-len", "500",
                        "--retention", "0.2", "--force", "--out-dir", str(tmp_path)], capsys)
    assert code == 0, err


def test_bench_is_a_source_checkout_harness(capsys):
    code, _, err = run(["bench", "--figures", "memory"], capsys)
    assert code == 2 and "bench/e2e_bench.py" in err and len(err.strip().splitlines()) == 1


def test_shipped_smollm2_profile_is_package_data_for_the_bundled_model():
    from ripplekv_ext.eval.models import shipped_profile_path
    from ripplekv_ext.profile_file import load_profile

    path = shipped_profile_path("smollm2")
    assert path is not None and path.parent.parent.name == "eval" and path.parents[2].name == "ripplekv_ext"
    assert shipped_profile_path("/some/model/folder") is None
    model = load_smollm2()[0]
    profile = load_profile(path, model=model)  # the fingerprint matches the bundled weights
    assert len(profile.sensitivity) == model.config.num_hidden_layers
