"""Shape letters and enums shared by every module.

Shape letters (used in names, docstrings and jaxtyping annotations):

  B  trees in a batch (one tree per prompt)
  L  packed tokens per tree
  N  nodes per tree
  K  leaves per tree
  C  reward channels
  V  vocabulary
  D  model width
  G  groups
"""

import enum

from jaxtyping import Array, Bool, Float, Int  # noqa: F401  (re-exported)


class NodeKind(enum.IntEnum):
  """What produced a node's tokens."""

  PROMPT = 0  # system + user + tool schemas; only the root.
  POLICY = 1  # sampled by the model: thinking, tool calls, answer.
  ENV = 2  # tool output and chat-template glue the model did not sample.


class LeafTag(enum.IntEnum):
  """Method-specific role of a leaf (APPO trains on INIT leaves only)."""

  INIT = 0
  BRANCH = 1


# Reward channels every TreeBatch carries unless told otherwise. Leaves use
# them for outcome rewards, nodes for per-step rewards (PORTool's formatting
# rubric lives in node_reward[..., "format"]).
DEFAULT_REWARD_CHANNELS = ("outcome", "format", "reasoning")
