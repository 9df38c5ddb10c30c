"""Reward functions: AWPO's execution-match outcome reward."""

from tree_rl.rewards.execution_match import awpo_outcome_reward, execution_match
