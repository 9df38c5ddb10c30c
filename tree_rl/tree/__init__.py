"""Rollout trees (host), TreeBatch (device), derived arrays and segment kernels."""

from tree_rl.tree.batch import Buckets, TreeBatch, pack, unpack
from tree_rl.tree.derived import (
    FlatLeaves,
    LossAggregation,
    TreeStructure,
    flatten_leaves,
    gather_tokens,
    path_token_index,
    sequence_weights,
    structure,
    token_leaf_mask,
    token_loss_weights,
    tree_attention_mask,
)
from tree_rl.tree.rollout_tree import Leaf, Node, RolloutTree, TreeError
from tree_rl.tree.segment import (
    discounted_reverse_cumsum,
    gather,
    segment_count,
    segment_max,
    segment_mean,
    segment_min,
    segment_std,
    segment_sum,
    segment_zscore,
)
from tree_rl.tree.types import DEFAULT_REWARD_CHANNELS, LeafTag, NodeKind
