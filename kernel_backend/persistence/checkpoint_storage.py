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

Integrity: every checkpoint carries a manifest (`manifest.json`: the SHA-256 of each file as
stored), written as the folder is put in place and checked by `open()` on every load, so a
truncated, damaged or swapped file is refused with an error naming the checkpoint, never loaded.
Errors name the checkpoint (its tinker:// path), never a server folder. Every scratch folder
(staging, downloads, decrypted copies) lives under `<local root>/.staging`, which `clean_staging()`
empties at start-up: a crash mid-write leaves nothing behind for long, plaintext included.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Iterator

from kernel_backend.persistence import crypto
from kernel_backend.persistence.crypto import MANIFEST
from kernel_backend.errors import UserError

log = logging.getLogger("stepwise.storage")


class CheckpointStorage:
    def __init__(self, local_root: Path, url: str | None = None):
        """`url` empty or None: the local folder `local_root`; else any fsspec URL. Scratch folders go
        under `local_root`/.staging either way."""
        self.url = url
        self.scratch = Path(local_root) / ".staging"
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
            staging = self.scratch / uuid.uuid4().hex  # under the root: same filesystem, so rename is atomic
            staging.parent.mkdir(parents=True, exist_ok=True)
            try:
                yield staging, located
                write_manifest(staging)
                _replace_dir(staging, final)
                located.append(str(final))
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            return
        scratch = self._scratch("upload")
        try:
            yield scratch / "checkpoint", located
            write_manifest(scratch / "checkpoint")
            located.append(self._upload(scratch / "checkpoint", f"{self.root}/{key}"))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _scratch(self, kind: str) -> Path:
        self.scratch.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=self.scratch))

    def clean_staging(self) -> int:
        """Remove what interrupted writes and reads left: scratch folders, and the old copies a crash
        mid-overwrite left beside a checkpoint. Call at start-up, before serving. Returns how many."""
        leftovers = list(self.scratch.glob("*")) if self.scratch.exists() else []
        if self.fs is None:
            leftovers += Path(self.root).glob("*/*/*/.*.old-*")  # <tenant>/<run>/<segment>/.<name>.old-xxxx
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        return len(leftovers)

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
    def open(self, location: str, secret: str | None, name: str | None = None) -> Iterator[Path]:
        """A plain local folder with the checkpoint at `location`, its manifest verified: the folder
        itself when it is local and not encrypted, else a downloaded and/or decrypted scratch copy.

        `name` is what errors call the checkpoint (its tinker:// path); any failure while the block
        loads from the folder becomes a UserError naming it, without the server's folder."""
        name = name or location.rstrip("/").rsplit("/", 1)[-1]
        fs, path = _fs_of(location)
        scratch = None
        try:
            if fs is None:
                stored = Path(path)
                if not stored.is_dir():
                    raise UserError(f"checkpoint {name} has no files in the store; it cannot be loaded")
            else:
                if not fs.exists(path):
                    raise UserError(f"checkpoint {name} has no files in the store; it cannot be loaded")
                scratch = stored = self._scratch("download")
                for remote in fs.ls(path, detail=False):
                    fs.get_file(remote, str(scratch / remote.rstrip("/").rsplit("/", 1)[-1]))
            verify_manifest(stored, name)
            with crypto.opened(stored, secret, name, self._scratch("open") if crypto.is_sealed(stored) else None) as plain:
                try:
                    yield plain
                except UserError as e:  # loaders name the folder they read: name the checkpoint instead
                    raise UserError(str(e).replace(str(plain), name)) from None
                except Exception as e:
                    log.exception("loading checkpoint %s failed", name)
                    raise UserError(f"checkpoint {name} could not be loaded ({type(e).__name__}): its files are not "
                                    "a checkpoint this server can read") from None
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)

    def copy(self, location: str, key: str, name: str) -> str:
        """Copy the checkpoint at `location` as stored (still sealed, if it is) to `key`; returns the copy's
        location. The source's manifest is verified first, so a damaged checkpoint is never copied."""
        fs, path = _fs_of(location)
        with self.writing(key) as (folder, located):
            folder.mkdir(parents=True)
            if fs is None:
                if not Path(path).is_dir():
                    raise UserError(f"checkpoint {name} has no files in the store; it cannot be copied")
                for item in Path(path).iterdir():
                    shutil.copy2(item, folder / item.name)
            else:
                for remote in fs.ls(path, detail=False):
                    fs.get_file(remote, str(folder / remote.rstrip("/").rsplit("/", 1)[-1]))
            verify_manifest(folder, name)
        return located[0]

    def exists(self, key: str) -> bool:
        """Whether a checkpoint is in place at `key`."""
        return Path(self.root, key).is_dir() if self.fs is None else self.fs.exists(f"{self.root}/{key}")

    def files(self, location: str) -> list[str]:
        """The names of a checkpoint's files, as stored, without its manifest."""
        fs, path = _fs_of(location)
        if not (Path(path).is_dir() if fs is None else fs.exists(path)):
            return []
        names = ([p.name for p in Path(path).iterdir() if p.is_file()] if fs is None
                 else [f.rstrip("/").rsplit("/", 1)[-1] for f in fs.ls(path, detail=False)])
        return sorted(n for n in names if n != MANIFEST)

    def size(self, location: str) -> int:
        fs, path = _fs_of(location)
        return folder_size(Path(path)) if fs is None else int(fs.du(path))

    def delete(self, location: str) -> None:
        fs, path = _fs_of(location)
        if fs is None:
            shutil.rmtree(path, ignore_errors=True)
        elif fs.exists(path):
            fs.rm(path, recursive=True)


def write_manifest(folder: Path) -> None:
    """The SHA-256 of every file in `folder`, as stored, into its manifest."""
    files = {p.name: _sha256(p) for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != MANIFEST}
    (Path(folder) / MANIFEST).write_text(json.dumps({"version": 1, "sha256": files}, indent=1))


def verify_manifest(folder: Path, name: str) -> None:
    """UserError naming the checkpoint unless every file matches its manifest and none is missing or extra."""
    damaged = f"checkpoint {name} is damaged and cannot be loaded"
    try:
        expected = json.loads((Path(folder) / MANIFEST).read_text())["sha256"]
        if not isinstance(expected, dict):
            raise ValueError
    except FileNotFoundError:
        raise UserError(f"checkpoint {name} has no manifest (it was not written by this server, or was written "
                        "before checkpoints carried checksums); it cannot be verified, so it is not loaded") from None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{damaged}: its manifest is unreadable") from None
    present = {p.name for p in Path(folder).iterdir() if p.is_file() and p.name != MANIFEST}
    if present != set(expected):
        raise UserError(f"{damaged}: files missing {sorted(set(expected) - present)}, "
                        f"unexpected {sorted(present - set(expected))}")
    for file_name, digest in expected.items():
        if _sha256(Path(folder) / file_name) != digest:
            raise UserError(f"{damaged}: {file_name} does not match the SHA-256 in its manifest")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


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
