"""AWPO execution-match score (arXiv 2512.19126, eqs. 16-19) and outcome reward (eq. 14),
with tree_rl's matching rule and empty-set conventions (docs/methods/awpo.md)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import examples
from tree_rl.rewards import awpo_outcome_reward, execution_match


def call(name, **arguments):
  return {"name": name, "arguments": arguments}


WEATHER = call("weather", city="Paris", unit="C")
TIME = call("time", tz="Europe/Paris")


def test_exact_match_is_one():
  assert execution_match([WEATHER, TIME], [WEATHER, TIME]) == 1.0
  assert execution_match([WEATHER, TIME], [TIME, WEATHER]) == 1.0  # order does not matter
  assert execution_match([call("now")], [{"name": "now"}]) == 1.0  # missing arguments = {}


def test_spec_example():
  # GT [weather(city, unit), time(tz)], predicted [weather(city correct, unit wrong)]:
  # r_name = |{weather}| / |{weather, time}| = 0.5; r_para = J({city, unit}, {city, unit}) = 1;
  # r_value = 1 (city); denominator 1 + |T| + sum |v(T_i)| = 1 + 2 + 3 = 6.
  pred = [call("weather", city="Paris", unit="F")]
  assert execution_match([WEATHER, TIME], pred) == pytest.approx(2.5 / 6)


def test_parameter_jaccard_and_values():
  # GT f(a=1, b=2); predicted f(a=1, c=3): r_name = 1, J({a, b}, {a, c}) = 1/3, r_value = 1
  # -> (1 + 1/3 + 1) / (1 + 1 + 2) = 7/12.
  assert execution_match([call("f", a=1, b=2)], [call("f", a=1, c=3)]) == pytest.approx(7 / 12)
  # Wrong tool name only: r_name = J({f}, {g}) = 0, nothing matched -> 0.
  assert execution_match([call("f", a=1)], [call("g", a=1)]) == 0.0
  # Extra predicted call: r_name = J({f}, {f, g}) = 1/2; f matched fully: (0.5 + 1 + 1) / 3.
  assert execution_match([call("f", a=1)], [call("f", a=1), call("g")]) == pytest.approx(2.5 / 3)


def test_exact_value_match_is_canonical_json():
  gt = [call("f", x=5)]
  assert execution_match(gt, [call("f", x="5")]) == pytest.approx(2 / 3)  # "5" != 5
  assert execution_match(gt, [call("f", x=5.0)]) == pytest.approx(2 / 3)  # 5.0 != 5
  assert execution_match([call("f", x=True)], [call("f", x=1)]) == pytest.approx(2 / 3)
  # Dict key order does not matter, list order does.
  gt = [call("f", x={"a": 1, "b": [1, 2]})]
  assert execution_match(gt, [call("f", x={"b": [1, 2], "a": 1})]) == 1.0
  assert execution_match(gt, [call("f", x={"b": [2, 1], "a": 1})]) == pytest.approx(2 / 3)


def test_empty_conventions():
  # A matched zero-argument tool: J(empty, empty) = 1 -> (1 + 1 + 0) / (1 + 1 + 0) = 1.
  assert execution_match([call("now")], [call("now")]) == 1.0
  # No ground-truth calls: ToolRL's 0 by default, whatever the prediction.
  assert execution_match([], []) == 0.0
  assert execution_match([], [WEATHER]) == 0.0
  # The alternative convention: 1 when the prediction makes no call either.
  assert execution_match([], [], no_call="match") == 1.0
  assert execution_match([], [WEATHER], no_call="match") == 0.0
  # Ground truth present, no prediction: r_name = J({weather}, {}) = 0 -> 0.
  assert execution_match([WEATHER], []) == 0.0
  with pytest.raises(ValueError, match="toolrl"):
    execution_match([], [], no_call="skip")


def test_greedy_one_to_one_matching():
  # Two GT calls of one tool, one prediction: only one GT call is matched.
  # r_name = 1; first GT call takes the prediction: J = 1, values 1 -> (1 + 1 + 1) / (1 + 2 + 2).
  gt = [call("f", a=1), call("f", a=2)]
  assert execution_match(gt, [call("f", a=1)]) == pytest.approx(3 / 5)
  # A GT call takes the best unused prediction, not the first: f(a=1) takes the second
  # prediction (1 + 1 beats 1 + 0) and f(a=2) the first -> 1.
  assert execution_match(gt, [call("f", a=2), call("f", a=1)]) == 1.0
  # With f(a=3) in place of f(a=2), GT f(a=2) is left with f(a=3) (J = 1, no value):
  # (1 + (1 + 1) + (1 + 0)) / 5.
  assert execution_match(gt, [call("f", a=3), call("f", a=1)]) == pytest.approx(4 / 5)
  # Ties go to the earliest prediction. GT f(a=1) scores 1 + 0 against both f(a=2) and
  # f(a=3) and takes f(a=2); GT f(a=2) is left with f(a=3): 1 + 0. Total (1 + 1 + 1) / 5,
  # although the other choice would give 4/5: the rule is greedy, not an optimal assignment.
  gt = [call("f", a=1), call("f", a=2)]
  assert execution_match(gt, [call("f", a=2), call("f", a=3)]) == pytest.approx(3 / 5)


def test_outcome_reward():
  assert awpo_outcome_reward(True, [WEATHER, TIME], [WEATHER, TIME]) == 2.0
  pred = [call("weather", city="Paris", unit="F")]
  assert awpo_outcome_reward(True, [WEATHER, TIME], pred) == pytest.approx(1 + 2.5 / 6)
  # Invalid format: S_format = 0 and the calls are not scored.
  assert awpo_outcome_reward(False, [WEATHER, TIME], [WEATHER, TIME]) == 0.0
  assert awpo_outcome_reward(True, [], []) == 1.0
  assert awpo_outcome_reward(True, [], [], no_call="match") == 2.0


def test_malformed_calls_raise():
  with pytest.raises(TypeError, match="name"):
    execution_match([{"arguments": {}}], [])
  with pytest.raises(TypeError, match="arguments"):
    execution_match([call("f")], [{"name": "f", "arguments": "{\"a\": 1}"}])


# Brute force over every one-to-one assignment bounds the greedy score from above; on
# single-argument tools, where greedy is optimal, it equals it.
NAMES = ("f", "g")
ARGS = ("a", "b")


def _call():
  return st.builds(lambda n, kv: {"name": n, "arguments": kv}, st.sampled_from(NAMES),
                   st.dictionaries(st.sampled_from(ARGS), st.integers(0, 1), max_size=2))


def _best_assignment(gt, pred):
  def pair(t, p):
    if t["name"] != p["name"]:
      return 0.0
    ta, pa = set(t["arguments"]), set(p["arguments"])
    jac = len(ta & pa) / len(ta | pa) if ta | pa else 1.0
    return jac + sum(1 for k in ta if k in pa and t["arguments"][k] == p["arguments"][k])
  best = 0.0
  for perm in itertools.permutations(range(len(pred) + len(gt)), len(gt)):
    best = max(best, sum(pair(t, pred[j]) for t, j in zip(gt, perm) if j < len(pred)))
  return best


@settings(max_examples=examples(100), deadline=None)
@given(gt=st.lists(_call(), max_size=3), pred=st.lists(_call(), max_size=3))
def test_range_and_upper_bound(gt, pred):
  s = execution_match(gt, pred)
  assert 0.0 <= s <= 1.0
  names_t = {c["name"] for c in gt}
  names_p = {c["name"] for c in pred}
  r_name = len(names_t & names_p) / len(names_t | names_p) if names_t | names_p else 0.0
  denom = 1 + len(gt) + sum(len(c["arguments"]) for c in gt)
  assert s <= (r_name + _best_assignment(gt, pred)) / denom + 1e-12
  if gt and sorted(map(repr, gt)) == sorted(map(repr, pred)):
    assert s == 1.0
  if s == 1.0:
    # Names are sets (eq. 16): an extra duplicate of a predicted call costs nothing.
    assert names_t == names_p
