"""AWPO on single-step function calling (BFCL format): outcome reward S_format + S_exec,
judged reasoning reward R_reason, variance-aware gating, difficulty weighting and the adaptive
clip (AWPO, arXiv 2512.19126, §3.2; docs/methods/awpo.md).

The clip: one symmetric radius per rollout batch, eps = clip_min + (1 - w_bar) (clip_max -
clip_min) (Eq. 29), on one ratio per response (Eq. 30), taken in its length-normalised form
exp(mean log-ratio) (algo.loss.ratio_level="sequence"). The radii are on that ratio's scale:
clip_max=4e-4 (GSPO's upper radius for this ratio, arXiv 2507.18071 §5.1) and clip_min=2e-4
(the 1:2 spread of the token-ratio defaults 0.1 / 0.2). No algo.loss.clip_eps_* is set:
AWPO's radius is the only one, and the run config refuses them. Two minibatches per rollout
batch, so the second update sees a ratio other than 1 and the clip can act.

Command: python launch/train.py --config=configs/awpo.py --workdir=/tmp/awpo
Ablations: :group=8 ; :fixed_clip (the paper's "w/o dynamic clipping", Table 5: the fixed
radius clip_max) ; :runlocal. Needs `pip install --no-deps bfcl-eval` for the eval split.
Hardware: a 2-core CPU runs the default.
Expected metric: eval/accuracy (BFCL AST rule) on the bundled BFCL files. Measured only at
the notebooks' cpu scale (SmolLM2-135M with the main job's SFT and recipe, 5 RL steps,
2 seeds; RESULTS.md, AWPO section): accuracy 0.047, mean reward 1.04 of 2, where SFT left
0.062 and 1.01; GRPO, DAPO, Dr.GRPO and mixed-reward GRPO within noise of it. This config's
own recipe (lr 1e-5, temperature 1, no SFT) gave SmolLM2-135M zero reward in every sampled
group.

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
    on the outcome alone (awpo/frac_judge_missing, judge/failures).
"""

from configs import common


def get_config(arg=None):
  arg = common.parse_arg(arg, **{**common.COMMON_ARGS, "task": "bfcl"}, group=4,
                         judge="rubric", judge_url="", judge_model="", fixed_clip=False)
  c = common.base_config()
  c.algo.estimator = "awpo"
  # Radii of the length-normalised sequence ratio (Eq. 29's clip_min / clip_max).
  c.algo.estimator_kwargs = (dict(dynamic_clip=False, clip_max=4e-4) if arg.fixed_clip
                             else dict(clip_min=2e-4, clip_max=4e-4))
  c.algo.loss = dict(ratio_level="sequence")
  c.algo.num_minibatches = 2  # one update per batch keeps the ratio at 1: no clip would act
  c.rollout.strategy = "flat"
  c.rollout.samples_per_task = arg.group
  c.judge.kind = arg.judge
  c.judge.base_url, c.judge.model = arg.judge_url, arg.judge_model
  return common.apply_common_args(c, arg)
