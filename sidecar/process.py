"""``kv-sidecar serve`` in a child process: start it, learn its gRPC target, stop it.

What an engine launcher, the benchmarks and the tests use to run a sidecar as deployed (its
own interpreter and GIL) rather than in-process (``sidecar.app.ServerThread``).

The child ends with its parent: it is handed the read end of a pipe whose write end only the
parent holds (``PARENT_PIPE_ENV``), and ``kv-sidecar serve`` stops gracefully, as on SIGTERM,
when that pipe closes. A parent that is killed (SIGKILL, the OOM killer, a timeout) so leaves
no sidecar behind holding its port, its memory and its shared-memory pool.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the checkout (or installation) root: the child's working directory
ROOT = Path(__file__).resolve().parents[1]
#: Channel options giving a client its own TCP connection, as separate engine processes have:
#: gRPC otherwise shares one connection among channels to one address, and the kernel spreads
#: a supervisor's workers over connections (docs/operations.md, "Workers").
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
#: names the pipe descriptor whose end (its parent gone) stops ``kv-sidecar serve``; not under
#: ``KV_SIDECAR_``, which the configuration reads as settings (an older checkout's sidecar, a
#: benchmark's baseline, would refuse it as an unknown one)
PARENT_PIPE_ENV = "KVSC_PARENT_PIPE"


def spawn_sidecar(*flags: str, env: dict[str, str] | None = None, python: str | None = None,
                  log: deque[str] | None = None, root: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``kv-sidecar serve`` in a child process and return it with its gRPC target once it
    serves (the caller owns the process: fault tests SIGKILL it; the child ends with this process
    or once the returned ``Popen`` is garbage collected, so keep it). Extra settings go in as
    ``--set key=value`` flags. The port is read from the INFO start-up line, so the log level
    stays at INFO; after start-up a thread keeps draining the log (a full pipe would stall the
    server) into ``log`` when one is given. ``root``: another checkout (a baseline server)."""
    root = root or ROOT
    cmd = [python or sys.executable, "-m", "sidecar.cli", "serve", "--port", "0", "--metrics-port", "-1", "--log-level", "INFO",
           *flags]
    lines: deque[str] = log if log is not None else deque(maxlen=200)
    r, w = os.pipe()  # the child ends when w closes: this process gone, or the Popen collected
    try:
        proc = subprocess.Popen(cmd, cwd=root, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                pass_fds=(r,),
                                env={**os.environ, "LMCACHE_TRACK_USAGE": "false", **(env or {}), PARENT_PIPE_ENV: str(r)})
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    weakref.finalize(proc, os.close, w)
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if not line and proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {proc.returncode}: {''.join(list(lines)[-20:])}")
            m = re.search(r"serving \S+ on ([\d.]+):(\d+)", line)
            if m:
                break
        else:
            raise RuntimeError("sidecar did not start within 120 s")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    threading.Thread(target=lines.extend, args=(proc.stderr,), daemon=True).start()
    return proc, f"{m.group(1)}:{m.group(2)}"


@contextmanager
def sidecar_process(*flags: str, env: dict[str, str] | None = None, python: str | None = None,
                    log: deque[str] | None = None, root: Path | None = None) -> Iterator[str]:
    """Run ``kv-sidecar serve`` in a child process (its own interpreter and GIL, as deployed);
    yields the gRPC target (see ``spawn_sidecar``). ``python``: the interpreter of the server's
    environment (default: this one; an engine environment without the server's dependencies
    passes the main one, ``server_python()``)."""
    proc, target = spawn_sidecar(*flags, env=env, python=python, log=log, root=root)
    try:
        yield target
    finally:
        stop_process(proc)


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a supervisor's workers), from /proc."""
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
        except OSError:
            continue
    return out


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM (a graceful stop), then SIGKILL if ``proc`` has not exited within ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_python() -> str:
    """The interpreter that can run the sidecar: ``$KV_SIDECAR_SERVER_PYTHON`` (set by ./dev for
    the engine suite), else the main environment's ``.venv``, else this one."""
    env = os.environ.get("KV_SIDECAR_SERVER_PYTHON")
    if env:
        return env
    main = ROOT / ".venv" / "bin" / "python"
    return str(main) if main.exists() else sys.executable
