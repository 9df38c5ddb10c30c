"""TRACE-style training on multi-hop search QA: tree-structured groups optimised with
TreeRPO (sibling z-scores of backed-up means): TRACE, arXiv 2606.11119, §4.1-4.4 and
Eqs. 45-47 (TreeRPO, arXiv 2506.05183); tree_rl's readings: docs/methods/trace.md.

Roots and prefixes are allocated from a learned success predictor (the paper's): a
small value model over the serialized prefix tokens, trained online by MSE on the
backed-up success rates of each step's trees (eqs. 17-19;
tree_rl.algos.trace_value). Its loss is logged as trace/predictor_loss.

Command: python launch/train.py --config=configs/trace.py --workdir=/tmp/trace
Ablations: :runlocal; :predictor=running_mean (a prefix-blind per-task running mean
instead of the value head).
Hardware: a 2-core CPU runs the default.
Expected metric: eval/accuracy (exact match) on held-out questions. Measured only at the
notebooks' cpu scale (SmolLM2-135M with the main job's SFT and recipe, 5 RL steps, 2 seeds;
RESULTS.md, TRACE section): 0.109 after RL against 0.141 after SFT, GRPO 0.188 (0.203 at
TRACE's sampling cost), random allocation 0.156; within noise.
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **{**common.COMMON_ARGS, "task": "search_qa"},
                         predictor="value_head")
  c = common.base_config()
  c.algo.estimator = "tree_rpo"
  c.rollout.strategy = "trace"
  c.rollout.strategy_kwargs = dict(predictor=arg.predictor, predictor_kwargs={})
  if arg.predictor == "value_head":
    # A randomly initialised 2-layer model (the paper fine-tunes a pretrained Qwen3-0.6B
    # critic at lr 3e-5); 2 epochs per step as the paper's QA runs (App. E.6).
    c.rollout.strategy_kwargs.predictor_kwargs = dict(
        num_layers=2, hidden_size=64, max_prefix_tokens=1024, lr=1e-3, epochs=2)
  c = common.apply_common_args(c, arg)
  if arg.runlocal and arg.predictor == "value_head":
    c.rollout.strategy_kwargs.predictor_kwargs = dict(
        num_layers=1, hidden_size=32, num_heads=2, intermediate_size=64,
        max_prefix_tokens=512, lr=1e-3, epochs=1, batch_size=8)
  return c
