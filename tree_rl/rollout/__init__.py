"""Rollout: engines (embedded JAX sampler, vLLM), the agent loop and branching strategies."""
