"""The vLLM internals the plugin relies on (``patches.TARGETS``) exist in the installed vLLM with the parameters the
plugin was written against, and installing the plugin wraps each wrapped target once."""

import inspect

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

from ripplekv_ext.engines import vllm as plugin  # noqa: E402
from ripplekv_ext.engines.vllm import patches  # noqa: E402

WRAPPED = ["vllm.platforms.cpu:CpuPlatform.check_and_update_config",
           "vllm.model_executor.layers.attention.attention:Attention.get_kv_cache_spec",
           "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
           "vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks",
           "vllm.v1.engine.core:get_kv_cache_configs"]


@pytest.mark.parametrize("target", patches.TARGETS, ids=[t.path.split(":")[1] for t in patches.TARGETS])
def test_each_target_exists_with_the_parameters_the_plugin_expects(target):
    obj = patches.resolve(target.path)
    # A wrapped target is checked through to vLLM's own function.
    while getattr(obj, "ripplekv_original", None) is not None:
        obj = obj.ripplekv_original
    assert tuple(inspect.signature(obj).parameters) == target.parameters


def test_each_target_says_where_it_runs_why_what_would_remove_it_and_what_later_releases_changed():
    assert len({t.path for t in patches.TARGETS}) == len(patches.TARGETS)
    for target in patches.TARGETS:
        assert target.process in patches.PROCESSES, target.path
        assert all(len(text) > 10 for text in (target.why, target.until, target.later)), target.path
        assert "0.33.0" in target.later and "0.34.0" in target.later, target.path


def test_the_static_reader_of_another_release_agrees_with_the_installed_one():
    # tools/vllm_targets.py, which wrote each target's `later`, reads the installed vLLM's files as the runtime
    # check above resolves them: every target the same.
    import sys
    from pathlib import Path

    import vllm

    tools = Path(__file__).resolve().parents[3] / "tools"
    sys.path.insert(0, str(tools))
    try:
        import vllm_targets
    finally:
        sys.path.remove(str(tools))
    report = vllm_targets.report(Path(vllm.__file__).parents[1])
    assert set(report) == {t.path for t in patches.TARGETS}
    assert {path: status for path, status in report.items() if status != "same"} == {}


def test_installing_twice_wraps_each_target_once():
    plugin.register()
    wrappers = {path: patches.resolve(path) for path in WRAPPED}
    patches.install()  # as a second engine in the same process would
    for path, wrapper in wrappers.items():
        now = patches.resolve(path)
        assert getattr(now, "__func__", now) is getattr(wrapper, "__func__", wrapper), path
        original = getattr(now, "ripplekv_original")
        assert getattr(original, "ripplekv_original", None) is None, path  # vLLM's own function under one wrapper
    assert set(WRAPPED) <= {t.path for t in patches.TARGETS}


def test_wrap_once_wraps_plain_functions_and_classmethods():
    class Owner:
        def method(self, x):
            return x

        @classmethod
        def build(cls, x):
            return x

    def doubled(original):
        return lambda *args: 2 * original(*args)

    def doubled_classmethod(original):
        return lambda cls, x: 2 * original(x)

    for _ in range(2):
        patches.wrap_once(Owner, "method", doubled)
        patches.wrap_once(Owner, "build", doubled_classmethod, as_classmethod=True)
    assert Owner().method(3) == 6 and Owner.build(3) == 6
