"""One judge call is bounded in wall time, whatever the server does: against a local fake
OpenAI-compatible server that sleeps past the timeout, answers HTTP 500, sends malformed
JSON, or trickles its reply (headers or body) a byte at a time, every request is retried,
the call falls back to the verifier and says so, and returns within its time bound.

The bound of a call is `JudgeConfig.call_budget_s()`: total_timeout_s, else the worst case
of requests that each take timeout_s. A per-read socket timeout alone would not bound a
trickle (each read returns a byte in time); the judge's per-request watchdog does.

A hostile server can also send a huge body (400 MB, announced by Content-Length, or without
one, or chunked): the judge reads at most `JudgeConfig.max_reply_bytes` of it, so memory
stays bounded, and fails the request like an unparseable reply. Parsing counts inside the
time limit: a body nested too deeply is a clean parse error, a body just under the cap
parses in bounded time, and a reply that is parsed only after the call's total is refused.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import tracemalloc

import pytest

from tree_rl.config_types import JudgeSpec
from tree_rl.envs.base import Outcome, Task
from tree_rl.rewards import judge as judge_lib
from tree_rl.rewards.judge import JudgeConfig, LLMJudge

TIMEOUT_S = 0.4
SLACK_S = 0.5  # thread start-up, the verifier, a loaded 2-core CI machine
HUGE_BYTES = 400 << 20  # what a hostile server offers (it stops when the client hangs up)
CHUNK = b" " * (1 << 20)  # made once, so the server's own writes allocate nothing
CAP_BYTES = 1 << 20  # the judges' max_reply_bytes in the size tests


def _padded_reply(size: int) -> bytes:
  """A valid chat completion labelling "false", padded to `size` bytes with a list of
  floats (among the slowest JSON to parse, byte for byte)."""
  head = json.dumps({"choices": [{"message": {"role": "assistant",
                                              "content": '{"label": "false"}'}}]})
  head = head[:-1] + ', "pad": ['
  n = (size - len(head) - 2) // 4
  body = (head + ",".join(["1e5"] * n) + "]}").encode()
  return body + b" " * (size - len(body))


class Server:
  """A ThreadingHTTPServer on 127.0.0.1 that answers every POST with one behaviour:
  "answer" (a chat completion labelling "false"), "sleep" (past the client's timeout),
  "500", "malformed" (a 200 with broken JSON), "trickle_body" (headers, then one body byte
  every 50 ms, for seconds),
  "trickle_headers" (the status line and headers a byte at a time), "huge_length" (a
  Content-Length of HUGE_BYTES, then that many bytes), "huge_close" (no Content-Length:
  bytes until the connection closes), "huge_chunked" (chunked transfer encoding), "deep"
  (a 200 whose body is ~1 MB of "[") or "near_cap" (a valid reply padded to CAP_BYTES)."""

  def __init__(self, mode: str):
    self.requests = 0
    self.lock = threading.Lock()
    server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):
        pass

      def handle(self):
        try:
          super().handle()
        except (ConnectionResetError, BrokenPipeError):
          pass  # the client hung up on a reply it refused (too big): not a server error

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
          elif mode in ("huge_length", "huge_close", "huge_chunked"):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if mode == "huge_length":
              self.send_header("Content-Length", str(HUGE_BYTES))
            elif mode == "huge_chunked":
              self.send_header("Transfer-Encoding", "chunked")
            else:
              self.close_connection = True  # the body ends when the connection does
            self.end_headers()
            for _ in range(HUGE_BYTES // len(CHUNK)):
              if mode == "huge_chunked":
                self.wfile.write(b"%x\r\n" % len(CHUNK) + CHUNK + b"\r\n")
              else:
                self.wfile.write(CHUNK)
          elif mode == "deep":
            self._send(200, b"[" * (CAP_BYTES - 1))
          elif mode == "near_cap":
            self._send(200, _padded_reply(CAP_BYTES))
          else:
            raise ValueError(f"unknown mode {mode!r}")
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
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


@pytest.mark.parametrize("mode", ["huge_length", "huge_close", "huge_chunked"])
def test_a_huge_body_is_not_read_and_fails_the_request(serve, mode):
  # 400 MB offered; the judge reads at most max_reply_bytes (+ one chunk of http.client's
  # buffering) of each reply, fails the request like an unparseable one and falls back.
  server = serve(mode)
  config = JudgeConfig(base_url=server.url, model="judge", timeout_s=5.0, max_retries=1,
                       backoff_s=0.05, backoff_max_s=0.1, cache=False,
                       max_reply_bytes=CAP_BYTES)
  judge = LLMJudge(config, fallback=Verifier())
  tracemalloc.start()
  try:
    verdict, seconds = _bounded(lambda: judge.judge_outcome(TASK, EPISODE, truncated=False),
                                5.0)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert (verdict.source, verdict.label, verdict.failed_votes) == ("verifier", "true", 1)
  m = judge.metrics()
  assert (m["judge/requests"], m["judge/failures"], m["judge/parse_errors"]) == (2, 1, 2)
  assert peak < 8 * CAP_BYTES, f"peak {peak / 2**20:.1f} MiB for a {CAP_BYTES >> 20} MiB cap"
  assert seconds < 3.0  # two requests of ~1 MB each, not 2 x 400 MB


def test_the_default_cap_and_a_reply_of_exactly_the_cap(serve):
  assert JudgeConfig().max_reply_bytes == judge_lib.MAX_REPLY_BYTES == 4 << 20
  with pytest.raises(ValueError, match="max_reply_bytes"):
    JudgeConfig(max_reply_bytes=0)
  server = serve("near_cap")  # CAP_BYTES of valid JSON: the cap itself is allowed
  for cap, source in ((CAP_BYTES, "judge"), (CAP_BYTES - 1, "verifier")):
    config = JudgeConfig(base_url=server.url, model="judge", timeout_s=5.0, max_retries=0,
                         cache=False, max_reply_bytes=cap)
    verdict = LLMJudge(config, fallback=Verifier()).judge_outcome(TASK, EPISODE, False)
    assert verdict.source == source, cap


def test_json_nested_too_deeply_is_a_parse_error(serve):
  server = serve("deep")
  config = JudgeConfig(base_url=server.url, model="judge", timeout_s=2.0, max_retries=1,
                       backoff_s=0.05, backoff_max_s=0.1, cache=False,
                       max_reply_bytes=CAP_BYTES)
  judge = LLMJudge(config, fallback=Verifier())
  verdict, seconds = _bounded(lambda: judge.judge_outcome(TASK, EPISODE, truncated=False), 4.0)
  assert (verdict.source, verdict.failed_votes) == ("verifier", 1)
  assert judge.metrics()["judge/parse_errors"] == 2 and seconds < 2.0


def test_a_reply_just_under_the_cap_parses_in_bounded_time(serve):
  # The slowest JSON we know (a list of floats) at the cap's size: the cap bounds the parse.
  server = serve("near_cap")
  config = JudgeConfig(base_url=server.url, model="judge", timeout_s=5.0, max_retries=0,
                       cache=False, max_reply_bytes=CAP_BYTES)
  judge = LLMJudge(config, fallback=Verifier())
  verdict, seconds = _bounded(lambda: judge.judge_outcome(TASK, EPISODE, truncated=False), 5.0)
  assert (verdict.source, verdict.label) == ("judge", "false")
  assert seconds < 1.5


def test_parsing_counts_inside_the_total(serve, monkeypatch):
  # The reply arrives at once, but its parse takes 0.6 s of a 0.5 s total: the judge does
  # not use a reply it had only after its deadline, starts no other request and falls back.
  server = serve("answer")
  original = judge_lib.parse_outcome_label

  def slow_parse(text):
    time.sleep(0.6)
    return original(text)

  monkeypatch.setattr(judge_lib, "parse_outcome_label", slow_parse)
  config = JudgeConfig(base_url=server.url, model="judge", timeout_s=2.0, max_retries=3,
                       backoff_s=0.05, backoff_max_s=0.1, total_timeout_s=0.5, cache=False)
  judge = LLMJudge(config, fallback=Verifier())
  verdict, seconds = _bounded(lambda: judge.judge_outcome(TASK, EPISODE, truncated=False), 1.1)
  assert (verdict.source, verdict.failed_votes) == ("verifier", 1)
  assert server.requests == 1 and seconds < 0.6 + 0.5 + SLACK_S
  m = judge.metrics()
  assert m["judge/deadline_hits"] == 1 and m["judge/failures"] == 1
