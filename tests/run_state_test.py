"""The run state a checkpoint's metadata holds (tree_rl.resume.RunState)."""

import pytest

from tree_rl.resume import RunState, kept_row


def test_run_state_round_trips_and_reads_metadata_written_before_it():
  run = RunState(step=3, data_position=12, eval={"sft": {"accuracy": 0.25}}, sft_done=True,
                 sft_step=10, sft_skipped=1)
  assert RunState.from_json(run.to_json()) == run
  assert "method_state" not in run.to_json()  # a strategy that learns nothing saves none
  traced = RunState(method_state={"predictor": "running_mean"})
  assert RunState.from_json(traced.to_json()).method_state == {"predictor": "running_mean"}
  # An RL checkpoint of a run without SFT never wrote the SFT counters.
  old = RunState.from_json({"step": 2, "data_position": 4, "eval": {}, "sft_done": False})
  assert (old.step, old.sft_step, old.sft_skipped, old.method_state) == (2, 0, 0, None)


def test_unknown_metadata_fails_naming_the_field():
  with pytest.raises(ValueError, match=r"unknown field\(s\) \['stpe'\]"):
    RunState.from_json({"stpe": 1})


def test_a_resume_keeps_the_rows_of_what_its_checkpoint_holds():
  run = RunState(step=2, eval={"base": {}}, sft_done=False, sft_step=3)
  assert kept_row({"step": 2}, run) and not kept_row({"step": 3}, run)
  assert kept_row({"step": 2, "phase": "sft"}, run)
  assert not kept_row({"step": 3, "phase": "sft"}, run)  # SFT step 4 is redone
  assert kept_row({"step": 0, "phase": "eval:base"}, run)
  assert not kept_row({"step": 0, "phase": "eval:sft"}, run)
