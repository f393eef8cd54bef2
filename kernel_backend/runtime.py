"""The runtime folder of a STEPWISE_HOME: which backend serves it, and which processes use it.

    <home>/runtime/backend.json   written by `serve` while it runs (mode 0600):
                                  {base_url, pid, started, local_key, loopback_key, log, exits_when_unused}
    <home>/runtime/<pid>.json     written by every process that connected to a backend
                                  (workbench.connect(): a notebook kernel, `stepwise demo`, a script):
                                  {base_url, api_key, pid, ...}; removed when that process exits

One backend serves one SQLite home (Service holds `backend.lock`), so a second notebook, `stepwise
demo` or a script in the same home finds the running backend here and shares it instead of
failing on the lock. A backend started by workbench.connect() runs with `--exit-when-unused`: it
stops once no live process has a `<pid>.json` naming it (a kernel killed with SIGKILL leaves its
file behind; its dead pid marks it stale).

The loopback key: a backend that listens on loopback only accepts the well-known key `tml-local`
(STEPWISE_LOOPBACK_KEY; empty turns it off) for its "local" tenant, so the README's example runs
as printed. A backend listening on any other address never accepts it: remote servers need keys
made with `stepwise keys create`.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger("stepwise.runtime")

BACKEND_FILE = "backend.json"
LOOPBACK_HOSTS = ("localhost",)


def runtime_dir(home: Path) -> Path:
    return Path(home) / "runtime"


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name the server binds to, or a client's address) is loopback only."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, but another user's
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (not Linux): kill(0) said it exists


def loopback_peer(client_host: str, client_port: int, server_port: int) -> tuple[int, str] | None:
    """The process on this machine at the other end of a loopback connection, as (pid, a short name: the
    script or module it runs), found through /proc (Linux); None elsewhere, for another address, or when
    the socket is not ours to see. The backend names a plain SDK script's session after it, and ends the
    session when that process exits (Service.reap), as it does for workbench.connect()'s kernels."""
    if not is_loopback(client_host):
        return None
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:  # "sl local_address rem_address st ... uid timeout inode": ports in hex
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == client_port and int(fields[2].rsplit(":", 1)[1], 16) == server_port:
                inode = fields[9]
                break
        if inode:
            break
    if not inode or inode == "0":
        return None
    target = f"socket:[{inode}]"
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd) == target for fd in (pid_dir / "fd").iterdir()):
                return int(pid_dir.name), _process_name(pid_dir)
        except OSError:
            continue  # exited meanwhile, or another user's
    return None


def _process_name(pid_dir: Path) -> str:
    """`train.py` for `python train.py --lr 1e-4`, `mypkg.train` for `python -m mypkg.train`, else the program."""
    argv = (pid_dir / "cmdline").read_bytes().decode(errors="replace").split("\0")
    argv = [a for a in argv if a]
    if not argv:
        return pid_dir.name
    if Path(argv[0]).name.startswith("python"):
        rest = [a for a in argv[1:] if not a.startswith("-") or a in ("-m", "-c")]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return rest[1]
        if rest[:1] == ["-c"]:
            return "python -c"
        if rest:
            return Path(rest[0]).name
    return Path(argv[0]).name


def write_private_json(path: Path, record: dict) -> None:
    """Write `record` atomically, readable by its owner only (these files hold API keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.chmod(tmp, 0o600)
    tmp.replace(path)


def announce_backend(home: Path, base_url: str, local_key: str, loopback_key: str, log_path: str | None,
                     exits_when_unused: bool) -> Path:
    """Write backend.json for this process; returns its path (remove it at exit)."""
    path = runtime_dir(home) / BACKEND_FILE
    write_private_json(path, {
        "base_url": base_url, "pid": os.getpid(), "started": dt.datetime.now(dt.timezone.utc).isoformat(),
        "local_key": local_key or None, "loopback_key": loopback_key or None, "log": log_path,
        "exits_when_unused": exits_when_unused,  # started by a client: its last client may stop it sooner
    })
    return path


def withdraw_backend(path: Path) -> None:
    """Remove backend.json if it is still ours (a later backend may have replaced it)."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


def running_backend(home: Path) -> dict | None:
    """The backend.json record of the backend serving `home`, if its process is alive."""
    try:
        record = json.loads((runtime_dir(home) / BACKEND_FILE).read_text())
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if pid_alive(pid) and _is_backend(pid) else None


def _is_backend(pid: int) -> bool:
    """Whether `pid` still runs a backend (not a new process that got a dead backend's pid)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return True  # no /proc: trust the pid
    return b"kernel_backend" in command or b"stepwise" in command


def live_clients(home: Path, base_url: str) -> list[int]:
    """Pids of live processes whose <pid>.json names the backend at `base_url`."""
    pids = []
    for path in runtime_dir(home).glob("*.json"):
        if not path.stem.isdigit():
            continue
        try:
            record = json.loads(path.read_text())
            pid, url = int(record["pid"]), str(record["base_url"]).rstrip("/")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if url == base_url.rstrip("/") and pid_alive(pid):
            pids.append(pid)
    return sorted(pids)


def exit_when_unused(home: Path, base_url: str, stop: Callable[[], None], interval_s: float = 2.0,
                     grace_s: float = 15.0) -> threading.Thread:
    """Call `stop()` once no live process has used this backend for `grace_s` seconds.

    Started when the backend is ready: the process that launched it announces itself within a
    second of seeing /healthz answer, and `grace_s` covers a kernel restart (the old kernel's file
    goes, the new kernel's connect() comes)."""

    def watch() -> None:
        last_seen = time.monotonic()
        while True:
            time.sleep(interval_s)
            if live_clients(home, base_url):
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen > grace_s:
                log.warning("no live process uses this backend any more (see %s): stopping", runtime_dir(home))
                stop()
                return

    thread = threading.Thread(target=watch, name="stepwise-exit-when-unused", daemon=True)
    thread.start()
    return thread
