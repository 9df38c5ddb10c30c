"""One judge call is bounded in wall time, whatever the server does: against a local fake
OpenAI-compatible server that sleeps past the timeout, answers HTTP 500, sends malformed
JSON, or trickles its reply (headers or body) a byte at a time, every request is retried,
the call falls back to the verifier and says so, and returns within its time bound.

The bound of a call is `JudgeConfig.call_budget_s()`: total_timeout_s, else the worst case
of requests that each take timeout_s. A per-read socket timeout alone would not bound a
trickle (each read returns a byte in time); the judge's per-request watchdog does.
"""

from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from tree_rl.config_types import JudgeSpec
from tree_rl.envs.base import Outcome, Task
from tree_rl.rewards.judge import JudgeConfig, LLMJudge

TIMEOUT_S = 0.4
SLACK_S = 0.5  # thread start-up, the verifier, a loaded 2-core CI machine


class Server:
  """A ThreadingHTTPServer on 127.0.0.1 that answers every POST with one behaviour:
  "answer" (a chat completion labelling "false"), "sleep" (past the client's timeout),
  "500", "malformed" (a 200 with broken JSON), "trickle_body" (headers, then one body byte
  every 50 ms, for seconds) or
  "trickle_headers" (the status line and headers a byte at a time)."""

  def __init__(self, mode: str):
    self.requests = 0
    self.lock = threading.Lock()
    server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):
        pass

      def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        with server.lock:
          server.requests += 1
        reply = json.dumps({"choices": [{"message": {
            "role": "assistant", "content": '{"label": "false"}'}}]}).encode()
        try:
          if mode == "answer":
            self._send(200, reply)
          elif mode == "sleep":
            time.sleep(5 * TIMEOUT_S)
            self._send(200, reply)
          elif mode == "500":
            self._send(500, b'{"error": "boom"}')
          elif mode == "malformed":
            self._send(200, b'{"choices": [{"message": ')
          elif mode == "trickle_body":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply) + 200))
            self.end_headers()
            self.wfile.flush()
            for byte in (reply + b" " * 200):
              self.wfile.write(bytes([byte]))
              self.wfile.flush()
              time.sleep(0.05)
          elif mode == "trickle_headers":
            head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + b"X-Padding: " + b"x" * 200 + b"\r\n")
            for byte in head:
              self.wfile.write(bytes([byte]))
              self.wfile.flush()
              time.sleep(0.05)
          else:
            raise ValueError(f"unknown mode {mode!r}")
        except (BrokenPipeError, ConnectionResetError):
          pass  # the client gave up, as it should

      def _send(self, code, payload):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.httpd.daemon_threads = True
    self.thread = threading.Thread(target=self.httpd.serve_forever,
                                   kwargs={"poll_interval": 0.05}, daemon=True)
    self.thread.start()
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.fixture
def serve():
  servers = []

  def make(mode):
    servers.append(Server(mode))
    return servers[-1]
  yield make
  for s in servers:
    s.close()


class Verifier:
  """The task family's verifier: the answer 5 is correct."""

  def score(self, task, episode, truncated):
    del task, truncated
    correct = "5" in episode[-1]["content"]
    return Outcome(reward=1.0 if correct else -1.0, correct=correct, answered=True)


TASK = Task(task_id="add/0", family="add", split="eval",
            messages=({"role": "user", "content": "What is 2 + 3?"},), tool_names=("add",),
            answer=5, oracle=({"role": "assistant", "content": "5"},))
EPISODE = list(TASK.messages) + [{"role": "assistant", "content": "5"}]


def _bounded(fn, bound_s):
  """fn() run in a thread; (its result, seconds), failing if it outlives bound_s."""
  box = {}
  thread = threading.Thread(target=lambda: box.update(out=fn()), daemon=True)
  start = time.monotonic()
  thread.start()
  thread.join(bound_s + SLACK_S)
  seconds = time.monotonic() - start
  assert not thread.is_alive(), f"the judge call hung past its bound {bound_s:.2f}s"
  return box["out"], seconds


@pytest.mark.parametrize("mode", ["sleep", "500", "malformed", "trickle_body",
                                  "trickle_headers"])
def test_each_failure_is_retried_then_falls_back_within_the_bound(serve, mode):
  server = serve(mode)
  config = JudgeConfig(base_url=server.url, model="judge", timeout_s=TIMEOUT_S, max_retries=2,
                       backoff_s=0.05, backoff_max_s=0.1, cache=False)
  judge = LLMJudge(config, fallback=Verifier())
  bound = config.call_budget_s()
  assert bound == pytest.approx(3 * TIMEOUT_S + 0.05 + 0.1)  # derived: 3 requests + backoffs
  verdict, seconds = _bounded(lambda: judge.judge_outcome(TASK, EPISODE, truncated=False),
                              bound)
  # Retried (1 + max_retries requests), then the verifier's verdict, flagged as such.
  assert server.requests == 3
  assert (verdict.source, verdict.label, verdict.failed_votes) == ("verifier", "true", 1)
  m = judge.metrics()
  assert (m["judge/requests"], m["judge/retries"], m["judge/failures"],
          m["judge/fallback_verifier"]) == (3, 2, 1, 1)
  assert m["judge/parse_errors"] == (3 if mode == "malformed" else 0)
  assert seconds <= bound + SLACK_S
  if mode in ("sleep", "trickle_body", "trickle_headers"):  # each request cut at timeout_s
    assert seconds >= 3 * TIMEOUT_S - 0.05
    assert m["judge/mean_latency_s"] < TIMEOUT_S + 0.2


def test_the_total_bounds_votes_and_retries_together(serve):
  # Left to their own limits, 3 votes x 4 trickled requests would take ~5 s; the call's
  # total (1 s) stops it, the missing votes count as failed and the verifier answers.
  server = serve("trickle_body")
  config = JudgeConfig(base_url=server.url, model="judge", timeout_s=TIMEOUT_S, max_retries=3,
                       backoff_s=0.05, backoff_max_s=0.1, votes=3, total_timeout_s=1.0,
                       cache=False)
  judge = LLMJudge(config, fallback=Verifier())
  assert config.call_budget_s() == 1.0
  verdict, seconds = _bounded(lambda: judge.judge_outcome(TASK, EPISODE, truncated=False), 1.0)
  assert 0.9 <= seconds <= 1.0 + SLACK_S
  assert (verdict.source, verdict.failed_votes) == ("verifier", 3)
  assert 2 <= server.requests <= 3  # 0.4 s + backoff + 0.4 s + backoff + the 0.1 s left
  m = judge.metrics()
  assert m["judge/deadline_hits"] == 1 and m["judge/fallback_verifier"] == 1
  # The reasoning score is bounded the same way.
  reasoning, seconds = _bounded(lambda: judge.judge_reasoning_verdict(TASK, EPISODE), 1.0)
  assert reasoning.source == "verifier" and seconds <= 1.0 + SLACK_S
  assert judge.metrics()["judge/deadline_hits"] == 2


def test_a_good_server_is_not_cut_by_the_total(serve):
  server = serve("answer")
  config = JudgeConfig(base_url=server.url, model="judge", timeout_s=TIMEOUT_S, votes=3,
                       total_timeout_s=5.0)
  judge = LLMJudge(config, fallback=Verifier())
  verdict = judge.judge_outcome(TASK, EPISODE, truncated=False)
  assert (verdict.source, verdict.label, verdict.votes) == ("judge", "false", ("false",) * 3)
  assert server.requests == 3 and judge.metrics()["judge/deadline_hits"] == 0


def test_the_total_is_configured_and_checked():
  with pytest.raises(ValueError, match="total_timeout_s"):
    JudgeConfig(total_timeout_s=0.0)
  spec = JudgeSpec(kind="llm", base_url="http://127.0.0.1:1/v1", model="m", timeout_s=2.0,
                   max_retries=1, total_timeout_s=3.5)
  assert spec.judge_config().call_budget_s() == 3.5
  derived = JudgeSpec(kind="llm", base_url="http://127.0.0.1:1/v1", model="m", timeout_s=2.0,
                      max_retries=1, votes=2)
  # 2 votes x (2 requests x 2 s + one 1 s backoff), the JudgeConfig default backoff.
  assert derived.judge_config().call_budget_s() == pytest.approx(10.0)
  with pytest.raises(ValueError, match="total_timeout_s"):
    JudgeSpec(total_timeout_s=-1.0)
