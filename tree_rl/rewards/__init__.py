"""Rewards: outcome verifiers live with their task families (`tree_rl.envs`); here are
the cross-family pieces: PORTool's formatting rubric, AWPO's execution match, and the
LLM-judge client."""

from tree_rl.rewards.execution_match import awpo_outcome_reward, execution_match
from tree_rl.rewards.formatting import FORMAT_HALF_WIDTH, formatting_raw, rescale_formatting
