"""Escape attempts against the Python sandbox: each is contained within its limits, and the
process that called `run_python` is unharmed.

The first sections run under `tests.isolation.ISOLATION` (bubblewrap wherever it runs,
always in CI) and check the limits and the audit hook's rules. The last section,
"Kernel boundary", takes the six ways past the audit hook that a hostile probe found
(its own state reached from a traceback, an import guard that matches exact names,
`_imp.create_builtin`, file rules that check a path the kernel then resolves again,
`mknod`, `ioctl` inode flags) and shows each one escaping the hook alone ("audit", as a
control, where that is safe to do) and contained by bubblewrap: no read or write outside
the folder, no signal to the caller, no network, no process left after the wall clock.
Attempts on the calling process run under a throwaway parent (a `python -c` that calls
`run_python`), so a successful kill would fail the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.isolation import ISOLATION, needs_bwrap
from tree_rl.envs.sandbox import SandboxLimits, SandboxResult
from tree_rl.envs.sandbox import run_python as _run_python

# Every test launches a sandboxed Python child (most under bubblewrap) and many wait out a
# CPU or wall-clock limit: the `e2e` tier, which CI runs.
pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
               isolation: str = ISOLATION) -> SandboxResult:
  return _run_python(code, limits, isolation)


def _assert_host_fine() -> None:
  """A normal run still works after the attempt."""
  result = run_python("print(6 * 7)")
  assert result.ok and result.stdout == "42\n", result


def _timed(code: str, limits: SandboxLimits = SandboxLimits()):
  start = time.monotonic()
  result = run_python(code, limits)
  return result, time.monotonic() - start


def _processes_under(base: str) -> list[int]:
  """Pids of live processes whose command line names a path under `base`."""
  pids = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        if base.encode() in f.read():
          pids.append(int(pid))
    except OSError:
      pass
  return pids


def _under_throwaway_parent(code: str, isolation: str = ISOLATION) -> tuple[int, str, dict]:
  """Runs `code` in the sandbox from a fresh `python -c` parent; `PARENT_PID` in the code
  becomes that parent's pid (inside bubblewrap's PID namespace `os.getppid()` is not it).

  Returns (the parent's exit status, its stdout, the sandbox result as a dict).
  """
  script = ("import dataclasses, json, os, sys\n"
            "from tree_rl.envs.sandbox import SandboxLimits, run_python\n"
            f"code = {code!r}.replace('PARENT_PID', str(os.getpid()))\n"
            f"r = run_python(code, SandboxLimits(), {isolation!r})\n"
            "print(json.dumps(dataclasses.asdict(r)))\n"
            "print('PARENT ALIVE')\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                        text=True, timeout=60)
  lines = proc.stdout.splitlines()
  result = json.loads(lines[0]) if lines and lines[0].startswith("{") else {}
  return proc.returncode, proc.stdout, result


# ------------------------------------------------------------------------------------------
# Processes
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [
    "import os\nwhile True:\n  os.fork()",
    "import subprocess\nwhile True:\n  subprocess.Popen(['sleep', '60'])",
    "import os\nos.posix_spawn('/bin/sleep', ['sleep', '60'], {})",
    "import pty\npty.fork()",
    "import multiprocessing\nmultiprocessing.Process(target=print).start()",
    "import os\nos.execv('/bin/sh', ['sh', '-c', 'sleep 60'])",
])
def test_fork_bomb_and_process_creation_are_denied_and_leave_no_process(code):
  # The run prints its directory first, so leftover processes can be looked for after.
  result, seconds = _timed("import os\nprint(os.getcwd(), flush=True)\n" + code)
  # Under bubblewrap pty.fork fails earlier: the sandbox has no /dev/ptmx.
  assert not result.ok and ("creating processes is disabled in the sandbox" in result.error
                            or "out of pty devices" in result.error), result
  assert seconds < 5
  base = os.path.dirname(result.stdout.split()[0])
  assert not os.path.exists(base)
  assert _processes_under(base) == []
  _assert_host_fine()


def test_threads_are_bounded_by_the_memory_limit():
  # As root RLIMIT_NPROC does not hold; each thread's stack counts against RLIMIT_AS.
  code = ("import threading, time\n"
          "ts = [threading.Thread(target=time.sleep, args=(3,)) for _ in range(100_000)]\n"
          "for t in ts:\n  t.start()\n")
  result, seconds = _timed(code, SandboxLimits(memory_mb=256, wall_s=10))
  assert not result.ok and "can't start new thread" in result.error, result
  assert seconds < 12
  _assert_host_fine()


# ------------------------------------------------------------------------------------------
# Memory, CPU, disk, output
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [
    "blocks = []\nwhile True:\n  blocks.append(bytearray(10**7))",
    "x = b' ' * (4 * 2**30)",
    "import mmap\nm = mmap.mmap(-1, 4 * 2**30)",
    "x = [0] * (10**9)",
])
def test_memory_bomb_fails_with_memory_error(code):
  result, seconds = _timed(code, SandboxLimits(memory_mb=256))
  assert not result.ok, result
  assert ("memory limit of 256 MB exceeded" in result.error
          or "Cannot allocate memory" in result.error), result
  assert seconds < 10
  _assert_host_fine()


@pytest.mark.parametrize("code,limit", [
    ("while True:\n  pass", "CPU-time limit of 1 s exceeded"),
    # Ignoring SIGXCPU only buys the one second to the hard limit's SIGKILL.
    ("import signal\nsignal.signal(signal.SIGXCPU, lambda *a: None)\nwhile True:\n  pass",
     "CPU-time limit of 1 s exceeded"),
    ("import time\nwhile True:\n  time.sleep(1)", "wall-clock limit of 3 s exceeded"),
    ("while True:\n  try:\n    while True:\n      pass\n  except BaseException:\n    pass",
     "CPU-time limit of 1 s exceeded"),
])
def test_infinite_loops_end_at_the_cpu_or_wall_limit(code, limit):
  # The wall limit leaves room for 2 CPU seconds (the hard limit) on a loaded machine.
  wall = 3 if "wall" in limit else 8
  result, seconds = _timed(code, SandboxLimits(cpu_s=1, wall_s=wall))
  assert not result.ok and limit in result.error, result
  assert seconds < wall + 2
  _assert_host_fine()


def test_disk_fill_is_stopped_at_the_disk_budget_and_cleaned_up():
  code = ("import os\nprint(os.getcwd(), flush=True)\n"
          "for i in range(10_000):\n"
          "  with open(f'f{i}', 'wb') as f:\n"
          "    f.write(os.urandom(2**20))\n"
          "  print(i + 1, flush=True)\n")
  result, seconds = _timed(code, SandboxLimits(max_disk_mb=16, max_files=10_000, wall_s=20))
  assert not result.ok, result
  assert result.error == ("disk limit of 16 MB or 10000 files exceeded in the private "
                          "directory"), result
  lines = result.stdout.split()
  written_mb = int(lines[-1]) if len(lines) > 1 else 0
  # Killed within one poll (<= 50 ms) of passing 16 MB: far below the 10 GB it asked for.
  assert 16 <= written_mb <= 16 + 200, written_mb
  assert seconds < 10
  assert not os.path.exists(os.path.dirname(lines[0]))
  _assert_host_fine()


def test_many_small_files_are_stopped_at_the_file_budget():
  code = ("import os\nos.makedirs('d', exist_ok=True)\n"
          "for i in range(1_000_000):\n  open(f'd/{i}', 'w').close()\n")
  result, seconds = _timed(code, SandboxLimits(max_files=200, wall_s=20))
  assert not result.ok and "200 files exceeded" in result.error, result
  assert seconds < 5
  # Within the budget, files are fine.
  assert run_python("for i in range(50):\n  open(f'{i}', 'w').write('x' * 1000)\n",
                    SandboxLimits(max_files=200)).ok


@pytest.mark.parametrize("code,stream", [
    ("while True:\n  print('x' * 10_000)", "stdout"),
    ("import sys\nsys.stdout.write('y' * 10**8)", "stdout"),
    ("import os\nwhile True:\n  os.write(1, b'z' * 65536)", "stdout"),
    ("import sys\nwhile True:\n  print('e' * 10_000, file=sys.stderr)", "stderr"),
])
def test_huge_output_is_cut_at_the_file_size_limit_and_truncated(code, stream):
  limits = SandboxLimits(max_file_mb=2, max_output_chars=1000)
  result, seconds = _timed(code, limits)
  assert not result.ok and "file-size limit of 2 MB exceeded (the output" in result.error, result
  text = getattr(result, stream)
  assert len(text) < 1000 + 200 and "[output truncated: " in text
  assert seconds < 10
  _assert_host_fine()


# ------------------------------------------------------------------------------------------
# Network
# ------------------------------------------------------------------------------------------


@pytest.fixture
def listener():
  """A TCP server on 127.0.0.1 in this process; yields its port and checks it got no
  connection."""
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(8)
  server.settimeout(0.3)
  yield server.getsockname()[1]
  with pytest.raises(TimeoutError):
    conn, _ = server.accept()
    conn.close()
  server.close()


@pytest.mark.parametrize("template", [
    "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
    "import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))",
    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)",
    "import asyncio\nasyncio.run(asyncio.open_connection('127.0.0.1', {port}))",
    "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
    "('127.0.0.1', {port}))",
    "import socket\nsocket.socket(socket.AF_UNIX).connect('/run/any.sock')",
])
def test_socket_connect_is_denied_by_the_hook(listener, template):
  result, _ = _timed(template.format(port=listener))
  assert not result.ok and "network access is disabled in the sandbox" in result.error, result
  _assert_host_fine()


# ------------------------------------------------------------------------------------------
# Files outside the private directory
# ------------------------------------------------------------------------------------------


@pytest.fixture
def secret(tmp_path):
  path = tmp_path / "secret.txt"
  path.write_text("the secret\n")
  os.chmod(path, 0o644)  # world-readable: only the hook stands in the way
  return str(path)


@pytest.mark.parametrize("template", [
    "print(open({p!r}).read())",
    "import os\nprint(os.read(os.open({p!r}, os.O_RDONLY), 100))",
    "import io\nprint(io.open_code({p!r}).read())",
    "import pathlib\nprint(pathlib.Path({p!r}).read_text())",
    # linecache swallows the PermissionError: it reads nothing.
    "import linecache\nassert linecache.getline({p!r}, 1), 'linecache read nothing'",
    "import os\nos.symlink({p!r}, 'link')\nprint(open('link').read())",
    "import os\nos.link({p!r}, 'hard')\nprint(open('hard').read())",
    "print(open('/proc/' + str(__import__('os').getppid()) + '/environ').read())",
    "print(open('../config.json').read())",
])
def test_reading_outside_the_directory_is_denied(secret, template):
  result, _ = _timed(template.format(p=secret))
  assert not result.ok, result
  assert any(why in result.error for why in ("outside the sandbox", "read nothing")), result
  assert "the secret" not in result.stdout + result.stderr
  _assert_host_fine()


def test_what_the_audit_hook_alone_does_not_hide(secret):
  # Not contained by the hook (it is no boundary): metadata of any path.
  result = run_python(f"import os\nprint(os.stat({secret!r}).st_size, "
                      "os.path.exists('/etc/passwd'))", isolation="audit")
  assert result.ok and result.stdout == "11 True\n", result


@needs_bwrap
def test_bubblewrap_shows_no_host_file_but_the_python_installation(secret):
  result = run_python(f"import os\nprint(os.path.exists({secret!r}), "
                      f"os.path.exists('/etc/passwd'), os.path.exists({REPO + '/setup.py'!r}), os.getuid())",
                      isolation="bwrap")
  assert result.ok and result.stdout == "False False False 65534\n", result
  # The files of the Python installation, which imports need, stay readable.
  result = run_python("import os\nprint(len(open(os.__file__).read()) > 1000)")
  assert result.ok and result.stdout == "True\n", result


@pytest.mark.parametrize("template", [
    "open({p!r}, 'w').write('x')",
    "import os\nos.close(os.open({p!r}, os.O_WRONLY | os.O_CREAT))",
    "import pathlib\npathlib.Path({p!r}).write_text('x')",
    "open('inside', 'w').write('x')\nimport os\nos.rename('inside', {p!r})",
    "open('inside', 'w').write('x')\nimport shutil\nshutil.copy('inside', {p!r})",
    "import os\nos.symlink({p!r}, 'link')\nopen('link', 'w').write('x')",
    "import os\nos.mkdir({p!r})",
])
def test_writing_outside_the_directory_is_denied(tmp_path, template):
  target = str(tmp_path / "escaped")
  result, _ = _timed(template.format(p=target))
  assert not result.ok and "outside the sandbox" in result.error, result
  assert not os.path.lexists(target)
  assert os.listdir(tmp_path) == []
  _assert_host_fine()


# ------------------------------------------------------------------------------------------
# The calling process
# ------------------------------------------------------------------------------------------


def test_the_throwaway_parent_would_show_a_kill():
  """Control: a child that may signal kills the throwaway parent, so the checks below
  would see an escape."""
  script = ("import os, subprocess, sys\n"
            "subprocess.run([sys.executable, '-c', "
            "'import os, signal; os.kill(os.getppid(), signal.SIGKILL)'])\n"
            "print('PARENT ALIVE')\n")
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == -9 and "PARENT ALIVE" not in proc.stdout


@pytest.mark.parametrize("code,expected", [
    ("import os, signal\nos.kill(PARENT_PID, signal.SIGTERM)", "signalling other processes"),
    ("import os, signal\nos.kill(PARENT_PID, signal.SIGKILL)", "signalling other processes"),
    ("import os, signal\nos.kill(0, signal.SIGKILL)", "signalling other processes"),
    ("import os, signal\nos.kill(-1, signal.SIGKILL)", "signalling other processes"),
    ("import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)",
     "creating processes is disabled"),  # the hook denies killpg with the spawn events
    ("import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(PARENT_PID), "
     "signal.SIGKILL)", "acting on other processes"),
    ("import sys\ndel sys.modules['_signal']\nimport _signal", "importing _signal again"),
    ("import os\nos.setpriority(os.PRIO_PROCESS, PARENT_PID, 19)", "acting on other processes"),
    ("import os\nos.sched_setaffinity(PARENT_PID, {0})", "acting on other processes"),
])
def test_signalling_the_parent_is_denied_and_the_parent_lives(code, expected):
  returncode, stdout, result = _under_throwaway_parent(code)
  assert returncode == 0 and "PARENT ALIVE" in stdout, (returncode, stdout)
  assert result and not result["ok"] and expected in result["error"], result


def test_killing_itself_is_contained():
  result = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
  assert not result.ok and result.returncode == -9
  _assert_host_fine()


# ------------------------------------------------------------------------------------------
# Kernel boundary: the six ways past the audit hook, against "audit" and "bwrap"
# ------------------------------------------------------------------------------------------

# Cause 1: the hook's own state. The error the hook raises carries its frame on the
# traceback; the frame's free variables are its rule functions, whose code can be swapped
# for code that allows every path.
DISARM = '''
def _disarm():
  try:
    open("/nonexistent-sandbox-probe/x", "w")
  except PermissionError as e:
    tb = e.__traceback__
    while tb.tb_next is not None:
      tb = tb.tb_next
    rules = tb.tb_frame.f_locals
    def allow(a, b, c):
      def is_dir(path):
        return a and b and c and False
      return is_dir
    rules["under"].__code__ = (lambda path, roots: True).__code__
    rules["is_dir"].__code__ = allow(1, 2, 3).__code__
_disarm()
'''

# Cause 2: the import guard matches exact names. "x._posixsubprocess" loads a fresh copy of
# the extension, whose fork_exec raises none of the audit events subprocess.Popen does.
SPAWN = '''
def _spawn(argv, new_session=True):
  import importlib.util, os
  origin = importlib.util.find_spec("_posixsubprocess").origin
  fresh = importlib.util.module_from_spec(
      importlib.util.spec_from_file_location("x._posixsubprocess", origin))
  r, w = os.pipe()
  pid = fresh.fork_exec(argv, [argv[0].encode()], True, (w,), None, None, -1, -1, -1, -1,
                        -1, -1, r, w, True, new_session, -1, None, None, None, -1, None, False)
  os.close(w)
  return pid
'''

# Cause 3: `_imp.create_builtin` hands out fresh `posix` and `_signal` modules, without the
# stubs the bootstrap put in place of pidfd_open and pidfd_send_signal.
FRESH_BUILTINS = '''
import _imp, importlib.machinery
posix = _imp.create_builtin(importlib.machinery.ModuleSpec("posix", None))
_signal = _imp.create_builtin(importlib.machinery.ModuleSpec("_signal", None))
'''


@pytest.fixture
def host_listener():
  """A TCP server on the host's 127.0.0.1; yields (port, a function giving how many
  connections it accepted so far)."""
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(8)
  server.settimeout(0.2)

  def accepted() -> int:
    count = 0
    while True:
      try:
        conn, _ = server.accept()
      except TimeoutError:
        return count
      conn.close()
      count += 1

  yield server.getsockname()[1], accepted
  server.close()


def _escapes_files(secret: str, target: str) -> str:
  """Code that reads `secret`, writes `target` and a `.pth` file into the Python
  installation, and reads the caller's environment, printing what it got."""
  site = os.path.join(sys.prefix, "lib")
  return (f"import os, sys\n"
            f"for what, act in (('read', lambda: open({secret!r}).read()),\n"
            f"                  ('write', lambda: open({target!r}, 'w').write('x')),\n"
            f"                  ('environ', lambda: open('/proc/{os.getpid()}/environ').read()),\n"
            f"                  ('pth', lambda: open({site!r} + '/zz_escape.pth', 'w')),\n"
            f"                  ('passwd', lambda: open('/etc/passwd').read())):\n"
            f"  try:\n"
            f"    print(what, 'GOT', repr(act())[:200])\n"
            f"  except OSError as e:\n"
            f"    print(what, 'DENIED', type(e).__name__)\n")


def test_a_disarmed_hook_reads_and_writes_outside_under_the_hook_alone(secret, tmp_path):
  """Control: the attack is real. (Under "audit" it would also write the `.pth` file into
  the installation, so that one is pointed at a path that does not exist here.)"""
  target = str(tmp_path / "escaped")
  code = DISARM + _escapes_files(secret, target).replace(os.path.join(sys.prefix, "lib"),
                                                         str(tmp_path / "no" / "such"))
  result = run_python(code, isolation="audit")
  assert "read GOT 'the secret\\n'" in result.stdout, result
  assert os.path.exists(target)
  assert "environ GOT '" in result.stdout  # the caller's environment, through /proc


@needs_bwrap
def test_a_disarmed_hook_reaches_nothing_under_bubblewrap(secret, tmp_path):
  target = str(tmp_path / "escaped")
  pth = os.path.join(sys.prefix, "lib", "zz_escape.pth")
  result = run_python(DISARM + _escapes_files(secret, target), isolation="bwrap")
  assert result.ok, result
  for what in ("read", "write", "environ", "pth", "passwd"):
    assert f"{what} DENIED" in result.stdout, result.stdout
  assert "the secret" not in result.stdout and "PATH=" not in result.stdout
  assert not os.path.lexists(target) and not os.path.lexists(pth)
  _assert_host_fine()


@needs_bwrap
def test_a_symlink_swapped_after_the_check_reaches_nothing_under_bubblewrap(secret, tmp_path):
  # Cause 4: the file rules check a path, then the kernel resolves it again (and they
  # ignore dir_fd). Two threads race a link between a harmless file and the secret.
  target = str(tmp_path / "escaped")
  code = (f"import os, threading, time\n"
          f"open('harmless', 'w').write('ok')\n"
          f"stop = time.monotonic() + 1.5\n"
          f"def swap():\n"
          f"  while time.monotonic() < stop:\n"
          f"    for dest in ('harmless', {secret!r}, {target!r}):\n"
          f"      try:\n"
          f"        os.remove('l')\n"
          f"      except OSError:\n"
          f"        pass\n"
          f"      try:\n"
          f"        os.symlink(dest, 'l')\n"
          f"      except OSError:\n"
          f"        pass\n"
          f"threading.Thread(target=swap).start()\n"
          f"got = set()\n"
          f"while time.monotonic() < stop:\n"
          f"  for mode in ('r', 'a'):\n"
          f"    try:\n"
          f"      with open('l', mode) as f:\n"
          f"        got.add(f.read() if mode == 'r' else f.write('x'))\n"
          f"    except (OSError, ValueError):\n"
          f"      pass\n"
          f"dir_fd = os.open('.', os.O_RDONLY)\n"
          f"for rel in ('../../../../../../..' + {secret!r},):\n"
          f"  try:\n"
          f"    got.add(os.read(os.open(rel, os.O_RDONLY, dir_fd=dir_fd), 100))\n"
          f"  except OSError:\n"
          f"    pass\n"
          f"print(sorted(map(repr, got)))\n")
  result = run_python(code, SandboxLimits(wall_s=10), isolation="bwrap")
  assert result.ok, result
  assert "secret" not in result.stdout, result.stdout
  assert not os.path.lexists(target)


def test_a_fresh_posixsubprocess_spawns_a_process_that_outlives_the_hook_alone(
    host_listener):
  """Control: under the hook alone, a process started through the unguarded import runs
  as the caller's user, reaches the host's loopback, and outlives the wall clock."""
  port, accepted = host_listener
  marker = "7.31415"
  code = SPAWN + (
      f"import os\n"
      f"os.waitpid(_spawn(['{sys.executable}', '-c', 'import socket; "
      f"socket.create_connection((\"127.0.0.1\", {port}), timeout=2)']), 0)\n"
      f"_spawn(['/bin/sleep', '{marker}'])\n"
      f"import time\ntime.sleep(30)\n")
  result = run_python(code, SandboxLimits(wall_s=2), isolation="audit")
  assert "wall-clock limit" in result.error, result
  survivors = _processes_under(marker)
  for pid in survivors:
    os.kill(pid, 9)
  assert survivors and accepted() == 1


@needs_bwrap
def test_a_fresh_posixsubprocess_reaches_no_network_and_leaves_no_process_under_bubblewrap(
    host_listener):
  port, accepted = host_listener
  marker = "7.27182"
  code = SPAWN + (
      f"import os\n"
      f"pid = _spawn(['/bin/sh', '-c', 'id -u > uid.txt'])\n"
      f"os.waitpid(pid, 0)\n"
      f"print('uid', open('uid.txt').read().strip(), flush=True)\n"
      f"pid = _spawn(['{sys.executable}', '-c', 'import socket; "
      f"socket.create_connection((\"127.0.0.1\", {port}), timeout=2)'])\n"
      f"print('net exit', os.waitpid(pid, 0)[1], flush=True)\n"
      f"_spawn(['/bin/sleep', '{marker}'])\n"
      f"import time\ntime.sleep(30)\n")
  result = run_python(code, SandboxLimits(wall_s=3), isolation="bwrap")
  assert "wall-clock limit" in result.error, result
  assert "uid 65534" in result.stdout, result  # not root: the sandbox's own user
  assert "net exit 256" in result.stdout, result  # the connection was refused: exit 1
  assert accepted() == 0
  deadline = time.monotonic() + 2  # the PID namespace is torn down as bwrap dies
  while _processes_under(marker) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _processes_under(marker) == []


def test_fresh_builtins_kill_the_caller_under_the_hook_alone():
  """Control: pidfd_send_signal from a fresh `_signal` module kills the caller."""
  code = FRESH_BUILTINS + "_signal.pidfd_send_signal(posix.pidfd_open(PARENT_PID), 9)\n"
  returncode, stdout, _ = _under_throwaway_parent(code, "audit")
  assert returncode == -9 and "PARENT ALIVE" not in stdout


@needs_bwrap
@pytest.mark.parametrize("attack", [
    "_signal.pidfd_send_signal(posix.pidfd_open(PARENT_PID), 9)",
    "posix.kill(PARENT_PID, 9)",
    "posix.kill(-1, 9)",
])
def test_fresh_builtins_cannot_signal_the_caller_under_bubblewrap(attack):
  returncode, stdout, result = _under_throwaway_parent(
      FRESH_BUILTINS + DISARM + attack, "bwrap")
  assert returncode == 0 and "PARENT ALIVE" in stdout, (returncode, stdout)
  assert result, stdout


@needs_bwrap
def test_device_nodes_and_inode_flags_are_refused_by_the_kernel_under_bubblewrap():
  # Causes 5 and 6: mknod (a raw disk or memory device made inside the folder), and
  # FS_IOC_SETFLAGS with the immutable flag (a folder nobody can delete afterwards).
  code = ("import fcntl, os, stat, struct\n"
          "print(os.getcwd(), flush=True)\n"
          "for name, dev in (('mem', (1, 1)), ('disk', (8, 0))):\n"
          "  try:\n"
          "    os.mknod(name, stat.S_IFCHR | 0o666 if name == 'mem' else stat.S_IFBLK | 0o666,\n"
          "             os.makedev(*dev))\n"
          "    print(name, 'MADE')\n"
          "  except OSError as e:\n"
          "    print(name, 'DENIED', e.errno)\n"
          "fd = os.open('pinned', os.O_RDONLY | os.O_CREAT)\n"
          "try:\n"
          "  fcntl.ioctl(fd, 0x40086602, struct.pack('l', 0x10))\n"
          "  print('immutable SET')\n"
          "except OSError as e:\n"
          "  print('immutable DENIED', e.errno)\n")
  result = run_python(code, isolation="bwrap")
  assert result.ok, result
  assert "mem DENIED" in result.stdout and "disk DENIED" in result.stdout, result.stdout
  assert "immutable DENIED" in result.stdout, result.stdout
  assert not os.path.exists(os.path.dirname(result.stdout.split()[0]))  # cleaned up
