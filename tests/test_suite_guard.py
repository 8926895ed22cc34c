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
