"""Building blocks of the LM and the Mimi codec (attention with KV cache, RoPE, norms, FFN, convolutions)."""
