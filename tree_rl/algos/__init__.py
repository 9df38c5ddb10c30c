"""Advantage estimators (registered under AdvEstimator) and method pieces.

Importing this package registers every estimator.
"""

from tree_rl.algos import appo, awpo, grpo, portool, trace, tree_baselines  # noqa: F401
from tree_rl.algos.registry import (
    AdvEstimator,
    Advantages,
    compute_advantages,
    get,
    make_config,
    register,
    registered,
)
