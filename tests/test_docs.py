"""The README, docs/ and the lab's notes (experiments/) as a reader meets them: every relative link resolves, and
the README's quick start runs as written (its first Python block, in a fresh interpreter, outside the checkout, on the
bundled model)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md",
        *sorted((ROOT / "experiments").glob("**/*.md"))]
if not (ROOT / "README.md").is_file() or not (ROOT / "docs").is_dir():
    pytest.skip("needs the source checkout", allow_module_level=True)

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return [target for target in LINK.findall(text) if not re.match(r"^(https?:|mailto:|#)", target)]


@pytest.mark.parametrize("doc", [d for d in DOCS if d.is_file()], ids=lambda d: str(d.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = [target for target in _relative_links(doc) if not (doc.parent / target.split("#")[0]).exists()]
    assert broken == []


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md), [gone](nowhere.md#x), [web](https://example.com), ```[code](x.md)```")
    assert [t for t in _relative_links(page) if not (tmp_path / t.split("#")[0]).exists()] == ["nowhere.md#x"]


def test_readme_quick_start_runs_as_written(tmp_path):
    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S).group(1)
    assert "ripplekv_ext.compress" in block and "load_model" in block
    # Outside the checkout: the installed package, as a reader who copied the block would run it.
    done = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the quick start printed no answer"
