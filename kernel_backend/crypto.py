"""Encryption at rest of checkpoint files, with a key the operator supplies (STEPWISE_ENCRYPTION_KEY).

Each file of a checkpoint folder is sealed with AES-256-GCM (the key is the SHA-256 of the
operator's secret; a fresh nonce per file; the tag authenticates it). The engine reads and
writes plain folders: the service seals a folder after saving it and opens a temporary
plain copy to load from. Without the key an encrypted checkpoint cannot be read.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from kernel_backend.types import UserError

# The checkpoint's manifest (kernel_backend/storage.py): checksums of the files as stored, so it is
# written after sealing and is never sealed itself.
MANIFEST = "manifest.json"
MAGIC = b"SWENC01\n"


def _aead(secret: str):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(hashlib.sha256(secret.encode()).digest())


def _sealable(directory: Path) -> list[Path]:
    """The files sealing covers: all but the checkpoint's manifest, which holds only their checksums."""
    return [p for p in Path(directory).iterdir() if p.is_file() and p.name != MANIFEST]


def is_sealed(directory: Path) -> bool:
    files = _sealable(directory)
    return bool(files) and all(_starts_with_magic(p) for p in files)


def _starts_with_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def seal(directory: Path, secret: str) -> None:
    """Encrypt every file of `directory` in place (each written to a temporary name, then renamed)."""
    aead = _aead(secret)
    for path in _sealable(directory):
        nonce = os.urandom(12)
        sealed = MAGIC + nonce + aead.encrypt(nonce, path.read_bytes(), path.name.encode())
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(sealed)
        tmp.replace(path)


@contextlib.contextmanager
def opened(directory: Path, secret: str | None, name: str | None = None, scratch: Path | None = None):
    """A plain view of a checkpoint folder: itself when not sealed, else a decrypted copy in `scratch`
    (a new temporary folder if None; removed afterwards). Errors call the checkpoint `name`."""
    directory = Path(directory)
    name = name or directory.name
    if not is_sealed(directory):
        yield directory
        return
    plain = Path(scratch) if scratch is not None else Path(tempfile.mkdtemp(prefix="stepwise-open-"))
    try:
        if not secret:
            raise UserError(f"checkpoint {name} is encrypted; start the backend with STEPWISE_ENCRYPTION_KEY set to its key")
        from cryptography.exceptions import InvalidTag

        aead = _aead(secret)
        for path in _sealable(directory):
            blob = path.read_bytes()
            try:
                data = aead.decrypt(blob[len(MAGIC): len(MAGIC) + 12], blob[len(MAGIC) + 12:], path.name.encode())
            except InvalidTag:
                raise UserError(f"checkpoint {name} cannot be decrypted with this STEPWISE_ENCRYPTION_KEY") from None
            (plain / path.name).write_bytes(data)
        yield plain
    finally:
        shutil.rmtree(plain, ignore_errors=True)
