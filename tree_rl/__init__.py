"""tree_rl: tree-structured reinforcement learning for tool-using LLMs in JAX.

Notebooks and scripts import the public subpackages: `tree_rl.tree` (rollout
trees, packed TreeBatch, segment kernels) and `tree_rl.algos` (advantage
estimators and the registry).
"""

import os

# tree_rl reads only tokenizers and configs from transformers and has its own models, so
# transformers' import-time advice that PyTorch is missing means nothing here.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

__version__ = "0.1.0"
