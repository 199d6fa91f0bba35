"""Tiny seeded checkpoints written locally (no downloads) for the real-engine tests.

vLLM's `load_format="dummy"` fills every weight with uniform noise of ±1e-3, so a model's output
does not depend on its prompt and cannot tell a correct KV load from a wrong one. These builders
write a real Hugging Face checkpoint (config, safetensors weights, tokenizer) whose weights are
drawn from a seeded normal distribution wide enough (std ~0.2) that every output token depends on
the prompt: two seeds give two different models, one seed always the same bytes.

Only transformers and tokenizers are used (both are vLLM dependencies); nothing leaves the machine.
Builders for other architectures (e.g. a tiny PaliGemma for the EC tests) belong in their own
modules beside this one and can reuse `write_byte_tokenizer`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

BOS, EOS = "<s>", "</s>"


def _byte_vocab() -> dict[str, int]:
    """GPT-2's byte-to-unicode table: every byte is one printable vocabulary symbol."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def write_byte_tokenizer(path: str | os.PathLike, extra_tokens: tuple[str, ...] = ()) -> int:
    """A byte-level tokenizer with no merges: one token per byte of UTF-8, then `<s>`, `</s>` and
    `extra_tokens`. Any text encodes, so tests control token counts (and block boundaries) with
    plain strings. Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = _byte_vocab()
    specials = [BOS, EOS, *extra_tokens]
    for token in specials:
        vocab[token] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   additional_special_tokens=list(extra_tokens) or None)
    fast.save_pretrained(str(path))
    return len(vocab)


def build_tiny_llama(path: str | os.PathLike, seed: int, *, num_layers: int = 2, hidden_size: int = 128,
                     num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 256,
                     max_position_embeddings: int = 2048, init_std: float = 0.2,
                     dtype: str = "float32") -> str:
    """A LlamaForCausalLM with weights drawn from N(0, init_std) under `seed`, saved with a byte
    tokenizer at `path` (created). The same arguments always give the same weights; a checkpoint
    already there with the same arguments is reused. Returns the path as a string."""
    path = Path(path)
    recipe = {"seed": seed, "num_layers": num_layers, "hidden_size": hidden_size, "num_heads": num_heads,
              "num_kv_heads": num_kv_heads, "intermediate_size": intermediate_size,
              "max_position_embeddings": max_position_embeddings, "init_std": init_std, "dtype": dtype}
    stamp = path / "ecd_recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return str(path)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    vocab_size = write_byte_tokenizer(path)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, initializer_range=init_std,
        bos_token_id=vocab_size - 2, eos_token_id=vocab_size - 1, tie_word_embeddings=False,
        torch_dtype=dtype)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # transformers' init: N(0, initializer_range), seeded above
    model.to(getattr(torch, dtype)).save_pretrained(str(path), safe_serialization=True)
    # Never stop on EOS: the tests compare a fixed number of generated tokens.
    generation = path / "generation_config.json"
    if generation.exists():
        generation.unlink()
    stamp.write_text(json.dumps(recipe))
    return str(path)
