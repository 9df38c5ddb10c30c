"""Branching strategies: how a rollout call grows its trees (one module per method).

  flat      GRPO / DAPO: n independent episodes per prompt.
  portool   PORTool Algorithm 1: n trajectories, fork factor f, T_max, DupAndSamp.
  appo      APPO: N initial rollouts, top-B token positions by Branching Score, L loops.
  arpo      ARPO: entropy-triggered branching after tool rounds, beam size Z, budget M.
  trace     TRACE: predicted root allocation (DP) and prefix allocation (greedy).
  random    TreePO-style random token-position branching at a reference budget.
"""

from tree_rl.rollout.strategies.base import STRATEGIES, BranchingStrategy, make_strategy, register
from tree_rl.rollout.strategies.flat import FlatStrategy
from tree_rl.rollout.strategies.portool import PORToolStrategy
from tree_rl.rollout.strategies.appo import APPOStrategy, NodeArrays, behaviour_scorer, model_scorer
from tree_rl.rollout.strategies.arpo import ARPOStrategy
from tree_rl.rollout.strategies.trace import (PREDICTORS, RunningMeanPredictor, SuccessPredictor,
                                              TRACEStrategy, make_predictor)
from tree_rl.rollout.strategies.random_points import RandomStrategy

__all__ = ["APPOStrategy", "ARPOStrategy", "BranchingStrategy", "FlatStrategy", "NodeArrays",
           "PORToolStrategy", "PREDICTORS", "RandomStrategy", "RunningMeanPredictor", "STRATEGIES",
           "SuccessPredictor", "TRACEStrategy", "behaviour_scorer", "make_predictor",
           "make_strategy", "model_scorer", "register"]
