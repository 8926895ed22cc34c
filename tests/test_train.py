"""``psd train``: the Dream-format dLLM (shifted logits, Qwen2 names) started from the AR model, as Dream was made
from Qwen2.5; the training loop writes a checkpoint in the real format that the engines load."""

import re

import pytest
import torch

from model_executor.models.reference import ReferenceDLLM
from psd_plugin import DEFAULT_AR, DEFAULT_DLLM


def test_dream_from_the_ar_model_keeps_its_weights_and_shifts_its_predictions():
    from transformers import AutoTokenizer

    from psd_plugin.train.trainer import build_model, predictions

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    model, cfg = build_model("dllm", "small", tok, max_len=512, fmt="dream")
    assert cfg.model_type == "Dream" and model.spec.shift_logits
    ar = ReferenceDLLM.from_pretrained(DEFAULT_AR).state_dict()
    missing, unexpected = model.load_state_dict(ar, strict=False)
    assert not unexpected and missing and all(m.endswith("bias") for m in missing)  # q/k/v biases: zeros
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ar.items())
    x = torch.randint(5, 500, (2, 12))
    out, pred = model(x), predictions(model, x)
    assert torch.equal(pred[:, 1:], out[:, :-1]) and torch.equal(pred[:, 0], out[:, 0])


def test_training_writes_a_dream_checkpoint(tmp_path):
    from psd_plugin.train.trainer import main

    main(["--kind", "dllm", "--format", "dream", "--size", "tiny", "--steps", "2", "--batch", "4",
          "--tokenizer", str(DEFAULT_DLLM), "--out", str(tmp_path / "dream")])
    model = ReferenceDLLM.from_pretrained(tmp_path / "dream")
    assert model.spec.shift_logits and model.spec.family == "dream"
    with pytest.raises(SystemExit, match="shapes differ"):  # a tiny model cannot start from the small AR model
        main(["--kind", "dllm", "--format", "dream", "--size", "tiny", "--steps", "1", "--batch", "2",
              "--init", str(DEFAULT_AR), "--tokenizer", str(DEFAULT_DLLM), "--out", str(tmp_path / "bad")])


def test_a_batch_goes_through_the_model_by_answer_region():
    """Short rows are padded to their own region, never to a long row's 256: at inference a short answer's
    canvas has nothing after it, and bidirectional attention would see the padding."""
    from transformers import AutoTokenizer

    from psd_plugin.train.tasks import LONG_TASKS
    from psd_plugin.train.trainer import _batch, _dllm_tensors, by_region

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    prompts, answers, row_tasks = _batch(3, 0, 32, tok, set())
    assert set(LONG_TASKS) & set(row_tasks) and len(set(row_tasks)) > 2
    groups = by_region(row_tasks, 32)
    assert [r for r, _ in groups] == [32, 256]
    assert sorted(i for _, rows in groups for i in rows) == list(range(32))
    assert all((row_tasks[i] in LONG_TASKS) == (region == 256) for region, rows in groups for i in rows)
    short = groups[0][1]
    ids, is_answer = _dllm_tensors([prompts[i] for i in short], [answers[i] for i in short], 32, tok.eos_token_id)
    assert ids.shape[1] <= max(len(prompts[i]) for i in short) + 32 + 7
    assert ids.shape[1] < 256


def test_suffix_windows_cut_every_row_at_one_position_without_padding():
    """``--suffix-windows``: a group's rows end at one position short of the answer region (or at their whole
    region); no EOS padding follows a cut answer (it would teach the model that the canvas's end is the
    answer's)."""
    import random

    from transformers import AutoTokenizer

    from psd_plugin.train.trainer import _batch, _dllm_tensors, by_region, cut_regions

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_AR))
    prompts, answers, row_tasks = _batch(3, 0, 32, tok, set())
    region, rows = by_region(row_tasks, 32)[-1]
    rng, ends, cut = random.Random(0), set(), 0
    for _ in range(20):
        lens = cut_regions([len(prompts[i]) for i in rows], region, rng)
        ids, is_answer = _dllm_tensors([prompts[i] for i in rows], [answers[i] for i in rows], lens,
                                       tok.eos_token_id, pad_to_multiple=1)
        end = ids.shape[1]
        assert min(lens) >= 8 and max(lens) <= region
        assert (end - max(len(prompts[i]) for i in rows)) % 8 == 0
        for j, i in enumerate(rows):  # its prompt, its answer as far as the cut; padding only after a whole region
            want = (answers[i] + [tok.eos_token_id] * region)[: lens[j]]
            n = len(prompts[i]) + lens[j]
            assert ids[j, :n].tolist() == prompts[i] + want
            assert n == end or (lens[j] == region and set(ids[j, n:].tolist()) == {tok.eos_token_id})
        ends.add(end)
        cut += any(n < region for n in lens)
    assert len(ends) > 5 and cut > 5


def test_a_second_stage_continues_a_model_and_records_the_first(tmp_path):
    import json

    from psd_plugin.train.trainer import main

    common = ["--size", "tiny", "--batch", "4", "--tokenizer", str(DEFAULT_DLLM)]
    main(["--kind", "ar", "--steps", "1", "--tasks", "sort,reverse", *common, "--out", str(tmp_path / "a")])
    first = json.loads((tmp_path / "a" / "training.json").read_text())
    assert first["tasks"] == ["sort", "reverse"] and first["stages"] == []
    main(["--kind", "ar", "--steps", "1", "--init", str(tmp_path / "a"), *common, "--out", str(tmp_path / "b")])
    second = json.loads((tmp_path / "b" / "training.json").read_text())
    assert {"count", "sort_lines"} <= set(second["tasks"]) and "on sort, reverse" in second["stages"][0]
    with pytest.raises(SystemExit):
        main(["--kind", "ar", "--steps", "1", "--tasks", "sort,nope", *common, "--out", str(tmp_path / "c")])


def test_the_model_card_evaluates_a_long_family_on_its_first_items(tmp_path):
    """A card of a model trained on a long family: the short tasks on the whole split, the long one on its first
    ``--long-limit`` items (said in the card), with its own TPF beside the overall one."""
    import json

    from psd_plugin import model_card
    from psd_plugin.train.trainer import main

    out = tmp_path / "ar"
    main(["--kind", "ar", "--size", "tiny", "--steps", "1", "--batch", "4", "--tasks", "sort,count_lines",
          "--tokenizer", str(DEFAULT_DLLM), "--out", str(out)])
    model_card.main(["--model", str(out), "--long-limit", "3"])
    card = json.loads((out / "card.json").read_text())["eval"]
    greedy = card["results"]["greedy"]
    assert card["long_items"] == 3 and greedy["samples"] == 300 + 3
    assert set(greedy["tpf_by_task"]) == {"sort", "count_lines"} and greedy["tpf_by_task"]["count_lines"] == 1.0
    readme = (out / "README.md").read_text()
    assert "long tasks 256 on their first 3 items" in readme and "TPF per long family: `count_lines` 1.00 (greedy)" in readme
    assert "uniformly mixed" in readme
    assert model_card._mix(["sort", "count_lines", "count_lines"]) == "mixed by weight (count_lines 2 of 3 draws)"
    with pytest.raises(SystemExit):
        model_card.main(["--model", str(out), "--long-limit", "0"])


def test_a_run_resumes_from_its_state_and_refuses_a_state_that_is_not_data(tmp_path, capsys):
    """The resume state is read with the safe unpickler: a run continues from its own, and a file holding a
    pickled object (here one that would make a directory as it loads) is refused, naming the file, before it
    runs anything."""
    import json
    import os

    from psd_plugin.train.trainer import main

    common = ["--kind", "ar", "--size", "tiny", "--batch", "4", "--save-every", "1", "--tokenizer", str(DEFAULT_DLLM)]
    main([*common, "--steps", "1", "--out", str(tmp_path / "a")])
    capsys.readouterr()
    main([*common, "--steps", "2", "--out", str(tmp_path / "a")])
    assert "resumed at step 1" in capsys.readouterr().out
    info = json.loads((tmp_path / "a" / "training.json").read_text())
    assert info["steps"] == 2 and info["schedule_restarts"] == [{"at_step": 1, "steps": 2}]

    class Payload:
        def __reduce__(self):
            return os.mkdir, (str(tmp_path / "ran"),)

    state = tmp_path / "b" / "train_state.pt"
    state.parent.mkdir()
    torch.save({"model": {}, "opt": {}, "step": 0, "log": [], "wall": 0.0, "extra": Payload()}, state)
    with pytest.raises(SystemExit, match=f"{re.escape(str(state))}: refused by the safe loader .*posix.mkdir"):
        main([*common, "--steps", "1", "--out", str(tmp_path / "b")])
    assert not (tmp_path / "ran").exists()
