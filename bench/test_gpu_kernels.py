"""The GPU kernel table's rehearsal: `bench/gpu_kernels.py --dry-run` runs every op through the code the device run
uses (CPU tensors, small shapes) and writes the JSON the device run writes."""

import json
import os

import gpu_kernels


def test_dry_run_writes_a_row_per_op_and_length(tmp_path, monkeypatch):
    monkeypatch.setenv("RIPPLEKV_CUDA_PATH", "fused")  # the run sets auto for its own calls and puts this back
    out = tmp_path / "gpu_kernels.json"
    assert gpu_kernels.main(["--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["device"] == "cpu (dry run)" and data["rounds"] == 2
    assert [(r["op"], r["n"]) for r in data["rows"]] == [(op, n) for op in gpu_kernels.OPS for n in (256, 512)]
    for row in data["rows"]:
        assert row["dtype"] == "float32" and row["shape"] == "dry-run"
        assert min(row["ext_us"], row["ref_us"], row["auto_us"]) > 0
        assert row["speedup"] == row["ref_us"] / row["ext_us"]
        assert row["hbm_fraction"] is None and row["extra_mib"] is None  # no device: no peak bandwidth, no allocator
    assert os.environ["RIPPLEKV_CUDA_PATH"] == "fused"
