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
# KV-heavy: as many KV heads as query heads, so a token's KV (2 layers x K and V x 32
# heads x 32 x 4 bytes = 16 KiB) is large next to its compute. For moving KV, not
# for quality: what `kvpush bench handoff` measures.
KV_HEAVY = {**SHAPE, "num_attention_heads": 32, "num_key_value_heads": 32}
# Other architectures, as tiny: what the shape tests run (tests/e2e/test_vllm_shapes.py).
# Each is (transformers config class, its settings over SHAPE's).
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {
        "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "norm_topk_prob": True,
    }),
    # MLA. Every layer dense (else vLLM wants e_score_correction_bias); the CPU MLA
    # backend takes a latent of 512 plus a rope part of 64 only.
    "deepseek_v3": ("DeepseekV3Config", {
        "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "first_k_dense_replace": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "n_group": 1, "topk_group": 1,
    }),
    # Sliding-window layers between full ones: two KV cache groups under vLLM's HMA.
    "gemma3_text": ("Gemma3TextConfig", {
        "num_hidden_layers": 4, "sliding_window": 256,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    }),
    # Gated DeltaNet (linear attention) layers and a full-attention one.
    "qwen3_next": ("Qwen3NextConfig", {
        "num_hidden_layers": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "num_experts": 4, "num_experts_per_tok": 2,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    }),
}  # fmt: skip
STAMP = "kvpush-tiny-model.json"


def cached_tiny_model() -> Path:
    """The tiny model in the user's cache, built there on first use."""
    return build_tiny_model(_cache() / "tiny-model")


def cached_kv_heavy_model() -> Path:
    """The KV-heavy tiny model (16 KiB of KV per token, 16k positions), cached alike."""
    return build_tiny_model(_cache() / "kv-heavy-model", shape=KV_HEAVY, positions=16384)


def kv_bytes_per_token(shape: dict[str, int], dtype_bytes: int = 4) -> int:
    """K and V of every layer for one token."""
    per_layer = 2 * shape["num_key_value_heads"] * shape["head_dim"] * dtype_bytes
    return shape["num_hidden_layers"] * per_layer


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpush"


def _sentences(seed: int, count: int = 3000) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "po", "an", "el", "st"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(500)]
    words += ["the", "of", "and", "kv", "cache", "prefill", "decode", "push", "token"]
    return [
        " ".join(rng.choices(words, k=rng.randint(5, 25))).capitalize() + rng.choice(".,!?")
        for _ in range(count)
    ]


def build_tiny_model(
    path: str | Path,
    seed: int = 0,
    init_std: float = 0.08,
    shape: dict[str, int] | None = None,
    positions: int = 4096,
    architecture: str = "llama",
) -> Path:
    """Write the model and tokenizer into `path` (reused if already built the same way).
    `architecture`: one of ARCHITECTURES."""
    path = Path(path)
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}")
    shape = {**(shape or SHAPE), **ARCHITECTURES[architecture][1]}
    recipe = {"seed": seed, "init_std": init_std, "vocab": VOCAB, **shape}
    if positions != 4096:
        recipe["positions"] = positions  # (so the default model's stamp is unchanged)
    if architecture != "llama":
        recipe["architecture"] = architecture
    stamp = path / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(path, seed, positions)
    _build_weights(path, tokenizer, seed, init_std, shape, positions, architecture)
    stamp.write_text(json.dumps(recipe))
    return path


def _build_tokenizer(path: Path, seed: int, positions: int):
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
        model_max_length=positions,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(path)
    return tokenizer


def _build_weights(
    path: Path,
    tokenizer,
    seed: int,
    init_std: float,
    shape: dict[str, object],
    positions: int,
    architecture: str,
) -> None:
    import torch
    import transformers

    config_class = getattr(transformers, ARCHITECTURES[architecture][0])
    config = config_class(
        vocab_size=VOCAB,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **shape,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, weight in sorted(model.named_parameters()):
            if weight.dim() >= 2:  # matrices and embeddings; norms stay at one
                weight.copy_(torch.randn(weight.shape, generator=generator) * init_std)
    model.generation_config.do_sample = False
    model.save_pretrained(path, safe_serialization=True)
