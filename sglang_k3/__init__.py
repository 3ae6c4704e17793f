"""sglang-k3: a KDA-aware state cache for hybrid linear-attention models on SGLang."""
