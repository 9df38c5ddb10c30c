"""Main training job: `python launch/train.py --config=configs/apppo.py`.

The trainer (`tree_rl.train.train_and_evaluate`) is built in the end-to-end
issue; until it lands this entry point says so and exits with status 1 rather
than pretending to train.
"""

import importlib.util
import sys


def main() -> int:
  try:
    spec = importlib.util.find_spec("tree_rl.train")
  except ModuleNotFoundError:
    print("tree_rl is not installed: run `pip install -e .` from the repository root.",
          file=sys.stderr)
    return 1
  if spec is None:
    print(
        "tree_rl: the trainer (tree_rl.train.train_and_evaluate) is not yet available.\n"
        "Available now: rollout trees, TreeBatch packing and every advantage estimator\n"
        "(see README.md, 'What works today'); run the tests or benchmarks/advantages.py.",
        file=sys.stderr,
    )
    return 1
  raise RuntimeError("launch/train.py must be rewritten to call tree_rl.train")


if __name__ == "__main__":
  sys.exit(main())
