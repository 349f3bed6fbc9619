"""A tiny Llama and its tokenizer, built from nothing: no download, seconds on a CPU.

The tokenizer is a byte-level BPE trained on generated text; the model has random
weights from a fixed seed, drawn wider than usual so greedy decoding wanders
instead of repeating one token. Same seed, same bytes: the tests use greedy output
as their oracle.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

VOCAB = 2048
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # the smallest head size vLLM's CPU attention supports
}
STAMP = "kvpush-tiny-model.json"


def cached_tiny_model() -> Path:
    """The tiny model in the user's cache, built there on first use."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpush"
    return build_tiny_model(cache / "tiny-model")


def _sentences(seed: int, count: int = 3000) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "an", "el", "st"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(500)]
    words += ["the", "of", "and", "kv", "cache", "prefill", "decode", "push", "token"]
    return [
        " ".join(rng.choices(words, k=rng.randint(5, 25))).capitalize() + rng.choice(".,!?")
        for _ in range(count)
    ]


def build_tiny_model(path: str | Path, seed: int = 0, init_std: float = 0.08) -> Path:
    """Write the model and tokenizer into `path` (reused if already built the same way)."""
    path = Path(path)
    recipe = {"seed": seed, "init_std": init_std, "vocab": VOCAB, **SHAPE}
    stamp = path / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(path, seed)
    _build_weights(path, tokenizer, seed, init_std)
    stamp.write_text(json.dumps(recipe))
    return path


def _build_tokenizer(path: Path, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_sentences(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(path)
    return tokenizer


def _build_weights(path: Path, tokenizer, seed: int, init_std: float) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **SHAPE,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, weight in sorted(model.named_parameters()):
            if weight.dim() >= 2:  # matrices and embeddings; norms stay at one
                weight.copy_(torch.randn(weight.shape, generator=generator) * init_std)
    model.generation_config.do_sample = False
    model.save_pretrained(path, safe_serialization=True)
