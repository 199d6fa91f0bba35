"""A tiny PaliGemma (SigLIP vision tower + Gemma text model) with seeded random weights, written
locally in seconds: no download, no hub.

    build_tiny_paligemma(path, seed)                       # the whole model from one seed
    build_tiny_paligemma(path, seed, vision_seed=other)    # same text model, other vision weights

The weights are drawn with std 0.2 (not transformers' 0.02, nor vLLM's dummy ±1e-3) so the
generated tokens depend on the prompt and on the image embeddings: a consumer fed embeddings of
other vision weights generates other tokens. The text model's weights come from `seed` alone, so
two checkpoints that differ only in `vision_seed` share every non-vision tensor.

The tokenizer is character-level (every printable ASCII character, newline included: vLLM's
PaliGemma processor appends a newline to each prompt), with the special tokens PaliGemma's
processor needs (`<bos>`, `<eos>`, `<pad>`, `<image>`) and a chat template that renders the
user's text (vLLM's chat path for images needs one; PaliGemma's image tokens are inserted by the
processor, not by the template).

Weights are saved under the names vLLM's PaliGemma loader maps (`vision_tower.vision_model.*`,
`multi_modal_projector.*`, `language_model.model.*`), the pre-4.52 transformers layout, whatever
layout the installed transformers uses in memory.
"""
from __future__ import annotations

import json
import os
import string
from pathlib import Path

IMAGE_SIZE = 56
PATCH_SIZE = 14
NUM_IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # 16
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]
INIT_STD = 0.2
# PaliGemma divides image features by sqrt(text hidden size) while Gemma multiplies token
# embeddings by it: with every weight at INIT_STD the image tokens would be ~1/64 of the text
# tokens in the residual stream and the generated tokens would hardly depend on the image. A
# larger projector brings them to the same scale.
PROJECTOR_STD = 2.0
DTYPE = "float32"

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% endif %}{% endfor %}"
)


def _vocab() -> list[str]:
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    return SPECIAL + chars  # 102 tokens: whatever the model generates decodes to characters


def _config_dict(vocab_size: int) -> dict:
    image_token = _vocab().index("<image>")
    return {
        "architectures": ["PaliGemmaForConditionalGeneration"],
        "model_type": "paligemma",
        "image_token_index": image_token,
        "hidden_size": 64,
        "projection_dim": 64,
        "vocab_size": vocab_size,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "torch_dtype": DTYPE,
        "text_config": {
            "model_type": "gemma", "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "num_hidden_layers": 2, "vocab_size": vocab_size, "max_position_embeddings": 512,
            "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "torch_dtype": DTYPE,
        },
        "vision_config": {
            "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 2, "num_hidden_layers": 2, "image_size": IMAGE_SIZE,
            "patch_size": PATCH_SIZE, "projection_dim": 64, "num_image_tokens": NUM_IMAGE_TOKENS,
            "torch_dtype": DTYPE,
        },
    }


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_vocab())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=["<image>"])
    fast.add_bos_token = True
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    # Loaders read these from tokenizer_config.json: make sure they are there whatever the
    # transformers version wrote.
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update({"add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512})
    cfg_path.write_text(json.dumps(cfg, indent=1))


def _write_processor(path: Path) -> None:
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SiglipImageProcessor",
        "processor_class": "PaliGemmaProcessor",
        "do_resize": True, "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True, "image_seq_length": NUM_IMAGE_TOKENS,
    }, indent=1))
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "PaliGemmaProcessor", "image_seq_length": NUM_IMAGE_TOKENS,
    }, indent=1))


def _vllm_name(name: str) -> str | None:
    """transformers' in-memory parameter name -> the checkpoint name vLLM's loader maps."""
    for old, new in (("model.vision_tower.", "vision_tower."),
                     ("model.multi_modal_projector.", "multi_modal_projector."),
                     ("model.language_model.", "language_model.model."),
                     ("lm_head.", None)):  # tied to the input embeddings (Gemma)
        if name.startswith(old):
            return None if new is None else new + name[len(old):]
    if name.startswith(("vision_tower.", "multi_modal_projector.", "language_model.")):
        return name
    raise ValueError(f"unexpected parameter {name}")


def _random_state(config, seed: int, vision_seed: int) -> dict:
    import torch
    from transformers import PaliGemmaForConditionalGeneration

    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config)
    state = {}
    for name, tensor in model.state_dict().items():
        out = _vllm_name(name)
        if out is None:
            continue
        if out.startswith("vision_tower.") and not out.startswith("vision_tower.vision_model."):
            out = "vision_tower.vision_model." + out[len("vision_tower."):]
        # one generator per tensor, seeded from the seed that owns it and its name, so a tensor
        # does not depend on the order of the others or on the other seed
        owner = vision_seed if out.startswith("vision_tower.") else seed
        gen = torch.Generator().manual_seed(hash_name(out) ^ (owner * 0x9E3779B1 & 0xFFFFFFFF))
        if tensor.dim() == 1 and ("norm" in out):
            # RMS/LayerNorm weights: around 1 (Gemma's RMSNorm scales by 1 + w: around 0)
            value = torch.randn(tensor.shape, generator=gen) * 0.05
            if "vision_tower." in out and out.endswith(".weight"):
                value += 1.0
        elif out.startswith("multi_modal_projector.") and out.endswith(".weight"):
            value = torch.randn(tensor.shape, generator=gen) * PROJECTOR_STD
        else:
            value = torch.randn(tensor.shape, generator=gen) * INIT_STD
        state[out] = value.to(getattr(torch, DTYPE)).contiguous()
    return state


def hash_name(name: str) -> int:
    """A stable 32-bit hash (Python's hash() is salted per process)."""
    import zlib
    return zlib.crc32(name.encode())


def build_tiny_paligemma(path: str | os.PathLike, seed: int = 0, vision_seed: int | None = None) -> str:
    """Write a tiny seeded PaliGemma checkpoint (config, safetensors weights, tokenizer,
    processor configs) into `path`; returns the path. `vision_seed` (default `seed`) seeds the
    vision tower alone."""
    from safetensors.torch import save_file
    from transformers import PaliGemmaConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = len(_vocab())
    cfg = _config_dict(vocab_size)
    config = PaliGemmaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    state = _random_state(config, seed, seed if vision_seed is None else vision_seed)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}, indent=1))
    _write_tokenizer(path)
    _write_processor(path)
    return str(path)


if __name__ == "__main__":
    import argparse
    import time

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vision-seed", type=int, default=None)
    args = parser.parse_args()
    t0 = time.perf_counter()
    build_tiny_paligemma(args.path, args.seed, args.vision_seed)
    print(f"tiny PaliGemma (seed {args.seed}, vision seed {args.vision_seed or args.seed}) "
          f"written to {args.path} in {time.perf_counter() - t0:.2f}s")
