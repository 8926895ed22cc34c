"""``psd train``: the Dream-format dLLM (shifted logits, Qwen2 names) started from the AR model, as Dream was made
from Qwen2.5; the training loop writes a checkpoint in the real format that the engines load."""

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
