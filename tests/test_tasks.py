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


# Model-written code that would pass its asserts unconfined, but breaks one of the grader's limits first. The
# file names are relative (they would land in the grader's working directory); MARK is an absolute path that a
# started process would create.
_BREAKS_A_LIMIT = {
    "a huge allocation": "b = bytes(1 << 30)",  # 1 GiB past RLIMIT_AS (calloc: cheap even where unconfined)
    "a fork": "import os\npid = os.fork()\nif pid == 0:\n    open(MARK, 'w').close()\n    os._exit(0)\n"
              "os.waitpid(pid, 0)",
    "a subprocess": "import subprocess, sys\nsubprocess.run([sys.executable, '-c', f'open({MARK!r}, \"w\")'])",
    "a program": "import os\nos.execv('/bin/sh', ['sh', '-c', 'touch ' + MARK])",
    "a large file": "open('big.bin', 'wb').write(bytes(8 << 20))",
}


def _confined_dirs(tmp_path, monkeypatch):
    """The test's working directory and the grader's temporary directory, both empty."""
    import tempfile

    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir(), tmp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return cwd, tmp


@pytest.mark.parametrize("what", list(_BREAKS_A_LIMIT))
def test_python_grader_fails_code_that_breaks_a_limit_quickly_and_leaves_nothing(what, tmp_path, monkeypatch):
    import time

    cwd, tmp = _confined_dirs(tmp_path, monkeypatch)
    mark = tmp_path / "mark"
    code = f"MARK = {str(mark)!r}\n" + _BREAKS_A_LIMIT[what] + "\ndef f(x):\n    return x + 3"
    t0 = time.monotonic()
    assert not tasks.run_python_tests(code, ["assert f(2) == 5"], timeout=30.0), what
    assert time.monotonic() - t0 < 10  # refused at once, not killed at the timeout
    assert not mark.exists() and list(cwd.iterdir()) == [] and list(tmp.iterdir()) == []


def test_python_grader_stops_a_busy_loop_at_its_cpu_limit():
    import time

    t0 = time.monotonic()
    assert not tasks.run_python_tests("while True: pass", ["assert True"], timeout=60.0)
    assert time.monotonic() - t0 < 30  # RLIMIT_CPU (2 s of CPU), long before the wall-clock timeout


def test_python_grader_runs_in_a_removed_scratch_directory_with_no_environment(tmp_path, monkeypatch):
    """Ordinary code (threads, a small file, ``__main__``) still passes; it sees neither this process's
    environment nor its working directory, and its scratch directory is gone afterwards."""
    cwd, tmp = _confined_dirs(tmp_path, monkeypatch)
    monkeypatch.setenv("PSD_GRADER_SECRET", "x")
    code = ("import os, threading\n"
            "assert 'PSD_GRADER_SECRET' not in os.environ and __name__ == '__main__'\n"
            f"assert os.getcwd() != {str(cwd)!r}\n"
            "open('note.txt', 'w').write('x')\n"
            "t = threading.Thread(target=print)\nt.start(), t.join()\n"
            "def f(x):\n    return x + 3")
    assert tasks.run_python_tests(code, ["assert f(2) == 5"])
    assert list(cwd.iterdir()) == [] and list(tmp.iterdir()) == []
