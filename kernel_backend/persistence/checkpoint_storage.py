"""The checkpoint store: where saved states and sampler weights live.

By default a local folder ($STEPWISE_HOME/checkpoints); with STEPWISE_STORAGE_URL, any fsspec URL
(`s3://bucket/stepwise`, `gs://...`, `file:///mnt/shared/ckpt`, `memory://x` in tests; the
protocol's fsspec package must be installed, e.g. s3fs).

A checkpoint is a flat folder of files. The engine writes it into a local staging folder, the
service seals it there when encryption is on (so plaintext never reaches the store), and
`writing()` then puts it in place atomically: a reader or a crash sees the old checkpoint or the
new one, never part of one. Locally that is a rename. An object store (S3 and the like) has no
folders to rename, and fsspec's `mv` of a prefix is no atomic step (with s3fs 2026.9 it raises), so
there each write goes under a fresh *generation* and the manifest, one object written last with a
single PUT (atomic on S3), names it:

    <key>/manifest.json          {"version": 2, "generation": "g-<hex>", "sha256": {file: digest}}
    <key>/g-<hex>/<file>         the files of that generation, under their final keys

Readers trust the manifest alone: a crash mid-upload leaves a generation no manifest names (for a
new key: no checkpoint at all; for an overwrite, a snapshot: the old one, whole). After the new
manifest lands the old generation is deleted. Checkpoints stored before generations (files beside
a version-1 manifest) still load. Why generations rather than, say, a marker beside files written
in place: an overwrite (save with overwrite=True) then never touches the files a reader may be
loading, so the old checkpoint stays whole until the new manifest replaces it in one PUT. On a
file:// store the manifest is written under a temporary name and renamed, the same single step.

A failure before the manifest landed raises StoreError (it names the store and the fix; what readers
see is unchanged). What a crash leaves is deleted once older than STALE_AFTER_S (by the store's
LastModified), at start-up (`clean_staging`) and when its key is written again: a generation no
manifest names, a version-1 checkpoint's files left beside the manifest that replaced them, and the
`<key>.tmp-<hex>/` folders of the releases before generations. Never sooner, because another process
(a Ray worker, a second gateway) may be uploading it right now; never a manifest, nor anything in a
folder that has one taken for a generation (a checkpoint may be named `g-<16 hex>`). One exception
to knowing better than the name: an old-layout checkpoint (version 1) named `<x>.tmp-<8 hex>` looks
exactly like an old cut upload and is deleted with them.

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
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

from fsspec.implementations.local import LocalFileSystem

from kernel_backend.persistence import crypto
from kernel_backend.persistence.crypto import MANIFEST
from kernel_backend.errors import UserError

log = logging.getLogger("stepwise.storage")


# How old a generation no manifest names (or an older upload's *.tmp-* object) must be before it is taken for a crash's
# leftover and deleted: an upload in progress elsewhere is younger than this.
STALE_AFTER_S = 6 * 3600.0
GENERATION_PREFIX = "g-"
_GENERATION = re.compile(r"g-[0-9a-f]{16}")
_OLD_UPLOAD = re.compile(r".+\.tmp-[0-9a-f]{8}")  # before generations: uploaded to <key>.tmp-<hex>/, then moved


class StoreError(OSError):
    """The checkpoint store failed a write (unreachable, refused, ...); what readers see is unchanged."""


class CheckpointStorage:
    def __init__(self, local_root: Path, url: str | None = None, options: dict | None = None):
        """`url` empty or None: the local folder `local_root`; else any fsspec URL, its filesystem made with
        `options` (STEPWISE_STORAGE_OPTIONS). Scratch folders go under `local_root`/.staging either way."""
        self.url = url
        self.options = options or {}
        self.scratch = Path(local_root) / ".staging"
        if url:
            import fsspec

            self.fs, root = fsspec.core.url_to_fs(url, **self.options)
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
            located.append(self._upload(scratch / "checkpoint", f"{self.root}/{key}"))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _scratch(self, kind: str) -> Path:
        self.scratch.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=self.scratch))

    def clean_staging(self, older_than_s: float = STALE_AFTER_S) -> int:
        """Remove what interrupted writes and reads left: scratch folders, the old copies a crash mid-overwrite left
        beside a local checkpoint, and on an object store the generations no manifest names and older uploads'
        `*.tmp-*` objects, once older than `older_than_s`. Call at start-up, before serving. Returns how many."""
        leftovers = list(self.scratch.glob("*")) if self.scratch.exists() else []
        if self.fs is None:
            leftovers += Path(self.root).glob("*/*/*/.*.old-*")  # <tenant>/<run>/<segment>/.<name>.old-xxxx
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        if self.fs is None:
            return len(leftovers)
        self.fs.invalidate_cache()
        try:
            objects = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return len(leftovers)
        return len(leftovers) + self._delete_stale(objects, older_than_s)

    def _delete_stale(self, objects: dict, older_than_s: float) -> int:
        """Delete what interrupted writes left among `objects` (fs.find's {path: info}) once older than `older_than_s`
        (by LastModified): generations no manifest names, a version-1 checkpoint's files left beside the manifest of
        the generation that replaced it, a file:// store's manifest cut before its rename, and the older uploads'
        `<key>.tmp-<hex>/` folders. A checkpoint's manifest is never deleted here, and a folder with a manifest is
        never taken for a generation (a checkpoint may be named like one). A manifest is read only where a folder
        holds more than one generation (or one and loose files): one listing at start-up, not a read per checkpoint."""
        manifests = {path.rsplit("/", 1)[0] for path in objects if path.rsplit("/", 1)[-1] == MANIFEST}
        old_uploads = {folder for folder in {path.rsplit("/", 1)[0] for path in objects}
                       if _OLD_UPLOAD.fullmatch(folder.rsplit("/", 1)[-1])
                       and not (folder in manifests and (self._manifest(folder) or {}).get("version") == 2)}
        groups: dict[str, dict[str, list[str]]] = {}  # checkpoint folder -> generation ("" for loose files) -> paths
        leftovers = []
        for path in objects:
            folder, _, file_name = path.rpartition("/")
            parent, _, leaf = folder.rpartition("/")
            if folder in old_uploads or file_name.startswith(f"{MANIFEST}.tmp-"):
                leftovers.append(path)
            elif file_name == MANIFEST:
                continue
            elif folder in manifests:
                groups.setdefault(folder, {}).setdefault("", []).append(path)
            elif _GENERATION.fullmatch(leaf):
                groups.setdefault(parent, {}).setdefault(leaf, []).append(path)
        for folder, by_generation in groups.items():
            if folder not in manifests:  # a new key's upload that never got its manifest
                current = None
            elif len(by_generation) == 1:  # only what the manifest names is there
                continue
            else:
                manifest = self._manifest(folder)
                if manifest is None:  # deleted since the listing: delete() removes the rest
                    continue
                current = manifest.get("generation") or ""
            leftovers += [path for generation, paths in by_generation.items() if generation != current
                          for path in paths]
        cutoff = time.time() - older_than_s
        stale = [path for path in leftovers if _modified(objects[path]) < cutoff]
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)
        if stale:
            log.info("deleted %d objects of interrupted checkpoint writes older than %.0f s", len(stale), older_than_s)
        return len(stale)

    def _manifest(self, folder: str) -> dict | None:
        """The manifest stored at `folder` (a path in self.fs or another fs's), or None."""
        return _read_manifest(self.fs, folder)

    def _upload(self, folder: Path, final: str) -> str:
        """Files under a new generation, then the manifest naming it, then the old generation away (the module
        docstring says why). A failure before the manifest landed is a StoreError: nothing a reader sees changed."""
        generation = f"{GENERATION_PREFIX}{uuid.uuid4().hex[:16]}"
        files = file_digests(folder)
        manifest = json.dumps({"version": 2, "generation": generation, "sha256": files}, indent=1).encode()
        try:
            previous = self._manifest(final)
            self.fs.makedirs(f"{final}/{generation}", exist_ok=True)  # no-op on object stores; local ones need it
            for name in files:  # put_file streams (s3fs: one PUT up to 100 MiB, then 50 MiB parts)
                self.fs.put_file(str(folder / name), f"{final}/{generation}/{name}")
            if isinstance(self.fs, LocalFileSystem):  # a file:// store: write, then rename, as one PUT is on S3
                staged = f"{final}/{MANIFEST}.tmp-{uuid.uuid4().hex[:8]}"
                self.fs.pipe_file(staged, manifest)
                self.fs.mv(staged, f"{final}/{MANIFEST}")
            else:
                self.fs.pipe_file(f"{final}/{MANIFEST}", manifest)  # one PUT: from here on readers see the new one
        except Exception as e:
            log.exception("writing checkpoint %s to %s failed", final, self)
            raise StoreError(f"the checkpoint could not be written to the checkpoint store {self.url} "
                             f"({type(e).__name__}: {e}); nothing was replaced (an earlier checkpoint of that name is "
                             "whole). Check that the store is reachable (STEPWISE_STORAGE_URL, its credentials and "
                             "STEPWISE_STORAGE_OPTIONS) and save again") from None
        try:  # the save is done: a failure from here on leaves objects that the next clean-up deletes
            if previous is not None and previous.get("generation"):
                self.fs.rm(f"{final}/{previous['generation']}", recursive=True)
            elif previous is not None:  # a version-1 checkpoint's files beside the manifest
                for name in set(previous.get("sha256") or {}) - {MANIFEST}:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(f"{final}/{name}")
            self._delete_stale(self._listing(final), STALE_AFTER_S)  # an earlier crash's, under this key
        except Exception:
            log.warning("checkpoint %s is in place, but removing what it replaced failed; clean_staging at the next "
                        "start deletes that", final, exc_info=True)
        return self.fs.unstrip_protocol(final)

    def _listing(self, final: str) -> dict:
        """fs.find's {path: info} of the objects under the key `final`, and of the older uploads' `<final>.tmp-*`."""
        self.fs.invalidate_cache()  # another process may have written since this one listed
        found = {}
        parent = final.rsplit("/", 1)[0]
        with contextlib.suppress(FileNotFoundError):
            found.update(self.fs.find(final, detail=True))
        with contextlib.suppress(FileNotFoundError):
            for sibling in self.fs.ls(parent, detail=False):
                if sibling.rstrip("/").startswith(f"{final}.tmp-"):
                    found.update(self.fs.find(sibling, detail=True))
        return found

    def _download(self, fs, path: str, into: Path, name: str) -> None:
        """The stored files of the checkpoint at `path` and its manifest into the local folder `into`. Should an
        overwrite land mid-download (it deletes the generation being read), the new manifest's files are read."""
        for attempt in range(3):
            try:
                raw = fs.cat_file(f"{path}/{MANIFEST}")
            except FileNotFoundError:
                raise UserError(f"checkpoint {name} has no files in the store; it cannot be loaded") from None
            manifest = _parsed_manifest(raw)
            if not isinstance(manifest.get("sha256"), dict):
                raise UserError(f"checkpoint {name} is damaged and cannot be loaded: its manifest is unreadable")
            into.mkdir(parents=True, exist_ok=True)
            base = f"{path}/{manifest['generation']}" if manifest.get("generation") else path
            try:
                for file_name in manifest["sha256"]:  # get_file streams to disk
                    fs.get_file(f"{base}/{file_name}", str(into / file_name))
            except FileNotFoundError:
                if attempt == 2 or _read_manifest(fs, path) in (None, manifest):
                    raise UserError(f"checkpoint {name} is damaged and cannot be loaded: files its manifest names "
                                    "are missing from the store") from None
                shutil.rmtree(into)
                continue
            (into / MANIFEST).write_bytes(raw)
            return

    # ---- reading, sizing, deleting ----------------------------------------------------------

    @contextlib.contextmanager
    def open(self, location: str, secret: str | tuple[str, ...] | None, name: str | None = None) -> Iterator[Path]:
        """A plain local folder with the checkpoint at `location`, its manifest verified: the folder
        itself when it is local and not encrypted, else a downloaded and/or decrypted scratch copy.

        `name` is what errors call the checkpoint (its tinker:// path); any failure while the block
        loads from the folder becomes a UserError naming it, without the server's folder."""
        name = name or location.rstrip("/").rsplit("/", 1)[-1]
        fs, path = self._fs_of(location)
        scratch = None
        try:
            if fs is None:
                stored = Path(path)
                if not stored.is_dir():
                    raise UserError(f"checkpoint {name} has no files in the store; it cannot be loaded")
            else:
                scratch = stored = self._scratch("download")
                self._download(fs, path, scratch, name)
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
        fs, path = self._fs_of(location)
        with self.writing(key) as (folder, located):
            folder.mkdir(parents=True)
            if fs is None:
                if not Path(path).is_dir():
                    raise UserError(f"checkpoint {name} has no files in the store; it cannot be copied")
                for item in Path(path).iterdir():
                    shutil.copy2(item, folder / item.name)
            else:
                self._download(fs, path, folder, name)
            verify_manifest(folder, name)
            (folder / MANIFEST).unlink()  # the copy gets a manifest of its own as it is put in place
        return located[0]

    def reachable(self) -> None:
        """Raise (OSError, or the store's own error) unless the store's root can be listed now (GET /readyz)."""
        if self.fs is None:
            Path(self.root).mkdir(parents=True, exist_ok=True)  # (the first save would make it)
            return
        self.fs.invalidate_cache(self.root)  # ask the store, not fsspec's cached listing
        try:
            self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            pass  # answered: nothing is stored under the prefix yet

    def exists(self, key: str) -> bool:
        """Whether a checkpoint is in place at `key` (on an object store: its manifest is)."""
        return Path(self.root, key).is_dir() if self.fs is None else self._manifest(f"{self.root}/{key}") is not None

    def files(self, location: str) -> list[str]:
        """The names of a checkpoint's files, as stored, without its manifest."""
        fs, path = self._fs_of(location)
        if fs is None:
            return sorted(p.name for p in Path(path).iterdir() if p.is_file() and p.name != MANIFEST) \
                if Path(path).is_dir() else []
        return sorted((_read_manifest(fs, path) or {}).get("sha256") or {})

    def size(self, location: str) -> int:
        """Bytes the checkpoint takes in the store: its files as stored and its manifest."""
        fs, path = self._fs_of(location)
        if fs is None:
            return folder_size(Path(path))
        manifest = _read_manifest(fs, path)
        if manifest is None or not isinstance(manifest.get("sha256"), dict):
            return 0
        base = f"{path}/{manifest['generation']}" if manifest.get("generation") else path
        return int(fs.size(f"{path}/{MANIFEST}")) + sum(int(fs.size(f"{base}/{name}")) for name in manifest["sha256"])

    def delete(self, location: str) -> None:
        fs, path = self._fs_of(location)
        if fs is None:
            shutil.rmtree(path, ignore_errors=True)
            return
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(f"{path}/{MANIFEST}")  # first: from here on it is no checkpoint, whatever else remains
        with contextlib.suppress(FileNotFoundError):
            fs.rm(path, recursive=True)

    def _fs_of(self, location: str):
        """(None, path) for a local path; (filesystem, path) for a URL, made with this store's options when the URL
        is of the store's own protocol (its credentials and endpoint)."""
        if "://" not in location:
            return None, location
        import fsspec

        same = self.url is not None and location.split("://", 1)[0] == self.url.split("://", 1)[0]
        return fsspec.core.url_to_fs(location, **(self.options if same else {}))


def file_digests(folder: Path) -> dict[str, str]:
    """{name: SHA-256} of every file in `folder` as stored, its manifest left out: what a manifest records."""
    return {p.name: _sha256(p) for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != MANIFEST}


def write_manifest(folder: Path) -> None:
    """The SHA-256 of every file in `folder`, as stored, into its manifest."""
    (Path(folder) / MANIFEST).write_text(json.dumps({"version": 1, "sha256": file_digests(folder)}, indent=1))


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


def _read_manifest(fs, folder: str) -> dict | None:
    """The manifest object at `folder` in `fs`, read from the store itself (no listing cache), or None."""
    try:
        return _parsed_manifest(fs.cat_file(f"{folder}/{MANIFEST}"))
    except FileNotFoundError:
        return None


def _parsed_manifest(raw: bytes) -> dict:
    """A manifest's contents; an unreadable one as {"sha256": None}, which readers refuse as damaged."""
    try:
        manifest = json.loads(raw)
    except ValueError:
        return {"sha256": None}
    return manifest if isinstance(manifest, dict) else {"sha256": None}


def _modified(info: dict) -> float:
    """An object's last change as epoch seconds, from fsspec's listing (S3: LastModified; local: mtime)."""
    stamp = info.get("LastModified") or info.get("mtime") or info.get("created") or 0
    return stamp.timestamp() if hasattr(stamp, "timestamp") else float(stamp)


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
