"""The hybrid bench model (Gemma3's layer pattern) and the block and chunk sizes its sections
use: shared by :mod:`.vllm_hybrid` and :mod:`.vllm_checkpoints`, which import it and not each
other."""

from __future__ import annotations

from typing import Any

#: the sliding window of the model's sliding layers, in tokens
WINDOW = 512
#: The bench model: Gemma3's layer pattern (five sliding-window layers, then one full one).
MODEL: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
    "max_position_embeddings": 16384,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "query_pre_attn_scalar": 64,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
BLOCK_SIZE = 128
CHUNK_TOKENS = 256
