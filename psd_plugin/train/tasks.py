"""Verifiable tasks with exact graders: the corpus the embedded models learn and are evaluated on.

Every task is a generator of ``(prompt, answer)`` pairs plus a grader. Tasks are chosen so that a
few-million-parameter model can learn them on a CPU, and so that output positions depend on each
other (a sorted list, a reversed list, a carried digit, a function body): committing many tokens in
one forward can break them, which is what parallel decoders have to get right.

Two families: the short tasks (answers of about 5-8 tokens, one block) and the long ones (``LONG_TASKS``:
answers of 64-256 tokens, several blocks: ``count``, from a short prompt, where every number is computed from
the one before; ``sort_lines``, the short ``sort`` skill applied to 6-12 labelled lines; ``count_lines``, ``count``
with labelled lines and a stop given as a number of lines), so that block decoding, caches
and drafts are measured where they matter. ``answer_budget(task)`` is the generation budget a task is evaluated and
trained with.

The held-out split is fixed: ``HELDOUT_SEED`` generates ``HELDOUT_SIZE`` distinct prompts per task,
shipped as ``psd_plugin/data/heldout.jsonl``; the training stream skips every held-out prompt.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import resources
from typing import Callable

from . import confined

HELDOUT_SEED = 20261122
HELDOUT_SIZE = 300

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_NAMES = ["Ann", "Bob", "Cal", "Dee", "Eve", "Finn", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lu", "Max", "Ned"]
_ITEMS = ["apples", "pens", "books", "cards", "coins", "shells", "stamps", "marbles", "cups", "hats"]


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str
    answer: str
    tests: tuple[str, ...] = ()  # python asserts, for the ``python`` task

    def to_json(self) -> dict:
        d = {"task": self.task, "prompt": self.prompt, "answer": self.answer}
        if self.tests:
            d["tests"] = list(self.tests)
        return d


def _digits(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randint(0, 9) for _ in range(rng.randint(lo, hi))]


def _fmt(xs) -> str:
    return " ".join(str(x) for x in xs)


def gen_sort(rng: random.Random) -> Example:
    xs = _digits(rng, 3, 6)
    return Example("sort", f"Sort the list: {_fmt(xs)}", _fmt(sorted(xs)))


def gen_reverse(rng: random.Random) -> Example:
    xs = [rng.choice(_LETTERS) for _ in range(rng.randint(3, 6))]
    return Example("reverse", f"Reverse the list: {_fmt(xs)}", _fmt(xs[::-1]))


def gen_dedup(rng: random.Random) -> Example:
    pool = rng.sample(range(10), rng.randint(2, 4))
    xs = [rng.choice(pool) for _ in range(rng.randint(4, 7))]
    out = list(dict.fromkeys(xs))
    return Example("dedup", f"Remove duplicates: {_fmt(xs)}", _fmt(out))


def gen_add_each(rng: random.Random) -> Example:
    k = rng.randint(1, 5)
    xs = _digits(rng, 3, 5)
    return Example("add_each", f"Add {k} to each: {_fmt(xs)}", _fmt(x + k for x in xs))


def gen_lookup(rng: random.Random) -> Example:
    keys = rng.sample(_LETTERS, rng.randint(3, 5))
    table = {k: rng.randint(0, 9) for k in keys}
    query = rng.sample(keys, rng.randint(1, 3))
    tab = ", ".join(f"{k}={v}" for k, v in table.items())
    return Example("lookup", f"Table: {tab}. Look up: {_fmt(query)}", _fmt(table[q] for q in query))


def gen_arith(rng: random.Random) -> Example:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    if rng.random() < 0.5:
        verb = rng.choice(["gets", "buys", "finds"])
        q = f"{name} has {a} {item} and {verb} {b} more. How many {item} now?"
        work, res = f"{a} + {b} = {a + b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        verb = rng.choice(["gives away", "loses", "sells"])
        q = f"{name} has {a} {item} and {verb} {b}. How many {item} now?"
        work, res = f"{a} - {b} = {a - b}", a - b
    return Example("arith", q, f"{work}\n#### {res}")


_PY_FUNCS = ["f", "g", "calc", "solve", "func", "apply", "step", "compute"]
_PY_ARGS = ["x", "n", "a", "v", "num"]
_PY_ARITH = {"plus": "+", "minus": "-", "times": "*", "modulo": "%"}
_PY_LIST = {
    "the list reversed": "{a}[::-1]",
    "the largest item of the list": "max({a})",
    "the smallest item of the list": "min({a})",
    "the sum of the list": "sum({a})",
    "the length of the list": "len({a})",
    "the list sorted": "sorted({a})",
}


def gen_python(rng: random.Random) -> Example:
    name, arg = rng.choice(_PY_FUNCS), rng.choice(_PY_ARGS)
    if rng.random() < 0.7:
        word = rng.choice(list(_PY_ARITH))
        k = rng.randint(1, 20)
        prompt = f"Write a python function {name}({arg}) that returns {arg} {word} {k}."
        body = f"{arg} {_PY_ARITH[word]} {k}"
        samples = [rng.randint(-9, 30) for _ in range(3)]
    else:
        desc = rng.choice(list(_PY_LIST))
        prompt = f"Write a python function {name}({arg}) that returns {desc}."
        body = _PY_LIST[desc].format(a=arg)
        samples = [[rng.randint(0, 9) for _ in range(rng.randint(1, 5))] for _ in range(3)]
    tests = tuple(f"assert {name}({s!r}) == {eval(body, {arg: s})!r}" for s in samples)
    return Example("python", prompt, f"def {name}({arg}):\n    return {body}", tests)


def gen_count(rng: random.Random) -> Example:
    """Count from ``a`` to ``b`` in steps of ``s``: a short prompt, an answer of 64-256 tokens (a token per digit
    and per space) where the digits carry and the count must stop at ``b``; a line break every ten numbers."""
    s = rng.choice([1, 2, 3, 5, 10])
    a = rng.randint(10, 300)
    n = rng.randint(22, 60)
    xs = [a + s * i for i in range(n)]
    lines = [_fmt(xs[i:i + 10]) for i in range(0, n, 10)]
    return Example("count", f"Count from {a} to {xs[-1]} in steps of {s}.", "\n".join(lines))


def gen_sort_lines(rng: random.Random) -> Example:
    """Sort each of 6-12 labelled lists (``A: 3 1 2 5``), one per line, labels kept: an answer of 64-180 tokens
    (a token per label, colon, digit and separator) made of the short ``sort`` skill applied line by line. The
    labels make each answer line content-addressable (answer line ``C`` sorts prompt line ``C``), which a small
    model learns far sooner than counting lines; every line is graded."""
    lines = [_digits(rng, 4, 6) for _ in range(rng.randint(6, 12))]
    labels = _LETTERS.upper()
    prompt = "Sort each line:\n" + "\n".join(f"{labels[i]}: {_fmt(xs)}" for i, xs in enumerate(lines))
    return Example("sort_lines", prompt, "\n".join(f"{labels[i]}: {_fmt(sorted(xs))}" for i, xs in enumerate(lines)))


def gen_count_lines(rng: random.Random) -> Example:
    """``count`` with a stop a small model can see: count from ``a`` in steps of ``s`` for ``L`` (2-5) lines of ten
    numbers, each line labelled ``1:``, ``2:``, ...; 86-215 answer tokens. The stop is the label reaching the prompt's
    one digit ``L``, not the current number reaching an end number of up to three digits (the compare-and-stop that
    models trained on ``count`` learned last or not at: they count on past the end)."""
    s = rng.choice([1, 2, 3, 5, 10])
    a = rng.randint(10, 300)
    n_lines = rng.randint(2, 5)
    xs = [a + s * i for i in range(10 * n_lines)]
    lines = [f"{i + 1}: {_fmt(xs[10 * i:10 * i + 10])}" for i in range(n_lines)]
    return Example("count_lines", f"Count from {a} in steps of {s}: {n_lines} lines of ten.", "\n".join(lines))


GENERATORS: dict[str, Callable[[random.Random], Example]] = {
    "sort": gen_sort,
    "reverse": gen_reverse,
    "dedup": gen_dedup,
    "add_each": gen_add_each,
    "lookup": gen_lookup,
    "arith": gen_arith,
    "python": gen_python,
    "count": gen_count,  # the long families: new tasks go last, so the held-out items of earlier ones stay put
    "sort_lines": gen_sort_lines,
    "count_lines": gen_count_lines,
}
LONG_TASKS = ("count", "sort_lines", "count_lines")
TASKS = tuple(t for t in GENERATORS if t not in LONG_TASKS)  # the short tasks (32-token budget)
ALL_TASKS = tuple(GENERATORS)
SHORT_BUDGET, LONG_BUDGET = 32, 256


def parse_tasks(text: str) -> tuple[str, ...]:
    """A comma-separated task list (a task may repeat: its weight in a training mix); names the unknown ones."""
    tasks = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in tasks if t not in GENERATORS]
    if bad or not tasks:
        raise ValueError(f"unknown {bad or 'empty'}; allowed: {', '.join(ALL_TASKS)}")
    return tasks


def answer_budget(task: str) -> int:
    """Tokens a task's answer may take (answer + EOS fits): 32 for the short tasks, 256 for the long ones."""
    return LONG_BUDGET if task in LONG_TASKS else SHORT_BUDGET


# ---------------------------------------------------------------------------------------- graders
def _norm(s: str) -> str:
    return " ".join(s.split())


_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_number(text: str) -> str | None:
    """GSM8K-style flexible extraction: the number after ``####``, else the last number."""
    m = re.search(r"####\s*(-?[\d,]+(?:\.\d+)?)", text)
    if m:
        s = m.group(1)
    else:
        nums = _NUM.findall(text)
        if not nums:
            return None
        s = nums[-1]
    s = s.replace(",", "")
    try:
        v = float(s)
    except ValueError:
        return None
    return str(int(v)) if v == int(v) else str(v)


def run_python_tests(code: str, tests: tuple[str, ...] | list[str], timeout: float = 5.0) -> bool:
    """MBPP-style check: run the candidate code and its asserts in a fresh interpreter; True when it exits 0.

    The code is the model's, so the interpreter (:mod:`.confined` run as a script) confines itself before it
    runs it: its CPU, memory and file-size limits, no new processes,
    an empty environment, a scratch directory as its working directory (removed afterwards), its output
    discarded (a flood of prints cannot fill this process's memory). Past ``timeout`` its process group is
    killed. These are limits against accidents; it still reads and writes what the user running the grader can.
    """
    src = code + "\n\n" + "\n".join(tests) + "\n"
    with tempfile.TemporaryDirectory(prefix="psd-grade-", ignore_cleanup_errors=True) as scratch:
        proc = subprocess.Popen([sys.executable, "-I", os.path.abspath(confined.__file__)], cwd=scratch,
                                env={}, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.communicate(src.encode("utf-8", "surrogateescape"), timeout=timeout)
        except subprocess.TimeoutExpired:
            try:  # the group: whatever it may have started dies with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.communicate()  # reaps it and closes its stdin
            return False
    return proc.returncode == 0


def grade(example: dict | Example, output: str) -> bool:
    """Exact grader for one model output (the text generated after the prompt, EOS stripped)."""
    ex = example.to_json() if isinstance(example, Example) else example
    task = ex["task"]
    if task == "arith":
        return extract_number(output) == extract_number(ex["answer"])
    if task == "python":
        return run_python_tests(output, ex.get("tests", ()))
    if task in LONG_TASKS:  # the long families: line by line, each line exact
        return [_norm(x) for x in output.strip().splitlines()] == [_norm(x) for x in ex["answer"].splitlines()]
    return _norm(output) == _norm(ex["answer"])


# ------------------------------------------------------------------------------------- the splits
def make_heldout(seed: int = HELDOUT_SEED, size: int = HELDOUT_SIZE) -> list[Example]:
    """The fixed held-out split: ``size`` distinct prompts per task, generated from ``seed``."""
    out: list[Example] = []
    for ti, (task, gen) in enumerate(GENERATORS.items()):
        rng = random.Random(seed * 1000 + ti)
        seen: set[str] = set()
        while len(seen) < size:
            ex = gen(rng)
            if ex.prompt not in seen:
                seen.add(ex.prompt)
                out.append(ex)
    return out


def load_heldout(task: str | None = None) -> list[dict]:
    """The shipped held-out split (``psd_plugin/data/heldout.jsonl``), optionally one task."""
    text = resources.files("psd_plugin").joinpath("data/heldout.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if task is not None and task != "all":
        if task not in ALL_TASKS:
            raise ValueError(f"unknown task {task!r}; allowed: all, {', '.join(ALL_TASKS)}")
        rows = [r for r in rows if r["task"] == task]
    return rows


def training_stream(seed: int, exclude: set[str], tasks: tuple[str, ...] = ALL_TASKS):
    """An endless, reproducible stream of training examples of ``tasks``, interleaved uniformly (the models
    shipped before the long family were trained on ``TASKS``, the short ones)."""
    unknown = [t for t in tasks if t not in GENERATORS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; allowed: {', '.join(ALL_TASKS)}")
    rng = random.Random(seed)
    gens = [GENERATORS[t] for t in tasks]
    while True:
        ex = rng.choice(gens)(rng)
        if ex.prompt not in exclude:
            yield ex
