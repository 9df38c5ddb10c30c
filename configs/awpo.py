"""AWPO on single-step function calling (BFCL format): outcome reward S_format + S_exec,
judged reasoning reward R_reason, variance-aware gating, difficulty weighting and the adaptive
clip (specs/awpo.md).

Command: python launch/train.py --config=configs/awpo.py --workdir=/tmp/awpo
Ablations: :group=8 ; :runlocal. Needs `pip install --no-deps bfcl-eval` for the eval split.
Hardware: a 2-core CPU runs the default.
Expected metric: eval/accuracy (BFCL AST rule) on the bundled BFCL files (not yet measured).

The reasoning reward (leaf channel "reasoning", logged as reward/reasoning_mean):
  - judge=rubric (default): offline and deterministic, no network. `tree_rl.rewards.rubric`
    rates the paper's four judge dimensions (Reasoning Path 35%, Tool Selection 30%,
    Parameter Setting 25%, Execution Strategy 10%) by rules against the task's oracle
    (BFCL's reference calls). A stand-in for the paper's LLM judge, not a reproduction of it.
  - judge=llm: the paper's setting, an LLM judge at any OpenAI-compatible endpoint, e.g.
      vllm serve Qwen/Qwen3-235B-A22B --port 8000
      --config=configs/awpo.py:judge=llm,judge_url=http://127.0.0.1:8000/v1,judge_model=Qwen/Qwen3-235B-A22B
    (or --config.judge.kind=llm --config.judge.base_url=... --config.judge.model=...; the
    token, if any, is read from $OPENAI_API_KEY, see config.judge.api_key_env). A judgement
    that still fails after its retries leaves that leaf without a score, and its group trains
    on the outcome alone (spec §7 E12; awpo/frac_judge_missing, judge/failures).
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **{**common.COMMON_ARGS, "task": "bfcl"}, group=4,
                         judge="rubric", judge_url="", judge_model="")
  c = common.base_config()
  c.algo.estimator = "awpo"
  c.algo.loss = dict(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4)
  c.rollout.strategy = "flat"
  c.rollout.samples_per_task = arg.group
  c.judge.kind = arg.judge
  c.judge.base_url, c.judge.model = arg.judge_url, arg.judge_model
  return common.apply_common_args(c, arg)
