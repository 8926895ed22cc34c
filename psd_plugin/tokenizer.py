"""The embedded models' tokenizer: a small byte-level BPE with LLaDA's mask token and a chat template.

Digits are split one per token (arithmetic stays learnable); special tokens are fixed ids 0-4.
"""

from __future__ import annotations

from pathlib import Path

EOS, BOS, MASK, USER, ASSISTANT = "<|endoftext|>", "<|startoftext|>", "<|mdm_mask|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [EOS, BOS, MASK, USER, ASSISTANT]
VOCAB_SIZE = 512

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}" + ASSISTANT + "\n{{ m['content'] }}" + EOS + "\n"
    "{% else %}" + USER + "\n{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "\n{% endif %}"
)


def render_prompt(user_text: str) -> str:
    """The chat template applied to one user turn with the generation prompt (what the models train on)."""
    return f"{BOS}{USER}\n{user_text}\n{ASSISTANT}\n"


def train_tokenizer(texts, out_dir: str | Path, vocab_size: int = VOCAB_SIZE):
    """Train the BPE on ``texts`` and save it as a ``PreTrainedTokenizerFast`` with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                                   mask_token=MASK, additional_special_tokens=[USER, ASSISTANT])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 512
    fast.save_pretrained(str(out_dir))
    return fast
