"""The vLLM side of tree_rl's VLLMEngine (runs in vLLM's interpreter; see README.md)."""
