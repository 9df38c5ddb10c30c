"""Fixtures shared by the reward tests."""

import pytest

from tests.rewards.judge_test import FakeServer


@pytest.fixture
def server_factory():
  """make(script, default) -> a FakeServer judge endpoint, closed after the test."""
  servers = []

  def make(script, default=("status", 500)):
    servers.append(FakeServer(script, default))
    return servers[-1]
  yield make
  for s in servers:
    s.close()
