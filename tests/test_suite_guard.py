"""The default suite starts no vLLM engine: a test that starts one fails unless it is marked ``engine`` or
``slow`` (``tests/conftest.py``), also when a module-scoped fixture starts it."""

from pathlib import Path

pytest_plugins = ["pytester"]

INNER = '''
import pytest
from vllm.v1.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def started():
    return LLMEngine(None, None)


def test_unmarked():
    LLMEngine(None, None)


def test_unmarked_fixture(started):
    pass


@pytest.mark.engine
def test_marked():
    with pytest.raises(Exception) as e:
        LLMEngine(None, None)
    assert "starts a vLLM engine" not in str(e.value)  # vLLM's own error: the guard let it through
'''


def test_an_unmarked_test_that_starts_an_engine_fails(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER)
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "")
    res.assert_outcomes(passed=1, failed=1, errors=1)
    out = res.stdout.str()
    assert "test_inner.py::test_unmarked starts a vLLM engine: mark it `engine`" in out
    assert "test_inner.py::test_unmarked_fixture starts a vLLM engine" in out


MISSING_IN_A_TEST = '''
import pytest


def test_needs_a_package():
    pytest.importorskip("psd_no_such_package")


def test_needs_a_newer_package():
    pytest.importorskip("pytest", minversion="999")


def test_skips_for_a_reason():
    pytest.skip("not here")


@pytest.mark.skipif(True, reason="needs CUDA")
def test_skipped_by_a_marker():
    pass


def test_runs():
    pass
'''
MISSING_IN_A_MODULE = '''
import pytest

pytest.importorskip("psd_no_such_package")


def test_in_a_module_that_needs_a_package():
    pass
'''


def test_a_missing_test_dependency_fails_ci_and_skips_locally(pytester, monkeypatch):
    """``pytest.importorskip`` skips where a package is absent; with ``CI=true`` (``.ci/run``) that is a failure
    naming the package, in a test or at a module's top (a collection error), and other skips stay skips."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_in_a_test=MISSING_IN_A_TEST, test_in_a_module=MISSING_IN_A_MODULE)
    for ci in ("false", None):  # a developer's machine: skipped, as pytest does
        if ci is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", ci)
        res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "")
        res.assert_outcomes(passed=1, skipped=5)
    monkeypatch.setenv("CI", "true")
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "", "test_in_a_test.py")
    res.assert_outcomes(passed=1, skipped=2, failed=2)
    out = res.stdout.str()
    assert "could not import 'psd_no_such_package'" in out and "required is: '999'" in out
    assert "CI=true: a missing test dependency fails the run" in out
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "")
    res.assert_outcomes(errors=1)  # the module's collection: the run stops there
    assert res.ret != 0 and "ERROR collecting test_in_a_module.py" in res.stdout.str()
