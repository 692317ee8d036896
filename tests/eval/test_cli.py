"""The `ripplekv` command line (ripplekv_ext.cli) end to end on a tiny model folder (real tokenizer, random weights).
Every option's refusal, as tables: test_cli_options.py."""

import json

import pytest

from ripplekv_ext import cli
from ripplekv_ext.eval.models import load_smollm2
from ripplekv_ext.eval.tiny_models import tiny_model


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


@pytest.fixture(autouse=True)
def _in_a_temporary_folder(tmp_path, monkeypatch):
    # A command run with the default --out-dir writes ripplekv-results/ into the current folder: never the checkout.
    monkeypatch.chdir(tmp_path)


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


@pytest.mark.parametrize("retention", ["0", "1.5", "-0.1", "abc", "nan"])
def test_retention_outside_range(retention, capsys):
    code, _, err = run(["eval", "--retentions", retention], capsys)
    assert code == 2
    assert "argument --retentions: " in err and "in (0, 1]" in err and len(err.strip().splitlines()) == 1


def test_missing_profile(tiny_dir, tmp_path, capsys):
    code, _, err = run(["allocate", "--model", str(tiny_dir), "--prompt-len", "500", "--retention", "0.2",
                        "--profile", str(tmp_path / "none.json")], capsys)
    assert code == 2 and "no profile at" in err and "ripplekv profile" in err and "--profile FILE" in err


def test_profile_from_another_model(tiny_dir, profile_path, tmp_path, tokenizer, capsys):
    other = _save_tiny(tmp_path / "other", tokenizer, seed=1)
    code, _, err = run(["allocate", "--model", str(other), "--profile", str(profile_path), "--prompt-len", "500",
                        "--retention", "0.2", "--out-dir", str(tmp_path)], capsys)
    assert code == 2 and "profile is for another model" in err
    assert "--force" in err and "force=True" not in err  # the CLI's flag, not the library's argument
    # --force accepts it knowingly.
    code, _, err = run(["allocate", "--model", str(other), "--profile", str(profile_path), "--prompt-len", "500",
                        "--retention", "0.2", "--force", "--out-dir", str(tmp_path)], capsys)
    assert code == 0, err


def test_results_folder_is_ignored_by_git():
    """`make demo` and the other commands write ripplekv-results/ into the current folder, the checkout's root."""
    import shutil
    import subprocess
    from pathlib import Path

    from ripplekv_ext.cli.common import RESULTS_DIR

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", str(RESULTS_DIR / "report" / "report.md")], cwd=root)
    assert done.returncode == 0, f"{RESULTS_DIR}/ is not ignored by git"


def test_bench_is_no_subcommand(capsys):
    # The end-to-end benchmarks are a harness of the source checkout (bench/e2e_bench.py), not installed.
    code, _, err = run(["bench", "--figures", "memory"], capsys)
    assert code == 2 and "invalid choice: 'bench'" in err


def test_shipped_smollm2_profile_is_package_data_for_the_bundled_model():
    from ripplekv_ext.eval.models import shipped_profile_path
    from ripplekv_ext.budgets.profile_file import load_profile

    path = shipped_profile_path("smollm2")
    assert path is not None and path.parent.parent.name == "eval" and path.parents[2].name == "ripplekv_ext"
    assert shipped_profile_path("/some/model/folder") is None
    model = load_smollm2()[0]
    profile = load_profile(path, model=model)  # the fingerprint matches the bundled weights
    assert len(profile.sensitivity) == model.config.num_hidden_layers


# ---- one-line errors naming the option and the way out, before a model loads --------------

@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if a command loads a model: its arguments must be refused first."""
    import ripplekv_ext.cli.parser  # noqa: F401  (imported before the patch: no module keeps the patched function)
    import ripplekv_ext.eval.models as models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_smollm2", refuse)


def _one_line_error(argv, capsys, *fragments):
    code, out, err = run(argv, capsys)
    assert code == 2, (out, err)
    # One error line, the last; transformers' weight-loading bar may precede it for errors found after loading.
    lines = err.strip().splitlines()
    assert [line for line in lines if "error:" in line] == lines[-1:], err
    err = lines[-1]
    for fragment in fragments:
        assert fragment in err, err
    assert out == ""  # nothing printed before the error (no table, no results path)
    return err


def test_errors_before_loading_are_the_only_line(tiny_dir, tmp_path, capsys, no_model_load):
    code, _, err = run(["allocate", "--model", str(tiny_dir), "--prompt-len", "20", "--retention", "0.2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_output_folder_under_a_file_is_refused_before_loading(tiny_dir, tmp_path, capsys, no_model_load):
    (tmp_path / "afile").write_text("x")
    for argv in (["allocate", "--model", str(tiny_dir), "--prompt-len", "500", "--retention", "0.2",
                  "--allocators", "uniform", "--out-dir", str(tmp_path / "afile" / "sub")],
                 ["eval", "--model", str(tiny_dir), "--methods", "full", "--out-dir", str(tmp_path / "afile")],
                 ["profile", "--model", str(tiny_dir), "--out", str(tmp_path / "afile" / "p.json")]):
        _one_line_error(argv, capsys, "is a file, not a folder", "pass another --out")


def test_output_folder_that_cannot_be_written_is_refused_before_loading(tiny_dir, capsys, no_model_load):
    # /proc takes no new folders, whoever runs the test (root included).
    _one_line_error(["allocate", "--model", str(tiny_dir), "--prompt-len", "500", "--retention", "0.2",
                     "--allocators", "uniform", "--out-dir", "/proc/ripplekv-results"], capsys,
                    "--out-dir /proc/ripplekv-results cannot be written", "pass another --out-dir")


def test_read_only_output_folder_is_refused(tiny_dir, tmp_path, capsys, no_model_load):
    import os

    # An existing folder that takes no files, whoever runs the test (root writes into a chmod 555 folder).
    _one_line_error(["eval", "--model", str(tiny_dir), "--methods", "full", "--out-dir", "/proc"], capsys,
                    "--out-dir /proc cannot be written")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            _one_line_error(["eval", "--model", str(tiny_dir), "--methods", "full", "--out-dir", str(ro)], capsys,
                            f"--out-dir {ro} cannot be written")
        finally:
            ro.chmod(0o755)


def test_profile_out_existing_folder_is_refused_up_front(tiny_dir, tmp_path, capsys, no_model_load):
    _one_line_error(["profile", "--model", str(tiny_dir), "--out", str(tmp_path)], capsys,
                    f"--out {tmp_path} is a folder", "give a file path")
    assert not list(tmp_path.glob("*.partial.json"))


@pytest.mark.parametrize("config_text, fragment", [
    ('{"model_type": "llama", ', "config.json is not valid JSON"),
    ('[1, 2]', "names no model_type"),
    ('{"hidden_size": 64}', "names no model_type"),
])
def test_broken_model_config_is_one_line_before_loading(tmp_path, capsys, no_model_load, config_text, fragment):
    (tmp_path / "config.json").write_text(config_text)
    _one_line_error(["allocate", "--model", str(tmp_path), "--prompt-len", "500", "--retention", "0.2"], capsys,
                    f"--model {tmp_path}", fragment)


def test_unknown_architecture_is_one_line_naming_model(tiny_dir, tmp_path, capsys):
    import shutil

    folder = tmp_path / "unknown"
    shutil.copytree(tiny_dir, folder)
    (folder / "config.json").write_text('{"model_type": "no-such-architecture"}')
    _one_line_error(["allocate", "--model", str(folder), "--prompt-len", "500", "--retention", "0.2",
                     "--allocators", "uniform", "--out-dir", str(tmp_path / "out")], capsys,
                    f"--model {folder} cannot be loaded")


@pytest.mark.parametrize("argv, fragments", [
    (["allocate", "--prompt-len", "500", "--retention", "0.2,0.3"],
     ["argument --retention: expected one retention", "run once per retention"]),
    (["allocate", "--prompt-len", "500", "--retention", "1.5"], ["argument --retention: every retention"]),
    (["allocate", "--prompt-len", "500", "--retention", "nan"], ["argument --retention: every retention"]),
    (["allocate", "--prompt-len", "500", "--retention", "0.2", "--allocators", ","],
     ["argument --allocators: expected comma-separated names"]),
    (["allocate", "--prompt-len", "500", "--retention", "0.2", "--allocators", "uniform,bogus"],
     ["argument --allocators: unknown allocator(s) bogus"]),
    (["allocate", "--prompt-len", "500", "--retention", "0.2", "--allocators", "uniform,cake"],
     ["argument --allocators: cake's budgets come from each prompt's own attention", "drop cake"]),
    (["allocate", "--prompt-len", "20", "--retention", "0.2"],
     ["--prompt-len 20 is too short to compress", "at least 163 tokens", "pass a longer --prompt-len"]),
    (["eval", "--methods", ","], ["argument --methods: expected comma-separated names"]),
    (["eval", "--tasks", ","], ["argument --tasks: expected comma-separated names"]),
    (["eval", "--tasks", "passkey,nope"], ["argument --tasks: unknown task(s) nope"]),
    (["profile", "--seed", "-5"], ["argument --seed: expected an integer >= 0, got '-5'"]),
    (["profile", "--layers"], ["argument --layers: expected at least one argument"]),
    (["profile", "--sigma", "nan"], ["argument --sigma: expected a finite number > 0"]),
    (["profile", "--until-stable", "--examples", "8", "--max-examples", "4"],
     ["--max-examples 4 is below --examples 8"]),
])
def test_bad_option_values_are_one_line(argv, fragments, capsys, no_model_load):
    _one_line_error(argv, capsys, *fragments)


def test_layers_outside_the_model_name_the_option(tiny_dir, tmp_path, capsys):
    _one_line_error(["profile", "--model", str(tiny_dir), "--layers", "1", "7", "--out", str(tmp_path / "p.json")],
                    capsys, "--layers 1 7: expected distinct layer indices in [0, 4)")


@pytest.fixture
def interrupted_profile(tiny_dir, tmp_path, capsys, monkeypatch):
    """A profile run interrupted after its first example: (argv, partial file)."""
    # profile_model looks profile_example up in the module that defines it, so the wrapper is patched there.
    import ripplekv_ext.profiler.run as profiler

    out = tmp_path / "p.json"
    argv = ["profile", "--model", str(tiny_dir), "--prefix-len", "48", "--cont-len", "8", "--examples", "2",
            "--out", str(out)]
    real, calls = profiler.profile_example, {"n": 0}

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(profiler, "profile_example", interrupting)
    assert run(argv, capsys)[0] == 130
    monkeypatch.setattr(profiler, "profile_example", real)
    partial = tmp_path / "p.json.partial.json"
    assert len(json.loads(partial.read_text())["per_example"]) == 1
    return argv, partial


def test_resume_mismatch_names_no_resume(interrupted_profile, capsys):
    argv, partial = interrupted_profile
    err = _one_line_error(argv + ["--sigma", "0.2"], capsys, str(partial), "other settings", "--no-resume")
    assert "resume=False" in err  # the Python spelling is named as well
    code, out, _ = run(argv + ["--sigma", "0.2", "--no-resume"], capsys)
    assert code == 0 and not partial.exists()


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d["per_example"][0].__setitem__(0, float("nan")), "holds NaN"),
    (lambda d: d["per_example"][0].__setitem__(0, -1.0), "finite KLs >= 0"),
    (lambda d: d["per_example"][0].pop(), "finite KLs >= 0"),
    (lambda d: d.__setitem__("reused", []), "one true/false per example"),
])
def test_damaged_partial_file_is_refused_at_resume(interrupted_profile, capsys, edit, fragment):
    argv, partial = interrupted_profile
    data = json.loads(partial.read_text())
    edit(data)
    partial.write_text(json.dumps(data))  # Python writes NaN as the bare token NaN, as a hand edit would
    _one_line_error(argv, capsys, f"partial profile {partial}", fragment, "--no-resume")
    assert not partial.with_name("p.json").exists()  # refused before any profiling, nothing saved


def test_resume_after_interrupt_matches_an_uninterrupted_run(interrupted_profile, tmp_path, capsys):
    argv, partial = interrupted_profile
    assert run(argv, capsys)[0] == 0 and not partial.exists()
    resumed = json.loads((tmp_path / "p.json").read_text())
    fresh_out = tmp_path / "fresh.json"
    assert run(argv[:-1] + [str(fresh_out)], capsys)[0] == 0
    assert json.loads(fresh_out.read_text())["per_example"] == resumed["per_example"]


def test_huge_sensitivities_allocate_through_the_cli(tiny_dir, profile_path, tmp_path, capsys):
    data = json.loads(profile_path.read_text())
    data["sensitivity"] = [1e308, 1e307, 1e306, 1e305]
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(data))
    code, out, err = run(["allocate", "--model", str(tiny_dir), "--profile", str(huge), "--prompt-len", "500",
                          "--retention", "0.2", "--allocators", "ripplekv", "--out-dir", str(tmp_path)], capsys)
    assert code == 0, err
    budgets = json.loads((tmp_path / "budgets.json").read_text())["budgets"]["ripplekv"]
    assert sum(budgets) == 400 and budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    assert "total" in out


def test_allocate_gives_a_partial_profile_its_own_layers(tiny_dir, profile_path, tmp_path, capsys):
    # A profile listing its layers in another order still gives each layer its own sensitivity's budget.
    data = json.loads(profile_path.read_text())
    order = [3, 1, 2, 0]
    data["layers"] = order
    data["sensitivity"] = [8.0, 1.0, 2.0, 0.5]  # layer 3 most sensitive, layer 0 least
    data["stderr"] = [0.0] * 4
    data["per_example"] = [[8.0, 1.0, 2.0, 0.5]] * len(data["per_example"])
    shuffled = tmp_path / "shuffled.json"
    shuffled.write_text(json.dumps(data))
    code, _, err = run(["allocate", "--model", str(tiny_dir), "--profile", str(shuffled), "--prompt-len", "500",
                        "--retention", "0.2", "--allocators", "ripplekv", "--out-dir", str(tmp_path)], capsys)
    assert code == 0, err
    budgets = json.loads((tmp_path / "budgets.json").read_text())["budgets"]["ripplekv"]
    assert budgets[3] > budgets[2] > budgets[1] > budgets[0]


def test_profile_prefixes_slide_on_a_sliding_window_model(tmp_path, tokenizer, capsys):
    """Without --prefix-len, a model with sliding-window layers is profiled on prefixes twice its window (past
    --fast's 256 tokens), so that those layers slide as they do in serving; --prefix-len still wins."""
    from ripplekv_ext.eval.tiny_models import tiny_model

    folder = tmp_path / "tiny-gemma3"
    tiny_model("gemma3", seed=0, vocab_size=len(tokenizer), sliding_window=160).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    common = ["profile", "--model", str(folder), "--fast", "--cont-len", "8", "--examples", "2", "--max-examples", "2"]
    code, out, _ = run(common + ["--out", str(tmp_path / "slide.json")], capsys)
    assert code == 0 and "sliding-window layers: profiling 320-token prefixes, twice their window" in out
    assert json.loads((tmp_path / "slide.json").read_text())["calibration"]["prefix_len"] == 320
    code, out, _ = run(common + ["--prefix-len", "48", "--out", str(tmp_path / "given.json")], capsys)
    assert code == 0 and "sliding-window" not in out
    assert json.loads((tmp_path / "given.json").read_text())["calibration"]["prefix_len"] == 48


def test_model_folder_without_tokenizer_files_says_what_is_missing(tmp_path, capsys):
    folder = tmp_path / "no-tokenizer"
    tiny_model("llama").save_pretrained(folder)  # weights and config, no tokenizer
    _one_line_error(["eval", "--model", str(folder), "--methods", "full", "--out-dir", str(tmp_path / "out")], capsys,
                    f"--model {folder} cannot be loaded: transformers found no tokenizer it can load in {folder}",
                    "tokenizer.json")


def test_eval_help_names_every_method_part(capsys):
    from ripplekv_ext.methods import ALLOCATORS, DEFAULT_METHODS, SELECTORS

    cli.main(["eval", "--help"])
    out = capsys.readouterr().out
    methods_help = " ".join(out.split("--methods METHODS", 2)[2].split("--retentions")[0].split())
    assert [name for name in (*DEFAULT_METHODS, *ALLOCATORS, *SELECTORS) if name not in methods_help] == []
