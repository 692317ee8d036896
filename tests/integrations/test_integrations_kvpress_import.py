"""The kvpress integration's import, in every environment: without kvpress it says how to install the supported
release, and ``import ripplekv_ext`` does not need kvpress at all."""

import subprocess
import sys
import textwrap


def _run(code, folder):
    # From an empty folder, so the installed package is imported, not a source tree in the current folder.
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=folder)


def test_without_kvpress_the_error_names_the_install(tmp_path):
    # kvpress made unimportable whether or not this environment has it.
    result = _run("""
        import sys
        class NoKvpress:
            def find_spec(self, name, path=None, target=None):
                if name == "kvpress" or name.startswith("kvpress."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
        sys.meta_path.insert(0, NoKvpress())
        import ripplekv_ext
        assert "kvpress" not in sys.modules
        import ripplekv_ext.integrations.kvpress
    """, tmp_path)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ripplekv_ext.integrations.kvpress needs kvpress: pip install kvpress==0.5.5")
