"""LLMJudge against a scripted fake OpenAI-compatible server on 127.0.0.1.

The server answers each request with the next action of its script (sleep past the client's
timeout, an HTTP error, garbage, or a chat completion), so retries, fallbacks, voting and the
cache are checked by counting requests. Every test runs under a SIGALRM guard, the server
threads are daemons and every client request has a sub-second timeout, so nothing can hang.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import signal
import threading
import time

import pytest

from tree_rl.envs.base import Outcome, Task
from tree_rl.rewards import judge as judge_lib
from tree_rl.rewards.judge import JudgeConfig, LLMJudge

GUARD_S = 15  # per-test wall-clock guard


@pytest.fixture(autouse=True)
def _hang_guard():
  def _raise(signum, frame):
    raise TimeoutError(f"test exceeded {GUARD_S} s")
  previous = signal.signal(signal.SIGALRM, _raise)
  signal.alarm(GUARD_S)
  yield
  signal.alarm(0)
  signal.signal(signal.SIGALRM, previous)


class FakeServer:
  """A ThreadingHTTPServer whose replies follow a script; `default` once it runs out.

  Actions: ("ok", content), ("status", code), ("garbage",) (a non-JSON body),
  ("sleep", seconds, content) (reply after a delay).
  """

  def __init__(self, script, default=("status", 500)):
    self.script = list(script)
    self.default = default
    self.bodies = []
    self.headers = []
    self.lock = threading.Lock()
    fake = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):  # keep pytest output clean
        pass

      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with fake.lock:
          fake.bodies.append(body)
          fake.headers.append(dict(self.headers))
          action = fake.script.pop(0) if fake.script else fake.default
        if action[0] == "sleep":
          time.sleep(action[1])
          action = ("ok", action[2])
        try:
          if action[0] == "status":
            self.send_error(action[1])
            return
          payload = (b"<html>not json" if action[0] == "garbage" else json.dumps(
              {"choices": [{"message": {"role": "assistant", "content": action[1]}}]}).encode())
          self.send_response(200)
          self.send_header("Content-Type", "application/json")
          self.send_header("Content-Length", str(len(payload)))
          self.end_headers()
          self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
          pass  # the client gave up (timeout test)

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.httpd.daemon_threads = True
    self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                   daemon=True)
    self.thread.start()
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

  @property
  def num_requests(self):
    with self.lock:
      return len(self.bodies)

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()
    self.thread.join(timeout=2)


def label(value):
  return ("ok", f'Reasoning... {{"reference_answer": "5", "label": "{value}"}}')


class AddFamily:
  """Verifier: correct iff the last assistant message contains the answer."""

  name = "add"
  max_turns = 3

  def score(self, task, episode, truncated):
    last = next((m["content"] for m in reversed(episode) if m["role"] == "assistant"), "")
    if truncated:
      return Outcome(reward=-1.0, correct=False, answered=False)
    correct = str(task.answer) in last
    return Outcome(reward=1.0 if correct else -1.0, correct=correct, answered=True)


TASK = Task(task_id="add/0", family="add", split="eval",
            messages=({"role": "system", "content": "tools"},
                      {"role": "user", "content": "What is 2 + 3?"}),
            tool_names=("add",), answer=5,
            oracle=({"role": "assistant", "content": '<tool_call>{"name": "add"}</tool_call>'},))
GOOD = list(TASK.messages) + [{"role": "assistant", "content": "<think>easy</think>5"}]
BAD = list(TASK.messages) + [{"role": "assistant", "content": "<think>hm</think>7"}]


def make_judge(url, **kwargs):
  kwargs = {"model": "judge", "timeout_s": 0.2, "max_retries": 3, "backoff_s": 0.01,
            "backoff_max_s": 0.02, **kwargs}
  return LLMJudge(JudgeConfig(base_url=url, **kwargs), fallback=AddFamily())


def counts(judge):
  m = judge.metrics()
  return {k.split("/")[1]: v for k, v in m.items() if k != "judge/mean_latency_s"}


def test_two_500s_then_valid_comes_from_judge(server_factory):
  server = server_factory([("status", 500), ("status", 503), label("false")])
  judge = make_judge(server.url)
  verdict = judge.judge_outcome(TASK, GOOD, truncated=False)
  # The judge says "false" although the verifier would say "true": the verdict is the judge's.
  assert (verdict.label, verdict.reward, verdict.source, verdict.votes) == (
      "false", -1.0, "judge", ("false",))
  assert server.num_requests == 3
  assert counts(judge) == {"requests": 3, "retries": 2, "failures": 0, "fallback_verifier": 0,
                           "cache_hits": 0, "parse_errors": 0, "deadline_hits": 0}
  assert judge.metrics()["judge/mean_latency_s"] > 0
  body = server.bodies[-1]
  assert body["model"] == "judge" and body["temperature"] == 0.0
  assert body["messages"][0]["role"] == "system"
  assert "What is 2 + 3?" in body["messages"][1]["content"]


def test_all_failures_fall_back_to_verifier(server_factory):
  server = server_factory([], default=("status", 502))
  judge = make_judge(server.url, max_retries=2)
  verdict = judge.judge_outcome(TASK, GOOD, truncated=False)
  assert (verdict.label, verdict.reward, verdict.source, verdict.failed_votes) == (
      "true", 1.0, "verifier", 1)
  assert verdict.verifier_outcome.correct
  assert server.num_requests == 3
  assert counts(judge) == {"requests": 3, "retries": 2, "failures": 1, "fallback_verifier": 1,
                           "cache_hits": 0, "parse_errors": 0, "deadline_hits": 0}


def test_timeout_is_retried(server_factory):
  server = server_factory([("sleep", 1.0, label("true")[1]), label("true")])
  judge = make_judge(server.url, timeout_s=0.2)
  start = time.monotonic()
  verdict = judge.judge_outcome(TASK, BAD, truncated=False)
  assert time.monotonic() - start < 0.9  # the client did not wait for the slow reply
  assert (verdict.label, verdict.source) == ("true", "judge")
  assert counts(judge)["retries"] == 1 and counts(judge)["requests"] == 2


def test_garbage_is_a_parse_error_and_retried(server_factory):
  server = server_factory([("garbage",), ("ok", "I cannot decide."), label("unable_to_answer")])
  judge = make_judge(server.url)
  verdict = judge.judge_outcome(TASK, GOOD, truncated=False)
  assert (verdict.label, verdict.reward) == ("unable_to_answer", 0.0)
  c = counts(judge)
  assert (c["parse_errors"], c["retries"], c["requests"], c["failures"]) == (2, 2, 3, 0)


def test_400_is_not_retried(server_factory):
  server = server_factory([("status", 400), label("true")])
  judge = make_judge(server.url)
  verdict = judge.judge_outcome(TASK, BAD, truncated=False)
  assert (verdict.label, verdict.source) == ("false", "verifier")
  assert server.num_requests == 1
  c = counts(judge)
  assert (c["requests"], c["retries"], c["failures"], c["fallback_verifier"]) == (1, 0, 1, 1)


def test_429_is_retried(server_factory):
  server = server_factory([("status", 429), label("true")])
  judge = make_judge(server.url)
  assert judge.judge_outcome(TASK, BAD, truncated=False).label == "true"
  assert server.num_requests == 2


def test_connection_refused_falls_back_quickly():
  judge = make_judge("http://127.0.0.1:9/v1", max_retries=1)  # discard port: nothing listens
  verdict = judge.judge_outcome(TASK, GOOD, truncated=False)
  assert verdict.source == "verifier" and verdict.label == "true"
  assert counts(judge)["requests"] == 2


@pytest.mark.parametrize("script,expected", [
    (["true", "false", "true"], "true"),
    (["false", "false", "true"], "false"),
    (["true", "false", "unable_to_answer"], "unable_to_answer"),  # three-way tie
])
def test_majority_vote(server_factory, script, expected):
  server = server_factory([label(v) for v in script])
  judge = make_judge(server.url, votes=3, temperature=0.7)
  verdict = judge.judge_outcome(TASK, GOOD, truncated=False)
  assert verdict.label == expected and verdict.votes == tuple(script)
  assert server.num_requests == 3


def test_vote_that_fails_is_left_out(server_factory):
  server = server_factory([label("false"), ("status", 400), label("false")])
  verdict = make_judge(server.url, votes=3).judge_outcome(TASK, GOOD, truncated=False)
  assert verdict.label == "false" and verdict.votes == ("false", "false")
  assert verdict.failed_votes == 1 and verdict.source == "judge"


def test_tie_breaking():
  assert judge_lib.majority_label(["true", "false"]) == "false"
  assert judge_lib.majority_label(["true", "unable_to_answer"]) == "unable_to_answer"
  assert judge_lib.majority_label(["false", "unable_to_answer"]) == "unable_to_answer"
  assert judge_lib.majority_label(["true"]) == "true"


def test_cache_hit_on_repeat_and_from_file(server_factory, tmp_path):
  server = server_factory([label("true")])
  path = str(tmp_path / "cache.jsonl")
  judge = make_judge(server.url, cache_path=path)
  first = judge.judge_outcome(TASK, GOOD, truncated=False)
  second = judge.judge_outcome(TASK, GOOD, truncated=False)
  assert (first.source, second.source) == ("judge", "cache")
  assert first.label == second.label == "true"
  assert server.num_requests == 1 and counts(judge)["cache_hits"] == 1
  # A new judge reads the JSONL file; another episode is a different request.
  again = make_judge(server.url, cache_path=path)
  assert again.judge_outcome(TASK, GOOD, truncated=False).source == "cache"
  assert server.num_requests == 1
  server.script.append(label("false"))
  assert again.judge_outcome(TASK, BAD, truncated=False).source == "judge"
  assert server.num_requests == 2


def test_a_damaged_cache_and_lone_surrogates_do_not_stop_the_judge(server_factory, tmp_path):
  """A cache line torn inside a multibyte character and a garbage line are skipped (the
  judge starts and keeps the good entries); a lone surrogate in an episode or a reply
  (JSON's "\\ud800" from a model) neither fails the cache key nor the cache write."""
  server = server_factory([label("true"), label("true")])
  path = tmp_path / "cache.jsonl"
  judge = make_judge(server.url, cache_path=str(path))
  judge.judge_outcome(TASK, GOOD, truncated=False)
  good = path.read_bytes()
  path.write_bytes(good + b'{"key": "x", "content": "caf\xc3' + b"\n" + b"garbage\n")
  again = make_judge(server.url, cache_path=str(path))
  assert again.judge_outcome(TASK, GOOD, truncated=False).source == "cache"
  odd = [dict(m) for m in GOOD]
  odd[-1]["content"] = odd[-1]["content"] + "\ud800"
  assert again.judge_outcome(TASK, odd, truncated=False).source == "judge"
  again._store("k", "reply \udc00")
  assert path.read_bytes().endswith('"content": "reply \ufffd"}\n'.encode("utf-8"))


def test_cache_off_asks_again(server_factory):
  server = server_factory([label("true"), label("true")])
  judge = make_judge(server.url, cache=False)
  judge.judge_outcome(TASK, GOOD, truncated=False)
  judge.judge_outcome(TASK, GOOD, truncated=False)
  assert server.num_requests == 2 and counts(judge)["cache_hits"] == 0


def test_no_endpoint_uses_verifier():
  judge = LLMJudge(JudgeConfig(), fallback=AddFamily())
  good = judge.judge_outcome(TASK, GOOD, truncated=False)
  bad = judge.judge_outcome(TASK, BAD, truncated=False)
  assert (good.label, good.reward, good.source) == ("true", 1.0, "verifier")
  assert (bad.label, bad.reward) == ("false", -1.0)
  assert counts(judge)["fallback_verifier"] == 2 and counts(judge)["requests"] == 0
  assert good.to_outcome(truncated=False) == Outcome(
      reward=1.0, correct=True, answered=True, details=good.to_outcome(False).details)
  with pytest.raises(RuntimeError, match="fallback"):
    LLMJudge(JudgeConfig()).judge_outcome(TASK, GOOD, truncated=False)


def test_truncated_rule_asks_nobody(server_factory):
  server = server_factory([label("true")])
  verdict = make_judge(server.url).judge_outcome(TASK, GOOD, truncated=True)
  assert (verdict.label, verdict.reward, verdict.source) == ("false", -1.0, "rule")
  assert not verdict.to_outcome(truncated=True).answered
  assert server.num_requests == 0
  asked = make_judge(server.url, truncated_label="judge").judge_outcome(TASK, GOOD, truncated=True)
  assert asked.label == "true" and server.num_requests == 1
  assert "step limit" in server.bodies[0]["messages"][1]["content"]


def test_verifier_label_mapping():
  vl = judge_lib.verifier_label
  assert vl(Outcome(reward=1.0, correct=True, answered=True)) == "true"
  assert vl(Outcome(reward=0.0, correct=False, answered=False)) == "unable_to_answer"
  assert vl(Outcome(reward=-1.0, correct=False, answered=False)) == "false"  # truncated
  assert vl(Outcome(reward=0.0, correct=False, answered=True)) == "false"  # math: wrong
  assert vl(Outcome(reward=1.7, correct=True, answered=True)) == "true"  # AWPO scale


def test_reasoning_score_and_votes(server_factory):
  a = ('{"reasoning_path": "Tier I", "tool_selection": "Tier I", '
       '"parameter_setting": "Tier II", "execution_strategy": "Tier VI"}')
  b = ("Reasoning path: Tier III. Tool selection: Tier I. Parameter setting: Tier I. "
       "Execution strategy: Tier I.")
  server = server_factory([("ok", a), ("garbage",), ("ok", b)])
  judge = make_judge(server.url, votes=2)
  verdict = judge.judge_reasoning_verdict(TASK, GOOD, reference_cot="add 2 and 3")
  score_a = 0.35 + 0.30 + 0.25 * 0.8 + 0.0  # 0.85
  score_b = 0.35 * 0.6 + 0.30 + 0.25 + 0.10  # 0.86
  assert verdict.votes == pytest.approx((score_a, score_b))
  assert verdict.score == pytest.approx((score_a + score_b) / 2)
  assert verdict.dimensions["reasoning_path"] == pytest.approx(0.8)
  assert verdict.source == "judge"
  user = server.bodies[0]["messages"][1]["content"]
  assert "add 2 and 3" in user and "Ground-truth trajectory" in user
  assert judge.judge_reasoning(TASK, GOOD, reference_cot="add 2 and 3") == pytest.approx(
      verdict.score)  # from the cache
  assert server.num_requests == 3


def test_reasoning_without_endpoint_is_verifier_proxy():
  judge = LLMJudge(JudgeConfig(), fallback=AddFamily())
  assert judge.judge_reasoning(TASK, GOOD, None) == 1.0
  verdict = judge.judge_reasoning_verdict(TASK, BAD, None)
  assert (verdict.score, verdict.source) == (0.0, "verifier")
  assert counts(judge)["fallback_verifier"] == 2


def test_judge_many_runs_concurrently(server_factory):
  server = server_factory([("sleep", 0.3, label("true")[1])] * 6)
  judge = make_judge(server.url, timeout_s=2.0)
  items = [(dataclasses.replace(TASK, task_id=f"add/{i}", answer=i),
            GOOD + [{"role": "user", "content": str(i)}], False) for i in range(6)]
  start = time.monotonic()
  verdicts = judge.judge_many(items, max_workers=6)
  assert time.monotonic() - start < 1.2  # 6 x 0.3 s = 1.8 s sequentially
  assert [v.label for v in verdicts] == ["true"] * 6
  assert counts(judge)["requests"] == 6
  assert judge.judge_many([], max_workers=2) == []


def test_api_key_header(server_factory, monkeypatch):
  monkeypatch.setenv("JUDGE_TEST_KEY", "sekrit")
  server = server_factory([label("true")])
  make_judge(server.url, api_key_env="JUDGE_TEST_KEY").judge_outcome(TASK, GOOD, False)
  assert server.headers[0]["Authorization"] == "Bearer sekrit"


@pytest.mark.parametrize("kwargs,match", [
    ({"base_url": "127.0.0.1:8000", "model": "m"}, "http"),
    ({"base_url": "http://x/v1"}, "model"),
    ({"timeout_s": 0.0}, "timeout_s"),
    ({"max_retries": -1}, "max_retries"),
    ({"votes": 0}, "votes"),
    ({"backoff_s": 2.0, "backoff_max_s": 1.0}, "backoff_max_s"),
    ({"truncated_label": "maybe"}, "truncated_label"),
    ({"max_reply_bytes": 0}, "max_reply_bytes"),
])
def test_config_validation(kwargs, match):
  with pytest.raises(ValueError, match=match):
    JudgeConfig(**kwargs)


def test_parsers():
  p = judge_lib.parse_outcome_label
  assert p('x {"label": "true"} then {"label": "Unable to answer"}') == "unable_to_answer"
  assert p("<think>true? false?</think> Final label: FALSE") == "false"
  assert p("The assistant's answer is true.") == "true"
  for bad in ("lorem ipsum", "true or false, who knows", None):
    with pytest.raises(ValueError):
      p(bad)
  with pytest.raises(ValueError):
    judge_lib.parse_reasoning_tiers('{"reasoning_path": "Tier I"}')



def test_parsers_skip_objects_nested_too_deeply_or_with_huge_numbers():
  # json.loads raises RecursionError (not a ValueError) on "[[[...": it must not escape.
  deep = '{"a": ' + "[" * 100_000 + "1" + "]" * 100_000 + ', "label": "true"}'
  assert judge_lib.parse_outcome_label(deep) == "true"  # from the prose fallback
  huge = '{"n": ' + "9" * 5000 + '} {"label": "false"}'  # int over Python's 4300 digits
  assert judge_lib.parse_outcome_label(huge) == "false"
  with pytest.raises(ValueError):
    judge_lib.parse_reasoning_tiers('{"reasoning_path": ' + "[" * 100_000 + "}")


def test_a_cache_line_nested_too_deeply_is_skipped(server_factory, tmp_path):
  server = server_factory([label("true")])
  path = tmp_path / "cache.jsonl"
  judge = make_judge(server.url, cache_path=str(path))
  judge.judge_outcome(TASK, GOOD, truncated=False)
  with open(path, "a", encoding="utf-8") as f:
    f.write("[" * 100_000 + "\n" + '{"key": ' + "1" * 5000 + "}\n")
  again = make_judge(server.url, cache_path=str(path))
  assert again.judge_outcome(TASK, GOOD, truncated=False).source == "cache"
  assert server.num_requests == 1
