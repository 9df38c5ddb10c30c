"""tree_rl: tree-structured reinforcement learning for tool-using LLMs in JAX.

Notebooks and scripts import the public subpackages: `tree_rl.tree` (rollout
trees, packed TreeBatch, segment kernels) and `tree_rl.algos` (advantage
estimators and the registry).
"""

__version__ = "0.1.0"
