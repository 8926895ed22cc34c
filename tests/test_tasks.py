import random

import pytest

from psd_plugin.train import tasks


def test_heldout_file_is_the_seeded_split():
    shipped = tasks.load_heldout()
    regenerated = [e.to_json() for e in tasks.make_heldout()]
    assert shipped == regenerated
    for t in tasks.TASKS:
        rows = tasks.load_heldout(t)
        assert len(rows) == tasks.HELDOUT_SIZE
        assert len({r["prompt"] for r in rows}) == len(rows)


def test_training_stream_never_yields_heldout_prompts():
    held = {r["prompt"] for r in tasks.load_heldout()}
    stream = tasks.training_stream(0, held)
    seen = [next(stream) for _ in range(3000)]
    assert not any(e.prompt in held for e in seen)
    assert {e.task for e in seen} == set(tasks.TASKS)


def test_graders_accept_reference_answers_and_reject_wrong_ones():
    rows = tasks.load_heldout()
    rng = random.Random(0)
    for t in tasks.TASKS:
        sample = rng.sample([r for r in rows if r["task"] == t], 5)
        for r in sample:
            assert tasks.grade(r, r["answer"]), r
            assert not tasks.grade(r, "0 0 0 0 0 0 0 0 9 9"), r


def test_arith_flexible_match():
    row = {"task": "arith", "prompt": "x", "answer": "3 + 4 = 7\n#### 7"}
    assert tasks.grade(row, "so 7\n#### 7")
    assert tasks.grade(row, "#### 7.0")
    assert tasks.grade(row, "the answer is 7")
    assert not tasks.grade(row, "#### 8")


def test_python_grader_runs_asserts_with_timeout():
    tests = ["assert f(2) == 5"]
    assert tasks.run_python_tests("def f(x):\n    return x + 3", tests)
    assert not tasks.run_python_tests("def f(x):\n    return x + 4", tests)
    assert not tasks.run_python_tests("def f(x) return", tests)
    assert not tasks.run_python_tests("while True: pass", tests, timeout=1.0)


def test_unknown_task_is_named():
    with pytest.raises(ValueError, match="unknown task 'nope'; allowed: all, sort"):
        tasks.load_heldout("nope")
