"""Checks and describes the wheels `make dist` wrote: what each contains, its tags, the torch it requires, and
auditwheel's verdict. Writes DIST/wheels.json; exits non-zero if a wheel carries what it must not or lacks what it must.

    python tools/dist_report.py dist
"""

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

# Shipped: the compiled library (one stable-ABI module), the bundled model's profile, LongBench's protocol data.
REQUIRED = [r"ripplekv_ext/_C\.abi3\.so", r"ripplekv_ext/eval/profiles/.+\.json",
            r"ripplekv_ext/eval/longbench_config/.+\.json", r"ripplekv_ref/__init__\.py"]
# Never shipped: build folders, tests, benchmarks and their results, the lab, sources of the compiled code.
FORBIDDEN = r"(^|/)(build|tests|bench|experiments|csrc|include|cmake-build)/|\.(cpp|cu|cuh|o)$"


def wheel_facts(path):
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/WHEEL"))
        tags = [line.split(": ", 1)[1] for line in wheel.read(f"{dist_info}/WHEEL").decode().splitlines()
                if line.startswith("Tag: ")]
        metadata = wheel.read(f"{dist_info}/METADATA").decode()
    requires = [line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    problems = [f"missing {pattern}" for pattern in REQUIRED if not any(re.fullmatch(pattern, n) for n in names)]
    problems += [f"carries {n}" for n in names if re.search(FORBIDDEN, n)]
    torch_pin = [r for r in requires if r.startswith("torch")]
    if not torch_pin or "<" not in torch_pin[0]:
        problems.append(f"does not pin one torch release: {torch_pin}")
    version = metadata.split("\nVersion: ", 1)[1].split("\n")[0]
    return {"file": path.name, "bytes": path.stat().st_size, "version": version, "tags": tags, "requires": requires,
            "files": len(names), "problems": problems}


# What torch provides beside a wheel that requires it (its libgomp too: torch ships one under that name and loads it
# first); make_dist.sh keeps them out of the wheel.
TORCH_LIBS = {"libc10.so", "libc10_cuda.so", "libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so", "libgomp.so.1",
              "libcudart.so.13"}


def auditwheel_verdict(path):
    """auditwheel's reading of the wheel: the manylinux tag its symbols allow, and which libraries it needs from
    outside; compliant when those are torch's alone."""
    auditwheel = Path(sys.executable).parent / "auditwheel"
    done = subprocess.run([str(auditwheel), "show", "--json", str(path)], capture_output=True, text=True, check=True)
    shown = json.loads(done.stdout)
    external = sorted(shown["external_libs"])
    outside_torch = [lib for lib in external if lib not in TORCH_LIBS]
    return {"symbols_allow": shown["sym_tag"], "external_libs": external, "external_not_torch": outside_torch,
            "verdict": (f"{shown['sym_tag']} except torch's own libraries" if not outside_torch
                        else f"not manylinux: needs {outside_torch}")}


def main(folder):
    folder = Path(folder)
    report = {"sdist": [p.name for p in folder.glob("ripplekv_ext-*.tar.gz")], "wheels": []}
    for path in sorted(folder.glob("ripplekv_ext-*.whl")):
        facts = wheel_facts(path)
        facts["auditwheel"] = auditwheel_verdict(path)
        if facts["auditwheel"]["external_not_torch"]:
            facts["problems"].append(facts["auditwheel"]["verdict"])
        report["wheels"].append(facts)
        print(f"{facts['file']}: {facts['bytes'] / 2**20:.1f} MiB, {facts['files']} files, tags {facts['tags']}, "
              f"requires {facts['requires']}")
        print(f"  auditwheel show: {facts['auditwheel']['verdict']} (needs {facts['auditwheel']['external_libs']})")
        for problem in facts["problems"]:
            print(f"  PROBLEM: {problem}")
    (folder / "wheels.json").write_text(json.dumps(report, indent=1) + "\n")
    bad = [w["file"] for w in report["wheels"] if w["problems"]]
    if bad or not report["wheels"] or not report["sdist"]:
        sys.exit(f"dist: problems in {bad}" if bad else "dist: no wheel or no sdist was written")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dist")
