"""The checkpoint store (kernel_backend/persistence/checkpoint_storage.py): a local folder or any fsspec URL, written atomically.

`memory://` is fsspec's in-process filesystem: the same calls as s3:// or gs:// without a network.
The server-level test (sealed checkpoints in a file:// store, across restarts) is in test_durability.
"""

from __future__ import annotations

import uuid

import fsspec
import pytest

from kernel_backend.persistence import crypto
from kernel_backend.persistence.checkpoint_storage import MANIFEST, CheckpointStorage


KINDS = ["local", "memory", "file-url"]


def store(tmp_path, kind: str) -> CheckpointStorage:
    """The default local folder, or an fsspec URL: memory:// (an object store's semantics, no folders)
    or file:// (a filesystem with folders, through the same fsspec code path)."""
    if kind == "local":
        return CheckpointStorage(tmp_path / "local")
    url = f"memory://ckpt-{uuid.uuid4().hex}" if kind == "memory" else f"file://{tmp_path / 'url-store'}"
    return CheckpointStorage(tmp_path / "unused", url)


def write(storage: CheckpointStorage, key: str, files: dict[str, bytes]) -> str:
    with storage.writing(key) as (folder, located):
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
    return located[0]


def read(storage: CheckpointStorage, location: str, secret: str | None = None) -> dict[str, bytes]:
    """The checkpoint's files (its manifest of checksums left out)."""
    with storage.open(location, secret) as folder:
        return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != MANIFEST}


@pytest.mark.parametrize("kind", KINDS)
def test_write_read_overwrite_delete(tmp_path, kind):
    storage = store(tmp_path, kind)
    location = write(storage, "t/run/weights/a", {"adapter_model.safetensors": b"one", "optimizer.safetensors": b"o"})
    assert ("://" in location) == (kind != "local")
    assert read(storage, location) == {"adapter_model.safetensors": b"one", "optimizer.safetensors": b"o"}
    with storage.open(location, None) as folder:
        manifest = (folder / MANIFEST).read_bytes()
    assert storage.size(location) == 4 + len(manifest)
    # Overwriting replaces the whole checkpoint: a file the new one lacks is gone.
    assert write(storage, "t/run/weights/a", {"adapter_model.safetensors": b"two"}) == location
    assert read(storage, location) == {"adapter_model.safetensors": b"two"}
    storage.delete(location)
    with pytest.raises(Exception):
        read(storage, location)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_write_leaves_the_old_checkpoint_whole(tmp_path, kind):
    storage = store(tmp_path, kind)
    location = write(storage, "t/run/weights/a", {"adapter_model.safetensors": b"good"})
    with pytest.raises(RuntimeError):
        with storage.writing("t/run/weights/a") as (folder, located):
            folder.mkdir()
            (folder / "adapter_model.safetensors").write_bytes(b"half")
            raise RuntimeError("the engine failed mid-save")
    assert not located
    assert read(storage, location) == {"adapter_model.safetensors": b"good"}
    if kind != "local":
        fs, root = fsspec.core.url_to_fs(storage.url)
        assert [p for p in fs.find(root) if ".tmp-" in p] == []
    else:
        assert list((tmp_path / "local" / ".staging").iterdir()) == []


def test_sealed_checkpoints_open_only_with_the_key(tmp_path):
    storage = store(tmp_path, "memory")
    with storage.writing("t/run/weights/s") as (folder, located):
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"secret weights")
        crypto.seal(folder, "k1")
    fs, path = fsspec.core.url_to_fs(located[0])
    stored = [p for p in fs.ls(path, detail=False) if not p.endswith(MANIFEST)]  # the manifest holds checksums only
    assert stored and all(fs.cat_file(p).startswith(crypto.MAGIC) for p in stored)
    assert read(storage, located[0], "k1") == {"adapter_model.safetensors": b"secret weights"}
    with pytest.raises(Exception, match="is encrypted"):
        read(storage, located[0])
    with pytest.raises(Exception, match="cannot be decrypted"):
        read(storage, located[0], "k2")
