"""Advantage estimators (registered under AdvEstimator) and method pieces.

Importing this package registers every estimator.
"""

from tree_rl.algos.registry import (
    AdvEstimator,
    Advantages,
    compute_advantages,
    get,
    make_config,
    register,
    registered,
)
