"""The ``psd`` command: one-line errors for bad input, checked in process (no engine starts: the default suite);
JSON output, eval, the demo and calibration through the command itself, in a subprocess that decodes through
vLLM (marked ``engine``)."""

import json
import os
import subprocess
import sys

import pytest

from psd_plugin import DEFAULT_AR, DEFAULT_DLLM


def psd(*args, input=None):
    """The command; decoding verbs run the model eagerly (``--enforce-eager``: no compilation at every start,
    which the vLLM and server tests cover) and vLLM's engine core in the command's process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: its own process imports vLLM and torch again, about 30 of a command's
    50 s here; the engine-core process is the server tests' and the parallel tests')."""
    eager = ["--enforce-eager"] if args and args[0] in ("generate", "eval", "demo") and "--help" not in args else []
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    return subprocess.run([sys.executable, "-m", "psd_plugin.cli", *args, *eager], capture_output=True, text=True,
                          input=input, timeout=600, env=env)


@pytest.mark.engine
def test_generate_json_fields_from_a_prompts_file(tmp_path):
    """``psd generate --json`` over a prompts file (a blank line skipped) with a method and a config: one JSON row
    per prompt with its fields, TPF consistent with them, the chat template applied, static's one token per
    forward."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Sort the list: 5 2 8"}\n\n{"prompt": "Reverse the list: x y z"}\n')
    r = psd("generate", "--json", "--prompts", str(f), "--method", "static", "--config", '{"cache": "none"}')
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert {"prompt", "prompt_token_ids", "text", "token_ids", "nfe", "tpf", "seconds"} <= set(row)
        assert row["tpf"] == pytest.approx(len(row["token_ids"]) / row["nfe"], abs=1e-4)
        assert row["nfe"] >= len(row["token_ids"])
    assert rows[0]["prompt_token_ids"][:2] == [1, 3]  # <|startoftext|><|user|>: the chat template


@pytest.mark.engine
def test_demo_shows_each_task_with_its_answer_and_forwards():
    """The first command: one held-out item per task through vLLM with PSD, graded, with the forwards static
    decoding takes beside PSD's; the engine's start-up log goes to a file, not the terminal."""
    from psd_plugin.train.tasks import TASKS, grade, load_heldout

    r = psd("demo")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("psd through vLLM on dream-tiny")
    table = [line for line in lines if line.split(" ", 1)[0] in TASKS]
    assert [line.split()[0] for line in table] == list(TASKS)
    rows = [load_heldout(t)[0] for t in TASKS]
    header = lines[lines.index(table[0]) - 1]
    a0, a1 = header.index("answer"), header.index("right")  # the answer column
    right = 0
    for row, line in zip(rows, table):
        ok, tpf, nfe, nfe_static = line[a1:].split()
        assert ok in ("yes", "no") and int(nfe_static) >= int(nfe) > 0 and float(tpf) > 0
        assert (ok == "yes") == grade(row, line[a0:a1].strip().replace("\\n", "\n"))
        right += ok == "yes"
    assert lines[-2].startswith(f"{right}/{len(TASKS)} right;") and "static decoding takes" in lines[-2]
    assert float(lines[-2].split("(TPF ")[1].split(")")[0]) > 1
    log = lines[-1].removeprefix("(engine log: ").removesuffix(")")
    assert "WARNING" not in r.stdout + r.stderr and "WARNING" in open(log).read()


@pytest.mark.engine
def test_eval_json_reproduces_the_model_card():
    """The whole held-out split of one task through the serving path gives the model card's figure (the card
    was measured with the reference engine: the vLLM path decodes the same tokens)."""
    card = json.loads((DEFAULT_DLLM / "card.json").read_text())["eval"]
    r = psd("eval", "--task", "reverse", "--method", "confidence", "--limit", "300", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert set(res["accuracy"]) == {"reverse"} and res["samples"] == 300
    assert res["accuracy"]["reverse"] == card["results"]["confidence"]["accuracy"]["reverse"]
    assert res["tpf"] == pytest.approx(res["tokens_per_sample"] / res["nfe_per_sample"], abs=1e-3)
    assert res["tpf"] > 1  # confidence decoding commits more than a token per forward here


@pytest.mark.parametrize("args,needle", [
    (["generate", "--method", "magic"], "--method 'magic' for a dLLM; allowed: static, confidence"),
    (["generate", "--config", "{nope"], "--config: not valid JSON"),
    (["generate", "--config", '{"threshold": 3}'], "--config: Expected `float` <= 1.0 - at `$.threshold`"),
    (["generate", "--config", '{"tau": 0.5}'], "unknown field `tau`; allowed fields: threshold"),
    (["generate", "--prompts", "/nonexistent.jsonl"], "--prompts /nonexistent.jsonl: cannot read"),
    (["generate", "--max-tokens", "0"], "--max-tokens must be > 0"),
    (["generate", "--prompt", "1 " * 400], "exceeds the model's context of 512 tokens"),
    (["generate", "--engine", "vllm", "--dtype", "float64"], "--dtype float64 runs on --engine reference only"),
    (["generate", "--engine", "vllm", "--model", str(DEFAULT_AR)], "--engine vllm decodes dLLMs"),
    (["generate", "--model", "/nonexistent"], "not a model directory"),
    (["eval", "--task", "poetry"], "--task 'poetry'; allowed: all, sort"),
    (["generate", "--method", "spiffy", "--config", '{"policy": "static", "graph": "/nope.json"}'],
     "draft graph /nope.json: no such file"),
    (["generate", "--method", "spiffy", "--block-size", "16", "--config", '{"policy": "static"}'],
     "calibrated with block_size 8, this run uses 16"),
    (["calibrate", "--out", "/tmp/g.json", "--lookahead", "0"], "--lookahead must be > 0 (got 0)"),
    (["ngram", "--out", "/tmp/n.json", "--n", "0"], "--n and --examples must be >= 1"),
    (["quantize", str(DEFAULT_DLLM), "/tmp/psd-never-q", "--scheme", "W3"], "scheme 'W3'; allowed: W8A8, W4A16"),
    (["quantize", str(DEFAULT_DLLM), "/tmp/psd-never-q", "--scheme", "W4A16", "--group-size", "48"],
     "group_size 48: model.transformer.blocks.0.attn_out has 256 input features, not a multiple of it"),
])
def test_bad_input_is_one_line_error(capsys, args, needle):
    """In process, as ``psd`` runs it (``sys.exit(main())``): exit status 2, one line on stderr starting with the
    verb and naming the argument, no traceback, no engine started (the default suite's guard)."""
    from psd_plugin.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("psd ")]
    assert len(lines) == 1 and needle in lines[0], err


def test_argparse_errors_are_one_line_too(capsys):
    from psd_plugin.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--max-tokens", "many"])
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("psd ")]
    assert len(lines) == 1 and "--max-tokens: invalid int value: 'many'" in lines[0]


@pytest.mark.engine
def test_the_command_exits_with_status_2():
    """The process itself: ``python -m psd_plugin.cli`` turns ``main``'s 2 into the exit status."""
    r = psd("generate", "--method", "magic")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("psd ")] == [
        "psd generate: error: --method 'magic' for a dLLM; allowed: static, confidence, localleap, lopa, freedave, "
        "spiffy, psd, joint_threshold"]


@pytest.mark.engine
# CI's time (41 s): opt-in with PSD_FULL_MATRIX=1; calibration itself runs in CI (test_vllm_decoding's graphs for
# the random checkpoints, test_decoding)
@pytest.mark.skipif(not os.environ.get("PSD_FULL_MATRIX"), reason="opt-in: PSD_FULL_MATRIX=1")
def test_calibrate_command(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"Sort the list: {i} 3 1"}) + "\n" for i in range(6)))
    out = tmp_path / "g.json"
    r = psd("calibrate", "--prompts", str(f), "--lookahead", "2", "--budget", "4", "--out", str(out))
    assert r.returncode == 0, r.stderr
    g = json.loads(out.read_text())
    assert g["format_version"] == 1 and g["model"] == "llada-tiny" and len(g["nodes"]) <= 4
    prompts = ["--prompt", "Sort the list: 7 3 9 1", "--prompt", "Reverse the list: a b c d"]
    r = psd("generate", "--method", "spiffy", "--json", *prompts,
            "--config", json.dumps({"policy": "static", "graph": str(out)}))
    assert r.returncode == 0, r.stderr
    from psd_plugin.cli import main

    assert main(["generate", "--method", "static", "--json", "--engine", "reference", *prompts]) == 0  # vLLM's tokens
    spiffy = [json.loads(line) for line in r.stdout.splitlines()]
    static = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    # the graph is a real one: Spiffy with it decodes static's tokens in fewer forwards
    assert [row["token_ids"] for row in spiffy] == [row["token_ids"] for row in static]
    assert sum(row["nfe"] for row in spiffy) < sum(row["nfe"] for row in static)


def test_quantize_command(tmp_path, capsys):
    """``psd quantize`` writes a compressed-tensors checkpoint the reference engine reads (vLLM's side:
    tests/test_quantization.py)."""
    from model_executor.models.quantization import quantization_config
    from model_executor.models.reference import ReferenceDLLM
    from psd_plugin.cli import main

    out = tmp_path / "q"
    assert main(["quantize", str(DEFAULT_DLLM), str(out), "--scheme", "W4A16", "--group-size", "64",
                 "--ignore", "re:.*ff_out"]) == 0
    q = quantization_config(out)
    assert q["format"] == "pack-quantized" and q["ignore"] == ["lm_head", "re:.*ff_out"]
    assert (out / "tokenizer.json").exists()
    ReferenceDLLM.from_pretrained(out)
    assert main(["quantize", str(DEFAULT_DLLM), str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
