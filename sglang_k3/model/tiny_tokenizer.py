"""A byte-level tokenizer built offline: one token per UTF-8 byte, plus special tokens.

No hub access and no training: the vocabulary is the 256 byte symbols of the ByteLevel
alphabet (ids 0-255, in byte order) followed by ``SPECIAL_TOKENS``. A prompt of N ASCII characters
is N tokens, which makes chunk and page boundaries easy to aim at in tests.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from sglang_k3.model.tiny_spec import BYTE_VOCAB, SPECIAL_TOKENS, TinyK3Spec

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|sep|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {}
    # ByteLevel maps each byte to a printable char; recover the byte order from the GPT-2 scheme.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    extra = 0
    for b in range(BYTE_VOCAB):
        if b in printable:
            byte_to_char[b] = chr(b)
        else:
            byte_to_char[b] = chr(BYTE_VOCAB + extra)
            extra += 1
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(BYTE_VOCAB)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def write_tokenizer(out_dir: str, spec: TinyK3Spec) -> None:
    tok = build_tokenizer()
    assert tok.get_vocab_size() == spec.vocab_size
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}, f, indent=2)
