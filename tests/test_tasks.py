import random
import re

import pytest

from psd_plugin.train import tasks


def test_heldout_file_is_the_seeded_split():
    shipped = tasks.load_heldout()
    regenerated = [e.to_json() for e in tasks.make_heldout()]
    assert shipped == regenerated
    for t in tasks.ALL_TASKS:
        rows = tasks.load_heldout(t)
        assert len(rows) == tasks.HELDOUT_SIZE
        assert len({r["prompt"] for r in rows}) == len(rows)


def test_training_stream_never_yields_heldout_prompts():
    held = {r["prompt"] for r in tasks.load_heldout()}
    stream = tasks.training_stream(0, held)
    seen = [next(stream) for _ in range(3000)]
    assert not any(e.prompt in held for e in seen)
    assert {e.task for e in seen} == set(tasks.ALL_TASKS)
    short = tasks.training_stream(0, held, tasks.TASKS)
    assert {next(short).task for _ in range(500)} == set(tasks.TASKS)
    with pytest.raises(ValueError, match="unknown task"):
        next(tasks.training_stream(0, held, ("sort", "nope")))


def test_graders_accept_reference_answers_and_reject_wrong_ones():
    rows = tasks.load_heldout()
    rng = random.Random(0)
    for t in tasks.ALL_TASKS:
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


def test_the_long_family_has_several_block_answers_from_short_prompts():
    from transformers import AutoTokenizer

    from psd_plugin import DEFAULT_AR

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    rows = tasks.load_heldout("count")
    n = [len(tok(r["answer"], add_special_tokens=False).input_ids) for r in rows]
    assert 64 <= min(n) and max(n) + 1 <= tasks.answer_budget("count") == 256
    assert sum(n) / len(n) > 120 and tasks.answer_budget("sort") == 32
    r = rows[0]
    assert tasks.grade(r, r["answer"] + "\n")
    assert not tasks.grade(r, r["answer"].replace("\n", " "))  # the lines are graded, not just the letters
    a, b, step = (int(x) for x in re.findall(r"\d+", r["prompt"]))
    assert r["answer"].split() == [str(x) for x in range(a, b + 1, step)]
    assert all(len(line.split()) == 10 for line in r["answer"].splitlines()[:-1])


def test_count_lines_is_count_with_labelled_lines_and_a_visible_stop():
    """The third long family: ``count`` written as 2-5 labelled lines of ten, the number of lines given in the prompt
    (the stop a model can see); 64-256 answer tokens; a line missing, extra, merged or mislabelled fails."""
    from transformers import AutoTokenizer

    from psd_plugin import DEFAULT_AR

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    rows = tasks.load_heldout("count_lines")
    n = [len(tok(r["answer"], add_special_tokens=False).input_ids) for r in rows]
    assert 64 <= min(n) and max(n) + 1 <= tasks.answer_budget("count_lines") == 256
    assert {len(r["answer"].splitlines()) for r in rows} == {2, 3, 4, 5}
    for r in rows[:50]:
        a, step, n_lines = (int(x) for x in re.findall(r"\d+", r["prompt"]))
        lines = r["answer"].splitlines()
        assert [x.split()[0] for x in lines] == [f"{i + 1}:" for i in range(n_lines)]
        assert [int(x) for line in lines for x in line.split()[1:]] == [a + step * i for i in range(10 * n_lines)]
    r = rows[0]
    assert tasks.grade(r, r["answer"] + "\n")
    assert not tasks.grade(r, r["answer"] + "\n9: 1 2 3")  # counting on past the last line
    assert not tasks.grade(r, "\n".join(r["answer"].splitlines()[:-1]))
    assert not tasks.grade(r, r["answer"].replace("\n", " "))
    assert not tasks.grade(r, r["answer"].replace("1:", "0:", 1))


def test_sort_lines_answers_span_blocks_and_fit_the_context():
    """The second long family: 6-12 labelled lists sorted line by line, 64-180 answer tokens; prompt + the 256-token budget
    fit the embedded models' 512 positions; a line out of order or merged fails."""
    from transformers import AutoTokenizer

    from psd_plugin import DEFAULT_AR

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    rows = tasks.load_heldout("sort_lines")
    n = [len(tok(r["answer"], add_special_tokens=False).input_ids) for r in rows]
    p = [len(tok(r["prompt"], add_special_tokens=False).input_ids) for r in rows]
    assert 64 <= min(n) and max(n) + 1 <= tasks.answer_budget("sort_lines") == 256
    assert max(p) + 16 + 256 <= 512  # the chat template's few tokens included
    r = rows[0]
    lines = r["prompt"].splitlines()[1:]
    assert [[x.split()[0]] + sorted(x.split()[1:]) for x in lines] == [x.split() for x in r["answer"].splitlines()]
    assert [x.split()[0] for x in lines] == [f"{c}:" for c in "ABCDEFGHIJKL"[:len(lines)]]  # labelled in order
    assert tasks.grade(r, r["answer"] + "\n")
    assert not tasks.grade(r, r["answer"].replace("\n", " "))
    assert not tasks.grade(r, "\n".join(reversed(r["answer"].splitlines())))
