"""A PostgreSQL cluster a test makes: initdb in a temporary folder, a free loopback port, stopped afterwards.

`make test` installs Debian's PostgreSQL when it runs as root (the Makefile's `postgresql` target), so on CI a
missing server is a failure, never a quiet fall-back to SQLite; elsewhere (not root, nothing installed) the tests
that need it are skipped, saying how to install it. PostgreSQL refuses to run as root: as root the cluster runs as
the `postgres` system user the Debian package makes.

    cluster = PostgresCluster.make()      # initdb + start
    cluster.url                           # postgresql+psycopg://postgres@127.0.0.1:PORT/postgres
    cluster.stop(); cluster.start()       # the same data and port: a database outage and its end
    cluster.restart()
    cluster.remove()

The `postgres_cluster` fixture (import it into a test module) gives one per module.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from servers import free_port


def _pg_bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


@dataclass
class PostgresCluster:
    root: Path
    port: int
    as_user: list[str]  # runuser -u postgres -- when we are root
    pg_ctl: str

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @classmethod
    def make(cls) -> "PostgresCluster":
        initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
        if not initdb or not pg_ctl:
            if os.geteuid() == 0:  # CI: `make test` installed it, or should have
                pytest.fail("PostgreSQL's server binaries are missing although this runs as root: `make postgresql` "
                            "(which `make test` runs) installs them with apt-get")
            pytest.skip("PostgreSQL's server binaries not found: `make postgresql` as root, or `apt-get install "
                        "postgresql`, to run the PostgreSQL tests")
        # Not under pytest's tmp folder: that is private to root, and the server runs as `postgres`.
        root = Path(tempfile.mkdtemp(prefix="stepwise-pg-"))
        (root / "sockets").mkdir()
        as_user: list[str] = []
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                pytest.fail("running as root without runuser: PostgreSQL cannot be started as a non-root user")
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                pytest.fail("running as root with no `postgres` user to run PostgreSQL as: Debian's package makes it "
                            "(`make postgresql`), or `useradd --system postgres`")
            as_user = ["runuser", "-u", "postgres", "--"]
            shutil.chown(root, "postgres")
            shutil.chown(root / "sockets", "postgres")
        subprocess.run([*as_user, initdb, "-D", str(root / "data"), "-A", "trust", "-U", "postgres"], check=True,
                       capture_output=True)
        cluster = cls(root, free_port(), as_user, pg_ctl)
        cluster.start()
        return cluster

    def start(self) -> None:
        """Start (again) on the same data and port; returns once it accepts connections (pg_ctl -w)."""
        options = f"-p {self.port} -k {self.root / 'sockets'} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.data), "-o", options, "-w", "-l",
                        str(self.root / "log"), "start"], check=True, capture_output=True)

    def stop(self, mode: str = "fast") -> None:
        """Stop it: "fast" ends every connection (an outage as the backend meets one), "immediate" is a crash.
        Raises if it was running and did not stop: an outage test must never pass on a database that stayed up."""
        done = subprocess.run([*self.as_user, self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop"],
                              capture_output=True, text=True)
        if done.returncode != 0 and "Is server running?" not in done.stderr:
            raise RuntimeError(f"pg_ctl stop failed: {done.stderr.strip()}")

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres_cluster():
    cluster = PostgresCluster.make()
    yield cluster
    cluster.remove()
