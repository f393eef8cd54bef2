"""The checkpoint store: where saved states and sampler weights live.

By default a local folder ($STEPWISE_HOME/checkpoints); with STEPWISE_STORAGE_URL, any fsspec URL
(`s3://bucket/stepwise`, `gs://...`, `file:///mnt/shared/ckpt`, `memory://x` in tests; the
protocol's fsspec package must be installed, e.g. s3fs).

A checkpoint is a flat folder of files. The engine writes it into a local staging folder, the
service seals it there when encryption is on (so plaintext never reaches the store), and
`writing()` then puts it in place atomically: a reader or a crash sees the old checkpoint or the
new one, never part of one. Locally that is a rename; on an object store the files are uploaded
under a temporary name and moved, and only then is the checkpoint's database row written.

Rows remember a checkpoint's *location*: an absolute path for the local folder, a full URL
otherwise, so a row stays readable after the operator points STEPWISE_STORAGE_URL elsewhere.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

from kernel_backend import crypto


class CheckpointStorage:
    def __init__(self, local_root: Path, url: str | None = None):
        """`url` empty or None: the local folder `local_root`; else any fsspec URL."""
        self.url = url
        if url:
            import fsspec

            self.fs, root = fsspec.core.url_to_fs(url)
            self.root = root.rstrip("/")
        else:
            self.fs, self.root = None, str(local_root)

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.url or self.root!r})"

    # ---- writing ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[tuple[Path, list[str]]]:
        """A local folder (not yet created) to write the checkpoint `key` into, and a list that
        receives its location once the block has finished without error and it is in place."""
        located: list[str] = []
        if self.fs is None:
            final = Path(self.root) / key
            staging = Path(self.root) / ".staging" / uuid.uuid4().hex  # same filesystem: rename is atomic
            staging.parent.mkdir(parents=True, exist_ok=True)
            try:
                yield staging, located
                _replace_dir(staging, final)
                located.append(str(final))
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            return
        scratch = Path(tempfile.mkdtemp(prefix="stepwise-upload-"))
        try:
            yield scratch / "checkpoint", located
            located.append(self._upload(scratch / "checkpoint", f"{self.root}/{key}"))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _upload(self, folder: Path, final: str) -> str:
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        self.fs.makedirs(tmp, exist_ok=True)  # object stores have no folders, but local and SFTP-like ones do
        for path in sorted(folder.iterdir()):
            self.fs.put_file(str(path), f"{tmp}/{path.name}")
        if self.fs.exists(final):  # overwrite=True: the new checkpoint replaces the old one
            self.fs.rm(final, recursive=True)
        self.fs.mv(tmp, final, recursive=True)
        return self.fs.unstrip_protocol(final)

    # ---- reading, sizing, deleting ----------------------------------------------------------

    @contextlib.contextmanager
    def open(self, location: str, secret: str | None) -> Iterator[Path]:
        """A plain local folder with the checkpoint at `location`: the folder itself when it is local
        and not encrypted, else a downloaded and/or decrypted temporary copy."""
        fs, path = _fs_of(location)
        if fs is None:
            with crypto.opened(Path(path), secret) as plain:
                yield plain
            return
        scratch = Path(tempfile.mkdtemp(prefix="stepwise-download-"))
        try:
            if not fs.exists(path):
                from kernel_backend.types import UserError

                raise UserError(f"checkpoint files are missing from the store ({location})")
            for remote in fs.ls(path, detail=False):
                fs.get_file(remote, str(scratch / remote.rstrip("/").rsplit("/", 1)[-1]))
            with crypto.opened(scratch, secret) as plain:
                yield plain
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def size(self, location: str) -> int:
        fs, path = _fs_of(location)
        return folder_size(Path(path)) if fs is None else int(fs.du(path))

    def delete(self, location: str) -> None:
        fs, path = _fs_of(location)
        if fs is None:
            shutil.rmtree(path, ignore_errors=True)
        elif fs.exists(path):
            fs.rm(path, recursive=True)


def folder_size(folder: Path) -> int:
    """Bytes in the files under a local folder."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def _fs_of(location: str):
    """(None, path) for a local path; (filesystem, path) for a URL."""
    if "://" not in location:
        return None, location
    import fsspec

    return fsspec.core.url_to_fs(location)


def _replace_dir(new: Path, final: Path) -> None:
    """Move `new` to `final`, replacing what is there, so `final` is always whole."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if not final.exists():
        new.replace(final)
        return
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    final.replace(old)
    new.replace(final)
    shutil.rmtree(old, ignore_errors=True)
