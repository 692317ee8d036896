"""The bad-input sweeps kept as tables: one per public entry point, each row a call, the exception it
must raise and a fragment its message must hold (so no row passes on the type alone).

The ops have their own table (``tests/test_ops_bad_inputs.py``, CPU and CUDA), the command line its own
(``tests/test_bad_inputs_cli.py``). Here: ``Policy`` and its constructors, ``KVCompressor``, ``compress(...)`` and
profile files. ``ROW_COUNTS`` at the end counts the rows per table.
"""

from __future__ import annotations

import json
import os
from typing import Callable, NamedTuple

import pytest
import torch

from ripplekv_ext import KVCompressor, Policy
from ripplekv_ext.profile_file import ProfileError, load_profile, save_profile

pytest.importorskip("transformers")

NAN, INF = float("nan"), float("inf")


class Case(NamedTuple):
    id: str
    call: Callable  # call(ctx) -> anything; must raise
    error: type
    fragment: str


def params(cases, marks=None):
    marks = marks or {}
    return [pytest.param(c, id=c.id, marks=marks.get(c.id, ())) for c in cases]


def check_case(case: Case, ctx):
    with pytest.raises(case.error) as info:
        case.call(ctx)
    assert case.fragment in str(info.value), f"{case.id}: {info.value}"


# ---- shared inputs ----------------------------------------------------------------------------------------------

class Ctx:
    """What the rows call into, built once per module."""


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    from ripplekv_ext.eval.models import tiny_model
    from ripplekv_ext.profiler import profile_model

    c = Ctx()
    c.model = tiny_model("llama", seed=0)
    c.other_model = tiny_model("llama", seed=0, num_layers=2)
    c.tmp = tmp_path_factory.mktemp("bad-inputs")
    ids = torch.randint(3, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    c.profile = profile_model(c.model, examples=ids, prefix_len=16, cont_len=4, num_examples=2, progress=False,
                              model_name="tiny-llama")
    c.profile_path = c.tmp / "good.json"
    save_profile(c.profile, c.profile_path)
    c.good = json.loads(c.profile_path.read_text())
    g = torch.Generator().manual_seed(1)
    c.q = torch.randn(1, 4, 8, 16, generator=g)
    c.k = torch.randn(1, 2, 64, 16, generator=g)
    c.v = torch.randn(1, 2, 64, 16, generator=g)
    c.snapkv = KVCompressor(Policy.snapkv(0.5, window=8), num_layers=4)
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


# ---- profile files ----------------------------------------------------------------------------------------------

def _load(c, path, **kwargs):
    return load_profile(path, **kwargs)


PROFILE_FILES = [
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
         "profile must be a ripplekv_ext.profile_file.Profile"),
]


@pytest.mark.parametrize("case", params(PROFILE_FILES))
def test_profile_files(case, ctx):
    check_case(case, ctx)


def test_save_profile_expands_home(ctx, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    save_profile(ctx.profile, "~/saved.json")
    assert (tmp_path / "saved.json").is_file() and not (tmp_path / "~").exists()
    assert load_profile("~/saved.json").sensitivity == ctx.profile.sensitivity


def test_refused_save_writes_nothing(ctx):
    assert not (ctx.tmp / "never.json").exists() and not (ctx.tmp / "dict.json").exists()


ROW_COUNTS = {"profile files": len(PROFILE_FILES)}


def test_every_table_has_rows_with_distinct_ids():
    for table in (PROFILE_FILES,):
        ids = [case.id for case in table]
        assert len(ids) == len(set(ids)) and all(case.fragment for case in table)
