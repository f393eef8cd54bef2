"""The checkpoint store (kernel_backend/persistence/checkpoint_storage.py): a local folder or any fsspec URL, written atomically.

`memory://` is fsspec's in-process filesystem; `s3` is a real S3-compatible server (moto's, tests/s3_server.py)
through s3fs, configured as STEPWISE_STORAGE_OPTIONS would (endpoint and keys as fsspec options). The server-level
tests: test_storage_s3 (a backend on S3) and test_durability (sealed checkpoints in a file:// store).
"""

from __future__ import annotations

import uuid

import fsspec
import pytest

from kernel_backend.persistence import crypto
from kernel_backend.persistence.checkpoint_storage import MANIFEST, CheckpointStorage, StoreError
from s3_server import s3_server  # noqa: F401  (a fixture)


KINDS = ["local", "memory", "file-url", "s3"]


@pytest.fixture
def s3(request):
    return request.getfixturevalue("s3_server") if "s3" in request.node.name else None


def store(tmp_path, kind: str, s3=None) -> CheckpointStorage:
    """The default local folder, or an fsspec URL: memory:// (an object store's semantics, no folders),
    file:// (a filesystem with folders, through the same fsspec code path) or s3:// on moto's server."""
    if kind == "local":
        return CheckpointStorage(tmp_path / "local")
    if kind == "s3":
        options = {"endpoint_url": s3.endpoint, "key": "testing", "secret": "testing"}
        return CheckpointStorage(tmp_path / "unused", s3.url(f"ckpt-{uuid.uuid4().hex[:8]}"), options)
    url = f"memory://ckpt-{uuid.uuid4().hex}" if kind == "memory" else f"file://{tmp_path / 'url-store'}"
    return CheckpointStorage(tmp_path / "unused", url)


def write(storage: CheckpointStorage, key: str, files: dict[str, bytes]) -> str:
    with storage.writing(key) as (folder, located):
        folder.mkdir()
        for name, data in files.items():
            (folder / name).write_bytes(data)
    return located[0]


def read(storage: CheckpointStorage, location: str, secret: str | tuple[str, ...] | None = None) -> dict[str, bytes]:
    """The checkpoint's files (its manifest of checksums left out)."""
    with storage.open(location, secret) as folder:
        return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != MANIFEST}


@pytest.mark.parametrize("kind", KINDS)
def test_write_read_overwrite_delete(tmp_path, kind, s3):
    storage = store(tmp_path, kind, s3)
    location = write(storage, "t/run/weights/a", {"adapter_model.safetensors": b"one", "optimizer.safetensors": b"o"})
    assert ("://" in location) == (kind != "local")
    assert read(storage, location) == {"adapter_model.safetensors": b"one", "optimizer.safetensors": b"o"}
    with storage.open(location, None) as folder:
        manifest = (folder / MANIFEST).read_bytes()
    assert storage.size(location) == 4 + len(manifest)
    # Overwriting replaces the whole checkpoint: a file the new one lacks is gone.
    assert write(storage, "t/run/weights/a", {"adapter_model.safetensors": b"two"}) == location
    assert read(storage, location) == {"adapter_model.safetensors": b"two"}
    if kind != "local":  # the old generation went with the overwrite: one manifest, one file
        assert len(storage.fs.find(storage.root)) == 2, storage.fs.find(storage.root)
    storage.delete(location)
    assert not storage.exists("t/run/weights/a")
    with pytest.raises(Exception, match="no files in the store"):
        read(storage, location)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_write_leaves_the_old_checkpoint_whole(tmp_path, kind, s3):
    storage = store(tmp_path, kind, s3)
    location = write(storage, "t/run/weights/a", {"adapter_model.safetensors": b"good"})
    with pytest.raises(RuntimeError):
        with storage.writing("t/run/weights/a") as (folder, located):
            folder.mkdir()
            (folder / "adapter_model.safetensors").write_bytes(b"half")
            raise RuntimeError("the engine failed mid-save")
    assert not located
    assert read(storage, location) == {"adapter_model.safetensors": b"good"}
    if kind != "local":
        assert [p for p in storage.fs.find(storage.root) if ".tmp-" in p] == []
    else:
        assert list((tmp_path / "local" / ".staging").iterdir()) == []


def test_sealed_checkpoints_open_only_with_the_key(tmp_path):
    storage = store(tmp_path, "memory")
    with storage.writing("t/run/weights/s") as (folder, located):
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"secret weights")
        crypto.seal(folder, "k1")
    fs, path = fsspec.core.url_to_fs(located[0])
    stored = [p for p in fs.find(path) if not p.endswith(MANIFEST)]  # the manifest holds checksums only
    assert stored and all(fs.cat_file(p).startswith(crypto.MAGIC2) for p in stored)
    assert read(storage, located[0], "k1") == {"adapter_model.safetensors": b"secret weights"}
    with pytest.raises(Exception, match="is encrypted"):
        read(storage, located[0])
    with pytest.raises(Exception, match="cannot be decrypted"):
        read(storage, located[0], "k2")


def test_a_rotated_key_still_opens_the_checkpoints_sealed_with_the_old_one(tmp_path, monkeypatch):
    """STEPWISE_ENCRYPTION_KEY=new with STEPWISE_ENCRYPTION_OLD_KEYS=old: a checkpoint sealed with the old key and one
    sealed with the new open; without the old key the old one is refused, naming both settings."""
    from kernel_backend.config import Settings

    storage, locations = store(tmp_path, "memory"), {}
    for name, key in (("old", "k-old"), ("new", "k-new")):
        with storage.writing(f"t/run/weights/{name}") as (folder, located):
            folder.mkdir()
            (folder / "adapter_model.safetensors").write_bytes(f"{name} weights".encode())
            (folder / "optimizer.pt").write_bytes(f"{name} moments".encode())
            crypto.seal(folder, key)
        locations[name] = located[0]
    monkeypatch.setenv("STEPWISE_ENCRYPTION_KEY", "k-new")
    monkeypatch.setenv("STEPWISE_ENCRYPTION_OLD_KEYS", "k-older, k-old")
    keys = Settings().decryption_keys
    assert keys == ("k-new", "k-older", "k-old")
    for name, location in locations.items():
        assert read(storage, location, keys) == {"adapter_model.safetensors": f"{name} weights".encode(),
                                                 "optimizer.pt": f"{name} moments".encode()}
    with pytest.raises(Exception, match="cannot be decrypted with STEPWISE_ENCRYPTION_KEY or STEPWISE_ENCRYPTION_OLD_KEYS"):
        read(storage, locations["old"], ("k-new", "k-older"))


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_an_upload_cut_before_its_manifest_is_no_checkpoint_and_is_cleaned_once_stale(tmp_path, kind, s3, monkeypatch):
    """A crash mid-upload (here: the manifest's PUT fails) leaves a generation no manifest names: readers still see
    the old checkpoint whole, a new key is no checkpoint at all, and clean_staging deletes the leftovers only once
    they are older than its age (a fresh one may be another process's upload in progress)."""
    storage = store(tmp_path, kind, s3)
    old = write(storage, "t/run/weights/a", {"adapter_model.safetensors": b"good"})
    real_pipe = storage.fs.pipe_file

    def crash(path, *args, **kwargs):
        raise ConnectionError("the store went away")

    monkeypatch.setattr(storage.fs, "pipe_file", crash)
    for key in ("t/run/weights/a", "t/run/weights/new"):
        with pytest.raises(StoreError, match="the store went away.*nothing was replaced"):
            write(storage, key, {"adapter_model.safetensors": b"half"})
    monkeypatch.setattr(storage.fs, "pipe_file", real_pipe)
    assert read(storage, old) == {"adapter_model.safetensors": b"good"}
    assert not storage.exists("t/run/weights/new")
    with pytest.raises(Exception, match="no files in the store"):
        read(storage, old.replace("/a", "/new"))
    generations = [p for p in storage.fs.find(storage.root) if "/g-" in p]
    assert len(generations) == 3  # the good generation's file, and one file of each cut upload
    assert storage.clean_staging() == 0  # fresh: left alone
    assert storage.clean_staging(older_than_s=0) == 2
    assert read(storage, old) == {"adapter_model.safetensors": b"good"}
    assert len(storage.fs.find(storage.root)) == 2  # the good checkpoint's manifest and file


@pytest.mark.parametrize("kind", ["memory", "file-url", "s3"])
def test_clean_up_deletes_only_leftovers_even_of_checkpoints_named_like_them(tmp_path, kind, s3):
    """Checkpoint names may look like a generation (g-<16 hex>); the old layout's cut uploads (<key>.tmp-<hex>/,
    manifest inside) and a generation no manifest names are leftovers; checkpoints are not, however old."""
    storage = store(tmp_path, kind, s3)

    def put(path: str, data: bytes) -> None:
        storage.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)  # (a file:// store has folders)
        storage.fs.pipe_file(path, data)

    named_like_a_generation = write(storage, "t/run/weights/g-0123456789abcdef", {"w.safetensors": b"mine"})
    legacy_named_like_an_upload = f"{storage.root}/t/run/weights/b.tmp-0123abcd"
    upload = write(storage, "t/run/weights/b.tmp-0123abcd", {"w.safetensors": b"mine too"})  # a v2 checkpoint
    cut = f"{storage.root}/t/run/weights/c.tmp-89abcdef"  # what the old layout left where its move failed
    put(f"{cut}/w.safetensors", b"half")
    put(f"{cut}/{MANIFEST}", b'{"version": 1, "sha256": {}}')
    orphan = f"{storage.root}/t/run/weights/d/g-{'f' * 16}/w.safetensors"  # a new key's generation, no manifest
    put(orphan, b"half")
    assert storage.clean_staging(older_than_s=0) == 3
    left = set(storage.fs.find(storage.root))
    assert not [p for p in left if p.startswith((cut, orphan))], left
    assert read(storage, named_like_a_generation) == {"w.safetensors": b"mine"}
    assert read(storage, upload) == {"w.safetensors": b"mine too"}
    assert storage.fs.exists(f"{legacy_named_like_an_upload}/{MANIFEST}")
    assert storage.clean_staging(older_than_s=0) == 0


@pytest.mark.parametrize("kind", ["memory", "s3"])
def test_a_checkpoint_stored_before_generations_still_loads_and_is_replaced_cleanly(tmp_path, kind, s3):
    """The layout before generations: files beside a version-1 manifest, as the earlier releases uploaded them."""
    import json

    storage = store(tmp_path, kind, s3)
    folder = f"{storage.root}/t/run/weights/legacy"
    storage.fs.pipe_file(f"{folder}/adapter_model.safetensors", b"old layout")
    digest = __import__("hashlib").sha256(b"old layout").hexdigest()
    version_1 = {"version": 1, "sha256": {"adapter_model.safetensors": digest}}
    storage.fs.pipe_file(f"{folder}/{MANIFEST}", json.dumps(version_1).encode())
    location = storage.fs.unstrip_protocol(folder)
    assert storage.exists("t/run/weights/legacy") and storage.files(location) == ["adapter_model.safetensors"]
    assert read(storage, location) == {"adapter_model.safetensors": b"old layout"}
    write(storage, "t/run/weights/legacy", {"adapter_model.safetensors": b"new layout"})
    assert read(storage, location) == {"adapter_model.safetensors": b"new layout"}
    assert len(storage.fs.find(folder)) == 2  # the old files beside the manifest are gone


def test_the_store_killed_mid_upload_fails_the_save_clearly_and_leaves_no_checkpoint(
        tmp_path, s3_server, monkeypatch):  # noqa: F811
    """moto killed after a checkpoint's first file went up: the save fails with an error naming the store and the fix,
    and once a store is back the key is no checkpoint; a save then works. (moto keeps its data in memory, so a
    restarted one is empty: what can be checked after the restart is that nothing is taken for the cut save.)
    botocore's retries are cut short through the filesystem's options, as STEPWISE_STORAGE_OPTIONS can."""
    options = {"endpoint_url": s3_server.endpoint, "key": "testing", "secret": "testing",
               "config_kwargs": {"connect_timeout": 2, "read_timeout": 5, "retries": {"total_max_attempts": 1}}}
    storage = CheckpointStorage(tmp_path / "unused", s3_server.url(f"ckpt-{uuid.uuid4().hex[:8]}"), options)
    put_file = storage.fs.put_file

    def put_then_kill(lpath, rpath, **kwargs):
        put_file(lpath, rpath, **kwargs)
        s3_server.stop()

    monkeypatch.setattr(storage.fs, "put_file", put_then_kill)
    with pytest.raises(StoreError, match="could not be written to the checkpoint store s3://.*nothing was replaced.*"
                                         "Check that the store is reachable"):
        write(storage, "t/run/weights/cut", {"adapter_model.safetensors": b"x", "optimizer.safetensors": b"y"})
    monkeypatch.setattr(storage.fs, "put_file", put_file)
    s3_server.restart()
    assert not storage.exists("t/run/weights/cut")
    location = write(storage, "t/run/weights/cut", {"adapter_model.safetensors": b"whole"})
    assert read(storage, location) == {"adapter_model.safetensors": b"whole"}


SEAL_AND_OPEN = """
import resource, sys
from pathlib import Path
from kernel_backend.persistence import crypto
folder, size = Path(sys.argv[1]), int(sys.argv[2])
with open(folder / "model.safetensors", "wb") as f:
    for _ in range(size // (1 << 20)):
        f.write(bytes(range(256)) * 4096)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
crypto.seal(folder, "k")
with crypto.opened(folder, "k") as plain:
    same = (plain / "model.safetensors").stat().st_size == size
print(same, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_sealing_and_opening_stream_in_bounded_memory(tmp_path):
    """A file 24 chunks long seals and opens with the process's peak memory growing by about two chunks, not by the
    file (a full fine-tune's checkpoint is GBs)."""
    import subprocess
    import sys

    size = 24 * crypto.CHUNK
    run = subprocess.run([sys.executable, "-c", SEAL_AND_OPEN, str(tmp_path), str(size)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    same, grown_mb = run.stdout.split()
    assert same == "True"
    assert int(grown_mb) < 4 * crypto.CHUNK >> 20, f"peak memory grew {grown_mb} MB sealing a {size >> 20} MB file"


def test_sealed_chunks_cannot_be_cut_swapped_or_reordered_and_the_first_format_still_opens(tmp_path, monkeypatch):
    import os

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    monkeypatch.setattr(crypto, "CHUNK", 64)
    data = os.urandom(64 * 3 + 10)
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "w.safetensors").write_bytes(data)
    crypto.seal(folder, "k")
    sealed = (folder / "w.safetensors").read_bytes()
    with crypto.opened(folder, "k") as plain:
        assert (plain / "w.safetensors").read_bytes() == data
    header, size = len(crypto.MAGIC2) + 8, 64 + crypto.TAG
    chunks = [sealed[header + i * size: header + (i + 1) * size] for i in range(4)]
    for tampered in (sealed[: header + 3 * size],  # the last chunk dropped: the third was not sealed as last
                     sealed[:header] + chunks[1] + chunks[0] + chunks[2] + chunks[3]):  # two chunks swapped
        (folder / "w.safetensors").write_bytes(tampered)
        with pytest.raises(Exception, match="cannot be decrypted"):
            with crypto.opened(folder, "k"):
                pass
    # A file sealed whole by the earlier releases (SWENC01: one nonce, the name as associated data) opens.
    nonce = os.urandom(12)
    aead = AESGCM(__import__("hashlib").sha256(b"k").digest())
    (folder / "w.safetensors").write_bytes(crypto.MAGIC + nonce + aead.encrypt(nonce, data, b"w.safetensors"))
    with crypto.opened(folder, "k") as plain:
        assert (plain / "w.safetensors").read_bytes() == data


def test_storage_options_that_are_no_json_object_stop_the_start_naming_the_variable_not_its_secret(tmp_path):
    from kernel_backend.config import Settings, SettingError

    for bad in ('{"secret": "hunter2"', '["hunter2"]'):
        with pytest.raises(SettingError, match="STEPWISE_STORAGE_OPTIONS=.* is not a JSON object") as refused:
            Settings(home=tmp_path, storage_options=bad)
        assert "hunter2" not in str(refused.value)
    options = '{"endpoint_url": "http://127.0.0.1:9", "key": "k"}'
    assert Settings(home=tmp_path, storage_options=options).storage_fs_options == {"endpoint_url": "http://127.0.0.1:9",
                                                                                   "key": "k"}
