"""`ripplekv report` end to end on a tiny random model (real SmolLM2 tokenizer): every part, its tables checked
against the per-example results they summarize, and a rerun that resumes everything."""

import json

import pytest

from ripplekv_ext import cli
from ripplekv_ext.eval.tiny_models import tiny_model

pytest.importorskip("transformers")

TINY_FLAGS = ["--fidelity-methods", "full,snapkv,pyramidkv,ripplekv", "--methods", "full,ripplekv",
              "--retentions", "0.5", "--task-retentions", "0.5", "--fidelity-examples", "3", "--prefix-len", "64",
              "--cont-len", "8", "--passkey-length", "160", "--passkey-examples", "2", "--passkey-depths", "2",
              "--needle-lengths", "150", "--needle-depths", "0,100", "--window", "8"]


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from ripplekv_ext.eval.models import load_smollm2, smollm2_folder

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder) if (folder / "config.json").is_file() else load_smollm2()[1]
    root = tmp_path_factory.mktemp("report")
    model_dir = root / "tiny"
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    profile = root / "profile.json"
    assert cli.main(["profile", "--model", str(model_dir), "--prefix-len", "48", "--cont-len", "8", "--examples", "2",
                     "--out", str(profile)]) == 0
    out = root / "out"
    argv = ["report", "--model", str(model_dir), "--profile", str(profile), *TINY_FLAGS, "--out-dir", str(out)]
    assert cli.main(argv) == 0
    return out, argv


def _cells(out, part):
    return json.loads((out / f"{part}.json").read_text())["cells"]


def test_report_has_every_section_and_figure(report_dir):
    out, _ = report_dir
    text = (out / "report.md").read_text()
    for heading in ("## Fidelity at 64-token prompts",
                    "## Passkey by needle depth (160-token prompts, question inside)",
                    "## Passkey by needle depth (160-token prompts, question after)",
                    "## Passkey in real prose by needle depth (160-token prompts, question inside)",
                    "## Passkey in real prose by needle depth (160-token prompts, question after)",
                    "## Needle in a haystack (Paul Graham essays, question inside)",
                    "## Needle in a haystack (Paul Graham essays, question after)", "## Sensitivity profile"):
        assert heading in text
    assert "## Fidelity at 64-token prompts: kjv:evaluation" in text
    assert "## Fidelity at 64-token prompts: essays:evaluation" in text
    for png in ("kl_vs_retention.png", "kl_vs_retention_essays.png", "passkey_by_depth.png",
                "passkey_by_depth_after.png", "passkey_text_by_depth.png", "passkey_text_by_depth_after.png",
                "needle_heatmaps.png", "needle_heatmaps_after.png", "profile.png"):
        assert (out / png).stat().st_size > 1000 and f"]({png})" in text
    # The command that reproduces the report, every size spelled out.
    assert "ripplekv report --model" in text and "--passkey-depths 2" in text and "--needle-depths 0,100" in text


def test_fidelity_table_and_paired_rows_follow_the_per_example_kl(report_dir):
    out, _ = report_dir
    cells = _cells(out, "fidelity")
    assert cells["full"]["fidelity"]["kl_per_example"] == [0.0, 0.0, 0.0]  # Full against itself
    text = (out / "report.md").read_text()
    for key in ("snapkv@0.5", "pyramidkv@0.5", "ripplekv@0.5"):
        f = cells[key]["fidelity"]
        assert len(f["kl_per_example"]) == 3 and all(kl > 0 for kl in f["kl_per_example"])
        assert f["kl"] == pytest.approx(sum(f["kl_per_example"]) / 3)
        assert f["kl_ci_low"] <= f["kl"] <= f["kl_ci_high"]
        interval = f"[{f['kl_ci_low']:.4f}, {f['kl_ci_high']:.4f}]"
        assert f"| {cells[key]['method']} | 50% | {f['kl']:.4f} | {interval} |" in text
    mine = cells["ripplekv@0.5"]["fidelity"]["kl_per_example"]
    for baseline in ("snapkv", "pyramidkv"):
        other = cells[f"{baseline}@0.5"]["fidelity"]["kl_per_example"]
        wins = sum(a < b for a, b in zip(mine, other))
        difference = sum(a - b for a, b in zip(mine, other)) / 3
        assert f"| ripplekv vs {baseline} | 50% |" in text
        row = next(line for line in text.splitlines() if line.startswith(f"| ripplekv vs {baseline} |"))
        assert f"| {wins}/3 | {difference:+.4f} |" in row


def test_passkey_depth_table_counts_the_predictions(report_dir):
    out, _ = report_dir
    cells = _cells(out, "passkey")
    assert set(cells) == {"full", "ripplekv@0.5"}
    text = (out / "report.md").read_text()
    assert "| method | depth 0% | depth 100% | all depths | 95% CI |" in text
    for key, label in (("full", "full"), ("ripplekv@0.5", "ripplekv 50%")):
        scores = [p["score"] for p in cells[key]["predictions"]]  # example 0 at depth 0, example 1 at depth 1
        assert len(scores) == 2
        total = f"{sum(scores) / 2:.0%} ({sum(scores):.0f}/2)"
        assert f"| {label} | {scores[0]:.0f}/1 | {scores[1]:.0f}/1 | {total} |" in text


def test_real_prose_passkey_and_the_needle_run_under_both_protocols(report_dir):
    out, _ = report_dir
    text = (out / "report.md").read_text()
    for part in ("passkey_text", "needle"):
        cells = _cells(out, part)
        assert set(cells) == {"full", "ripplekv@0.5"}
        for cell in cells.values():
            for predictions in (cell["predictions"], cell["after"]["predictions"]):
                assert len(predictions) == 2
    prose = _cells(out, "passkey_text")
    heading = "## Passkey in real prose by needle depth (160-token prompts, question after)"
    after_table = text.split(heading, 1)[1].split("##", 1)[0]
    for key, label in (("full", "full"), ("ripplekv@0.5", "ripplekv 50%")):
        scores = [p["score"] for p in prose[key]["after"]["predictions"]]
        assert f"| {label} | {scores[0]:.0f}/1 | {scores[1]:.0f}/1 | {sum(scores) / 2:.0%} ({sum(scores):.0f}/2) |" \
            in after_table
    assert "real prose (held-out running text" in text and "repetitive filler" in text


def test_a_saved_run_without_a_protocol_runs_only_that_protocol(report_dir, tmp_path, capsys):
    import shutil

    out, argv = report_dir
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    saved = json.loads((copy / "needle.json").read_text())
    del saved["settings"]["protocols"]  # as a report written before the needle ran after compression
    for cell in saved["cells"].values():
        del cell["after"]
    (copy / "needle.json").write_text(json.dumps(saved))
    capsys.readouterr()
    assert cli.main([*argv[:argv.index("--out-dir")], "--parts", "needle", "--out-dir", str(copy)]) == 0
    log = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(log) == 2 and all(line.endswith(": after only") for line in log), log
    again = _cells(copy, "needle")
    for key, cell in saved["cells"].items():
        assert again[key]["predictions"] == cell["predictions"] and len(again[key]["after"]["predictions"]) == 2


def test_after_results_record_their_scoring_and_another_scoring_reruns_them(report_dir, tmp_path, capsys):
    import shutil

    from ripplekv_ext.transformers_front.context import default_scoring
    from ripplekv_ext.policies import Policy

    out, argv = report_dir
    for cell in _cells(out, "needle").values():
        assert cell["after"]["scoring"] == default_scoring(Policy.snapkv(0.5), tokenizer=object())
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    saved = json.loads((copy / "needle.json").read_text())
    saved["cells"]["ripplekv@0.5"]["after"]["scoring"] = "an older default"
    (copy / "needle.json").write_text(json.dumps(saved))
    capsys.readouterr()
    assert cli.main([*argv[:argv.index("--out-dir")], "--parts", "needle", "--out-dir", str(copy)]) == 0
    log = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert log[0].endswith("skipped") and log[1].endswith("ripplekv@0.5: after only"), log
    again = _cells(copy, "needle")["ripplekv@0.5"]
    assert again["after"]["scoring"] != "an older default" and len(again["after"]["predictions"]) == 2
    assert again["predictions"] == saved["cells"]["ripplekv@0.5"]["predictions"]


def test_methods_not_asked_after_have_no_after_rows(report_dir, tmp_path, capsys):
    import shutil

    out, argv = report_dir
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    flags = argv[:argv.index("--out-dir")]
    assert cli.main([*flags, "--parts", "passkey_text", "--after-methods", "full", "--out-dir", str(copy)]) == 0
    cells = _cells(copy, "passkey_text")  # the saved "after" results of ripplekv dropped, its own kept
    assert "after" in cells["full"] and "after" not in cells["ripplekv@0.5"]
    assert cells["ripplekv@0.5"]["predictions"] == _cells(out, "passkey_text")["ripplekv@0.5"]["predictions"]
    text = (copy / "report.md").read_text()
    inside, after = (text.split(f"(160-token prompts, question {p})", 1)[1].split("##", 1)[0]
                     for p in ("inside", "after"))
    assert "| ripplekv 50% |" in inside and "| ripplekv 50% |" not in after and "| full |" in after
    assert "--after-methods full" in text


def test_needle_grid_scores_every_cell(report_dir):
    out, _ = report_dir
    cells = _cells(out, "needle")
    for cell in cells.values():
        assert sorted(p["id"] for p in cell["predictions"]) == ["needle-150-d0", "needle-150-d100"]
        assert all(p["score"] in (0.0, 1 / 3, 2 / 3, 1.0) for p in cell["predictions"])


def test_rerun_resumes_every_cell_and_writes_the_same_report(report_dir, capsys):
    out, argv = report_dir
    before = (out / "report.md").read_text()
    capsys.readouterr()
    assert cli.main(argv) == 0
    log = capsys.readouterr().out
    cells = [line for line in log.splitlines() if line.startswith("[")]
    # Fidelity's 4 cells on each of the two text domains, then the 2 of each passkey part and of the needle: none
    # recomputed.
    assert len(cells) == 2 * 4 + 2 + 2 + 2 and all(line.endswith("skipped") for line in cells), log
    assert (out / "report.md").read_text() == before


def test_report_refuses_bad_options_before_loading(tmp_path, capsys):
    for flags, fragment in ((["--parts", "fidelity,bogus"], "unknown part(s) bogus"),
                            (["--needle-depths", "0,150"], "percents in [0, 100]"),
                            (["--needle-lengths", "1024,x"], "positive integers"),
                            (["--prefix-len", "100"], "--prefix-len 100 is too short"),
                            (["--model", str(tmp_path / "none")], "--model must be")):
        code = cli.main(["report", *flags, "--out-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and fragment in err, (flags, err)


def test_after_methods_that_cannot_run_are_refused_before_the_first_cell(report_dir, tmp_path, capsys):
    out, argv = report_dir
    flags = argv[:argv.index("--out-dir")]
    methods = flags.index("--methods") + 1
    for change, fragment in (
            # None of the methods asked after is run: the report's plots had nothing to draw, after every cell.
            ({methods: "pyramidkv,streamingllm"},
             "no method of --methods ['pyramidkv', 'streamingllm'] is asked after compression"),
            ({"--after-methods": "snapkv"}, "--after-methods snapkv: not among --methods full,ripplekv"),
            # compress_context cannot take CAKE or AdaKV: refused before the first cell, not when its cell starts.
            ({methods: "full,cake", "--after-methods": "full,cake"},
             "after_methods (--after-methods) cake: compress_context does not take cake")):
        run = list(flags)
        for key, value in change.items():
            if isinstance(key, int):
                run[key] = value
            else:
                run += [key, value]
        code = cli.main([*run, "--parts", "passkey", "--out-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code != 0 and fragment in err, (change, err)
        assert not (tmp_path / "out" / "passkey.json").exists()  # no cell ran


def test_a_saved_cell_is_reused_for_its_policy_and_a_field_added_since_at_its_default():
    import dataclasses

    from ripplekv_ext.eval.grid import same_policy
    from ripplekv_ext.policies import Policy

    policy = Policy.snapkv(0.2)
    assert same_policy({"policy_repr": repr(policy)}, policy)
    # A cell saved before Policy had prefill_chunk: the same policy, as long as prefill_chunk is at its default.
    older = repr(policy).replace(", prefill_chunk=None", "")
    assert older != repr(policy) and same_policy({"policy_repr": older}, policy)
    assert not same_policy({"policy_repr": older}, dataclasses.replace(policy, prefill_chunk=64))
    assert not same_policy({"policy_repr": repr(policy)}, Policy.snapkv(0.3))
    assert not same_policy({"policy_repr": repr(policy)}, dataclasses.replace(policy, window=16))
