"""Runs model-written Python in a separate, resource-limited process.

The `python` tool of the math family (and any family that lets the policy run
code) calls `run_python`. The code runs in a fresh interpreter (`python -I -B`,
a clean environment, its own session) whose working directory is a private
temporary directory, deleted afterwards.

Two isolations (`isolation=`, `task.kwargs.sandbox` in a config):

  - "bwrap" (the default): the interpreter runs under bubblewrap, a kernel
    boundary. It gets new user, PID, network, IPC, UTS and mount namespaces; a
    read-only root holding only /usr (with the /bin, /lib, /sbin links), the
    Python installation (`sys.prefix` and `sys.base_prefix`), /dev/null,
    /dev/zero, /dev/random, /dev/urandom and its own /proc; the private
    directory as the only writable place; an empty environment apart from what
    the tool sets; uid 65534 with every capability dropped (so no `mknod`, no
    inode flags, no raising limits); `--die-with-parent` and a new session. It
    cannot see the caller's files, environment or processes, has no network
    (only its own empty loopback), and everything it starts dies with it.
  - "audit": no kernel boundary, only the in-process audit hook below. Use it
    only where bubblewrap cannot run (`bwrap_problem()` says why); a config must
    ask for it explicitly, and the trainer then warns at start-up and records
    `sandbox/kernel_enforced` = 0 in every metric row.

Under both, three layers keep the code in bounds:

  - Kernel limits, set by the child before the user code starts: CPU time
    (SIGXCPU, then SIGKILL one second later), address space (so allocation
    fails with MemoryError), file size (Python ignores SIGXFSZ, so a write past
    it fails with EFBIG; stdout and stderr go to files, so this bounds them
    too), open files, processes (0: for a non-root user not even threads) and
    no core dumps. The parent kills the whole process group at the wall-clock
    limit (under bubblewrap, killing it tears down the PID namespace and every
    process in it); output never goes through a pipe, so it cannot block the
    parent.
  - The parent measures the private directory while the code runs (every 5 to 50 ms)
    and kills the process group when it holds more than `max_disk_mb` or
    `max_files`: RLIMIT_FSIZE bounds one file, not how many are written.
  - An audit hook (PEP 578) installed by a small bootstrap before the user code:
    it denies sockets, process creation and signalling other processes,
    loading libraries, foreign calls and raw memory access through ctypes
    (importing it is allowed: numpy and sympy need it), raising the limits,
    reading files outside the private directory and the Python installation's
    import paths, opening directories or writing anywhere outside the private
    directory, and changing directory. Calls that reach other processes without
    raising an audit event (`os.pidfd_open` with `signal.pidfd_send_signal`,
    and the `setpriority`/`sched_*` calls) are replaced by stubs that raise.

The audit hook is NOT a security boundary: code can reach the hook's own state
from a traceback and switch its rules off, get fresh unaudited `posix` and
`_signal` modules from `_imp.create_builtin`, race a symbolic link between the
hook's check and the open, make device nodes with `mknod` or set inode flags
with `ioctl` as root. Under "bwrap" it is a second line that gives clear error
messages for honest mistakes; the boundary is the kernel's.
`tests/faults/sandbox_test.py` tries each escape against both.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# The child's bootstrap. It reads its config, installs the limits and the audit
# hook, then runs the user code as `__main__` from the file name "main.py" (its
# source is put in linecache so tracebacks show the lines). It reports the
# exception summary through a status file opened before the hook denies writes
# outside the private directory.
_BOOTSTRAP = r'''
import builtins, errno, json, linecache, os, resource, stat, sys, traceback
import _posixsubprocess

def _no_process(*args, **kwargs):
  raise PermissionError("creating processes is disabled in the sandbox")

def _no_other_process(*args, **kwargs):
  raise PermissionError("acting on other processes is disabled in the sandbox")

# Functions that reach another process and raise no audit event: a pidfd lets
# signal.pidfd_send_signal kill the parent (os.kill is audited, this is not), and the
# scheduling calls re-prioritise any process. They are replaced in the modules that
# hold them (re-importing `posix` or `_signal` for fresh copies is denied by the hook).
_UNAUDITED = (("posix", "pidfd_open"), ("posix", "setpriority"),
              ("posix", "sched_setaffinity"), ("posix", "sched_setscheduler"),
              ("posix", "sched_setparam"), ("_signal", "pidfd_send_signal"))

def _remove_unaudited():
  for module_name, attr in _UNAUDITED:
    for module in (sys.modules.get(module_name), os if module_name == "posix" else None,
                   sys.modules.get("signal") if module_name == "_signal" else None):
      if module is not None and hasattr(module, attr):
        setattr(module, attr, _no_other_process)

def _install(work, read_roots):
  # Everything the hook uses is bound here, so user code cannot patch it away.
  lstat, stat_, readlink, getcwd, fsdecode, fspath = (
      os.lstat, os.stat, os.readlink, os.getcwd, os.fsdecode, os.fspath)
  S_ISLNK, S_ISDIR = stat.S_ISLNK, stat.S_ISDIR
  isinstance_, int_, bytes_, OSError_, deny_ = isinstance, int, bytes, OSError, PermissionError
  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  pid = os.getpid()
  devices = frozenset(("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom"))
  spawn = ("os.exec", "os.spawn", "os.posix_spawn")
  processes = frozenset(("os.fork", "os.forkpty", "os.system", "subprocess.Popen",
                         "os.killpg", "pty.spawn"))
  # Re-importing these would give fresh, unpatched functions.
  guarded_imports = frozenset(("_posixsubprocess", "posix", "_signal"))
  # numpy and sympy import ctypes (which dlopens the main program): allow that,
  # deny loading libraries, symbol lookup, foreign calls and raw memory access.
  ctypes_ok = frozenset(("ctypes.addressof", "ctypes.get_errno", "ctypes.set_errno",
                         "ctypes.cdata/buffer", "ctypes.create_string_buffer",
                         "ctypes.create_unicode_buffer"))
  introspection = frozenset(("gc.get_objects", "gc.get_referrers", "gc.get_referents",
                             "resource.setrlimit", "resource.prlimit"))
  mutations = {"os.mkdir": (0,), "os.rmdir": (0,), "os.remove": (0,), "os.rename": (0, 1),
               "os.link": (0, 1), "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,),
               "os.lchown": (0,), "os.utime": (0,), "os.truncate": (0,), "os.mkfifo": (0,),
               "os.mknod": (0,), "os.setxattr": (0,), "os.removexattr": (0,),
               "os.chflags": (0,), "os.lchflags": (0,)}

  def resolve(path):
    # realpath without posixpath (user code could patch it): follow every link.
    path = fspath(path)
    if isinstance_(path, bytes_):
      path = fsdecode(path)
    if not path.startswith("/"):
      path = getcwd() + "/" + path
    todo, parts, links = path.split("/")[::-1], [], 0
    while todo:
      name = todo.pop()
      if name == "" or name == ".":
        continue
      if name == "..":
        if parts:
          parts.pop()
        continue
      parts.append(name)
      full = "/" + "/".join(parts)
      try:
        mode = lstat(full).st_mode
      except OSError_:
        continue
      if S_ISLNK(mode):
        links += 1
        if links > 40:
          raise deny_(f"too many symbolic links in {path}")
        target = readlink(full)
        parts.pop()
        if target.startswith("/"):
          parts = []
        todo.extend(target.split("/")[::-1])
    return "/" + "/".join(parts)

  def under(path, roots):
    for root in roots:
      if path == root or path.startswith(root + "/"):
        return True
    return False

  def is_dir(path):
    try:
      return S_ISDIR(stat_(path).st_mode)
    except OSError_:
      return False

  def hook(event, args):
    if event == "open":
      path, mode, flags = args
      if isinstance_(path, int_):
        return  # an already open descriptor
      path = resolve(path)
      if under(path, (work,)):
        return
      if isinstance_(flags, int_) and flags >= 0:
        writing = flags & write_flags
      else:
        writing = mode is not None and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
      if writing:
        if path == "/dev/null":
          return
        raise deny_(f"writing {path} is outside the sandbox")
      # A directory descriptor would let dir_fd-relative calls escape the checks.
      if (path in devices or under(path, read_roots)) and not is_dir(path):
        return
      raise deny_(f"reading {path} is outside the sandbox")
    if event == "os.listdir" or event == "os.scandir":
      if args and args[0] is not None and not isinstance_(args[0], int_):
        path = resolve(args[0])
        if not under(path, (work,)) and not under(path, read_roots):
          raise deny_(f"listing {path} is outside the sandbox")
      return
    if event in mutations:
      for i in mutations[event]:
        if isinstance_(args[i], int_) and event == "os.truncate":
          continue
        path = "<descriptor>" if isinstance_(args[i], int_) else resolve(args[i])
        if not under(path, (work,)):
          raise deny_(f"modifying {path} is outside the sandbox")
      return
    if event == "os.chdir":
      if isinstance_(args[0], int_) or resolve(args[0]) != work:
        raise deny_("changing the working directory is disabled in the sandbox")
      return
    if event.startswith("socket."):
      raise deny_("network access is disabled in the sandbox")
    if event in processes or event.startswith(spawn):
      raise deny_("creating processes is disabled in the sandbox")
    if event == "os.kill" and args[0] != pid:
      raise deny_("signalling other processes is disabled in the sandbox")
    if event == "import" and args[0] in guarded_imports:
      raise deny_(f"importing {args[0]} again is disabled in the sandbox")
    if event.startswith("ctypes.") and event not in ctypes_ok and not (
        event == "ctypes.dlopen" and args[0] is None):
      raise deny_(f"{event} is disabled in the sandbox (no foreign code or raw memory)")
    if event in introspection:
      raise deny_(f"{event} is disabled in the sandbox")

  sys.addaudithook(hook)

def _set_limits(cfg):
  mb = 1024 * 1024
  cpu = max(1, int(-(-cfg["cpu_s"] // 1)))
  for name, soft, hard in (("RLIMIT_CPU", cpu, cpu + 1),
                           ("RLIMIT_AS", cfg["memory_mb"] * mb, cfg["memory_mb"] * mb),
                           ("RLIMIT_FSIZE", cfg["max_file_mb"] * mb, cfg["max_file_mb"] * mb),
                           ("RLIMIT_NOFILE", cfg["max_open_files"], cfg["max_open_files"]),
                           ("RLIMIT_NPROC", 0, 0), ("RLIMIT_CORE", 0, 0)):
    resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))

def _main():
  with open(sys.argv[1], encoding="utf-8") as f:  # before the hook: it lies outside `work`
    cfg = json.load(f)
  status = open(cfg["status_path"], "w", encoding="utf-8")
  source = cfg["code"]
  linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
  _posixsubprocess.fork_exec = _no_process
  import signal  # loaded now, so that _remove_unaudited patches the module user code gets
  _remove_unaudited()
  prefixes = [os.path.realpath(p) + "/" for p in
              {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}]
  roots = tuple(sorted({os.path.realpath(p) for p in sys.path
                        if p and (os.path.realpath(p) + "/").startswith(tuple(prefixes))}))
  work = os.path.realpath(os.getcwd())
  _set_limits(cfg)
  sys.argv = ["main.py"]
  user = {"__name__": "__main__", "__builtins__": builtins}
  saved_builtins = dict(builtins.__dict__)  # restored before reporting: user code may patch them
  reserve = bytearray(1 << 20)  # freed on an exception, so the report has memory to run
  _install(work, roots)
  error, kind, code = None, None, 0
  try:
    exec(compile(source, "main.py", "exec"), user)
  except SystemExit as e:
    builtins.__dict__.update(saved_builtins)
    if e.code is not None and not isinstance(e.code, int):
      print(e.code, file=sys.stderr)
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    error = None if code == 0 else f"SystemExit: {e.code}"
  except BaseException as e:
    del reserve
    user.clear()
    builtins.__dict__.update(saved_builtins)
    code = 1
    kind = "exception"
    if isinstance(e, MemoryError):
      kind = "memory"
    elif isinstance(e, OSError) and e.errno == errno.EFBIG:
      kind = "file_size"
    try:
      error = traceback.format_exception_only(type(e), e)[-1].strip()
      report = traceback.TracebackException(type(e), e, e.__traceback__)
      # Drop this bootstrap's frames (the runner and the audit hook).
      report.stack = traceback.StackSummary.from_list(
          [f for f in report.stack if f.filename != __file__])
      sys.stderr.write("".join(report.format()))
    except BaseException:
      error = error or type(e).__name__
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except BaseException:
      pass
  status.write(json.dumps({"error": error, "kind": kind}))
  status.flush()
  os._exit(code)

_main()
'''


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Resource limits of one run.

  Attributes:
    cpu_s: CPU seconds (RLIMIT_CPU; rounded up to whole seconds).
    wall_s: wall-clock seconds before the process group is killed.
    memory_mb: address-space limit in MiB (RLIMIT_AS).
    max_file_mb: largest file the code (or its stdout/stderr) may write, in MiB.
    max_output_chars: stdout and stderr are each cut to this many characters.
    max_open_files: RLIMIT_NOFILE.
    max_disk_mb: most MiB the private directory may hold (allocated blocks). RLIMIT_FSIZE
      bounds one file only, so the parent measures the directory while the code runs and
      kills it past this (or past `max_files`); a fast writer may overshoot by what it
      writes in one poll interval (at most 50 ms).
    max_files: most files and directories the private directory may hold.
  """

  cpu_s: int | float = 5
  wall_s: int | float = 10
  memory_mb: int = 512
  max_file_mb: int = 8
  max_output_chars: int = 4000
  max_open_files: int = 64
  max_disk_mb: int = 64
  max_files: int = 1000


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What one run produced.

  Attributes:
    ok: the code ran to the end and exited with status 0.
    stdout, stderr: the (truncated) output streams.
    error: a one-line reason when not ok (a limit, or the traceback's last line).
    returncode: the exit status (negative: killed by that signal).
    seconds: wall time of the run, startup included.
  """

  ok: bool
  stdout: str
  stderr: str
  error: str | None
  returncode: int | None
  seconds: float


ISOLATIONS = ("bwrap", "audit")

# The sandbox's user: `nobody`, mapped to the caller's uid by the user namespace.
_SANDBOX_UID = 65534
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")


def _python_roots() -> list[str]:
  """The Python installation's folders, bound read-only into the sandbox (numpy, sympy
  and the standard library are imported from there). /usr is bound anyway."""
  roots = {os.path.realpath(p) for p in
           (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
  roots.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
  # A root inside another is bound with it; /usr is bound on its own.
  return sorted(r for r in roots if not any(r.startswith(o + "/") for o in roots | {"/usr"}))


def _bwrap_command(bwrap: str, work: str, ro_files: list[str], rw_files: list[str],
                   env: dict[str, str]) -> list[str]:
  """bubblewrap's arguments: namespaces, the read-only root, the private folder."""
  args = [bwrap, "--unshare-user", "--uid", str(_SANDBOX_UID), "--gid", str(_SANDBOX_UID),
          "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
          "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
          "--hostname", "sandbox", "--clearenv"]
  for key, value in env.items():
    args += ["--setenv", key, value]
  args += ["--ro-bind", "/usr", "/usr"]
  for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
    if os.path.islink(top):  # merged /usr: /lib -> usr/lib
      args += ["--symlink", os.readlink(top), top]
    elif os.path.isdir(top):
      args += ["--ro-bind", top, top]
  args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
  for root in _python_roots():
    args += ["--ro-bind", root, root]
  for device in _DEVICES:
    args += ["--dev-bind-try", device, device]
  args += ["--proc", "/proc"]  # the new PID namespace's: the caller's processes are not in it
  for path in ro_files:
    args += ["--ro-bind", path, path]
  for path in rw_files:
    args += ["--bind", path, path]
  # The private folder keeps its host path, so messages and tests name one path.
  args += ["--bind", work, work, "--chdir", work, "--remount-ro", "/"]
  return args


@functools.lru_cache(maxsize=None)
def bwrap_problem() -> str | None:
  """Why the "bwrap" isolation cannot run here, or None when it can.

  Runs the sandbox's own bubblewrap command once (cached) with `python -c pass`, so a
  missing binary, disabled user namespaces (some container runtimes and distributions
  refuse them) or an unbindable Python installation are found before any model code.
  """
  bwrap = shutil.which("bwrap")
  if bwrap is None:
    return "the bwrap (bubblewrap) executable is not on PATH"
  work = tempfile.mkdtemp(prefix="tree_rl_sandbox_probe_")
  try:
    command = _bwrap_command(bwrap, work, [], [], {"PATH": "/usr/bin:/bin"})
    proc = subprocess.run(command + [sys.executable, "-I", "-B", "-c", "pass"],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin"})
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"running {bwrap} failed: {e}"
  finally:
    shutil.rmtree(work, ignore_errors=True)
  if proc.returncode != 0:
    why = proc.stderr.decode("utf-8", "replace").strip()[-500:] or f"exit {proc.returncode}"
    return f"{bwrap} cannot start the sandbox: {why}"
  return None


def check_isolation(isolation: str, field: str = "task.kwargs.sandbox") -> None:
  """Fails, naming `field` and the fix, unless `isolation` can run here."""
  if isolation not in ISOLATIONS:
    raise ValueError(f"{field}={isolation!r} is not an isolation; valid: {list(ISOLATIONS)}")
  if isolation == "bwrap":
    problem = bwrap_problem()
    if problem is not None:
      raise ValueError(
          f"{field}='bwrap' runs model-written code under bubblewrap, but {problem}. "
          f"Install it (Debian and Ubuntu: apt-get install bubblewrap) and allow user "
          f"namespaces, or set {field}=audit to accept the in-process audit hook alone, "
          f"which is not a security boundary (see tree_rl/envs/sandbox.py)")


def _read_output(path: str, max_chars: int) -> tuple[str, int]:
  """(text cut to `max_chars` with a marker, size in bytes) of one output file."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    data = f.read(max_chars * 4 + 4)  # a UTF-8 character is at most 4 bytes
  text = data.decode("utf-8", errors="replace")
  if len(text) > max_chars or size > len(data):
    text = (text[:max_chars]
            + f"\n... [output truncated: {size} bytes in all, showing the first "
              f"{max_chars} characters]")
  return text, size


def _disk_usage(path: str, max_entries: int) -> tuple[int, int]:
  """(bytes allocated, entries) under `path`, links not followed; stops counting past
  `max_entries` entries, so a directory of a million files costs one bounded walk."""
  used, entries, todo = 0, 0, [path]
  while todo and entries <= max_entries:
    try:
      listing = os.scandir(todo.pop())
    except OSError:  # removed meanwhile, or not a directory any more
      continue
    with listing:
      for entry in listing:
        entries += 1
        if entries > max_entries:
          break
        try:
          used += entry.stat(follow_symlinks=False).st_blocks * 512
          if entry.is_dir(follow_symlinks=False):
            todo.append(entry.path)
        except OSError:
          pass
  return used, entries


def _over_disk(limits: SandboxLimits, work: str) -> bool:
  used, entries = _disk_usage(work, limits.max_files)
  return used > limits.max_disk_mb * 2**20 or entries > limits.max_files


def _wait(proc: subprocess.Popen, limits: SandboxLimits, work: str) -> tuple[bool, bool]:
  """Waits for the child up to the wall limit, measuring its directory meanwhile.

  Returns (timed out, over the disk budget); in both cases the child still runs (the
  caller kills its process group). Polls every 5 ms at first, then every 50 ms, so a
  short run pays almost no latency.
  """
  deadline, interval = time.monotonic() + limits.wall_s, 0.005
  while True:
    try:
      proc.wait(timeout=max(0.0, min(interval, deadline - time.monotonic())))
      return False, _over_disk(limits, work)
    except subprocess.TimeoutExpired:
      pass
    if _over_disk(limits, work):
      return False, True
    if time.monotonic() >= deadline:
      return True, False
    interval = min(2 * interval, 0.05)


def _error(limits: SandboxLimits, returncode: int | None, timed_out: bool,
           status: dict, output_bytes: int, over_disk: bool = False) -> str | None:
  """The one-line reason of a failed run; None when it succeeded."""
  if over_disk:
    return (f"disk limit of {limits.max_disk_mb:g} MB or {limits.max_files} files exceeded "
            f"in the private directory")
  if timed_out:
    return f"wall-clock limit of {limits.wall_s:g} s exceeded"
  if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
    # We only send SIGKILL at the wall limit, so here it is the hard CPU limit
    # (or, rarely, the kernel's OOM killer: RLIMIT_AS normally comes first).
    return f"CPU-time limit of {limits.cpu_s:g} s exceeded"
  # Python ignores SIGXFSZ, so an oversized write fails with EFBIG ("file_size").
  if returncode == -signal.SIGXFSZ or status.get("kind") == "file_size":
    what = "the output is" if output_bytes >= limits.max_file_mb * 2**20 else "a file is"
    return f"file-size limit of {limits.max_file_mb:g} MB exceeded ({what} too large)"
  if status.get("kind") == "memory":
    return f"memory limit of {limits.memory_mb:g} MB exceeded (MemoryError)"
  if status.get("error"):
    return str(status["error"])
  if returncode is not None and returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:  # a real-time signal has no name
      name = str(-returncode)
    return f"killed by signal {name}"
  if returncode:
    return f"exited with status {returncode}"
  return None


def run_python(code: str, limits: SandboxLimits = SandboxLimits(),
               isolation: str = "bwrap") -> SandboxResult:
  """Runs `code` as a script in the sandbox and waits for it.

  Safe to call from several threads at once (no `preexec_fn`: the child sets
  its own limits).

  Args:
    code: Python source, run as `__main__`; tracebacks name it "main.py".
    limits: the resource limits.
    isolation: "bwrap" (a kernel boundary, see the module doc) or "audit" (the audit
      hook alone, no boundary).

  Returns:
    The run's result. It never raises for anything the code does.

  Raises:
    ValueError: `isolation` is unknown, or "bwrap" cannot run here (`bwrap_problem`).
  """
  check_isolation(isolation, "isolation")
  start = time.monotonic()
  base = tempfile.mkdtemp(prefix="tree_rl_sandbox_")
  try:
    work = os.path.join(base, "work")  # the private dir; base holds what the child must not touch
    os.mkdir(work, 0o700)
    paths = {k: os.path.join(base, k)
             for k in ("boot.py", "config.json", "stdout", "stderr", "status")}
    config = dict(dataclasses.asdict(limits), code=code, status_path=paths["status"])
    with open(paths["config.json"], "w", encoding="utf-8") as f:
      json.dump(config, f)
    with open(paths["boot.py"], "w", encoding="utf-8") as f:
      f.write(_BOOTSTRAP)
    open(paths["status"], "wb").close()  # bound into the sandbox, so it must exist
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": work,
           "TMPDIR": work, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "-I", "-B", paths["boot.py"], paths["config.json"]]
    if isolation == "bwrap":
      # The sandbox's uid owns nothing on the host: its folder must be its own.
      os.chmod(work, 0o777)
      os.chmod(paths["status"], 0o666)
      command = _bwrap_command(shutil.which("bwrap") or "bwrap", work,
                               [paths["boot.py"], paths["config.json"]], [paths["status"]],
                               env) + command
    timed_out = over_disk = False
    info_read = info_write = -1
    if isolation == "bwrap":
      # bubblewrap writes the pid of the namespace's first process here (see _await_namespace).
      info_read, info_write = os.pipe()
      command[1:1] = ["--info-fd", str(info_write)]
    with open(paths["stdout"], "wb") as out, open(paths["stderr"], "wb") as err:
      try:
        proc = subprocess.Popen(command, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, start_new_session=True, close_fds=True,
                                pass_fds=(info_write,) if info_write >= 0 else ())
      except BaseException:
        if info_read >= 0:
          os.close(info_read)
        raise
      finally:
        if info_write >= 0:
          os.close(info_write)
      try:
        timed_out, over_disk = _wait(proc, limits, work)
      finally:
        if proc.returncode is None:  # timed out, over the disk budget, or interrupted
          try:
            # Its session: the child and anything it made; under bubblewrap, killing it
            # kills the PID namespace (--die-with-parent) and so every process in it.
            os.killpg(proc.pid, signal.SIGKILL)
          except ProcessLookupError:
            pass
          proc.wait()
        if info_read >= 0:
          _await_namespace(info_read)
    stdout, out_bytes = _read_output(paths["stdout"], limits.max_output_chars)
    stderr, err_bytes = _read_output(paths["stderr"], limits.max_output_chars)
    try:
      with open(paths["status"], encoding="utf-8", errors="replace") as f:
        status = json.loads(f.read(10_000) or "{}")
      status = status if isinstance(status, dict) else {}
    except (OSError, ValueError):
      status = {}
    returncode = proc.returncode
    if isolation == "bwrap" and not status and returncode is not None and returncode > 128:
      # bubblewrap exits with 128 + N when its child dies of signal N; the bootstrap
      # writes its status on every exit it sees, so an empty one means a signal.
      returncode = 128 - returncode
    error = _error(limits, returncode, timed_out, status, max(out_bytes, err_bytes),
                   over_disk)
    ok = not timed_out and not over_disk and returncode == 0 and error is None
    return SandboxResult(ok=ok, stdout=stdout, stderr=stderr, error=error,
                         returncode=returncode, seconds=time.monotonic() - start)
  finally:
    _remove_tree(base)


def _await_namespace(info_fd: int, timeout_s: float = 10.0) -> None:
  """Waits until every process in a finished bubblewrap run's PID namespace is gone.

  bubblewrap's own exit does not mean that: --die-with-parent reaches the namespace's
  processes by a signal the kernel delivers after bubblewrap is reaped, and one of them may
  still be writing into the private folder while the caller deletes it. The namespace's
  first process (its init) exits only after the kernel has killed and reaped every other
  process in the namespace, so this waits for that one to be gone or a zombie. Closes
  `info_fd`.
  """
  try:
    os.set_blocking(info_fd, False)  # bubblewrap has exited: what it wrote is all there
    info = os.read(info_fd, 4096)
  except OSError:  # nothing written, and the sandbox held the pipe open
    info = b""
  finally:
    os.close(info_fd)
  try:
    pid = int(json.loads(info)["child-pid"])
  except (ValueError, KeyError, TypeError):
    return  # bubblewrap failed before it made the namespace: nothing ran
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    try:
      with open(f"/proc/{pid}/stat", "rb") as f:
        state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
      return  # gone (a reused pid would be a new process: stop waiting either way)
    if state in (b"Z", b"X"):
      return
    time.sleep(0.005)


def _remove_tree(path: str) -> None:
  """Deletes the run's directory, whatever permissions the code left on its files."""
  for root, dirs, _ in os.walk(path):
    for d in dirs:
      d = os.path.join(root, d)
      if not os.path.islink(d):  # never chmod what a link points to
        try:
          os.chmod(d, 0o700)
        except OSError:
          pass
  shutil.rmtree(path, ignore_errors=True)
