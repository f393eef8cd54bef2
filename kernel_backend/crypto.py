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

MAGIC = b"SWENC01\n"


def _aead(secret: str):
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(hashlib.sha256(secret.encode()).digest())


def is_sealed(directory: Path) -> bool:
    files = [p for p in Path(directory).iterdir() if p.is_file()]
    return bool(files) and all(p.read_bytes()[: len(MAGIC)] == MAGIC for p in files)


def seal(directory: Path, secret: str) -> None:
    """Encrypt every file of `directory` in place (each written to a temporary name, then renamed)."""
    aead = _aead(secret)
    for path in Path(directory).iterdir():
        if not path.is_file():
            continue
        nonce = os.urandom(12)
        sealed = MAGIC + nonce + aead.encrypt(nonce, path.read_bytes(), path.name.encode())
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(sealed)
        tmp.replace(path)


@contextlib.contextmanager
def opened(directory: Path, secret: str | None):
    """A plain view of a checkpoint folder: itself when not sealed, else a decrypted temporary copy."""
    directory = Path(directory)
    if not is_sealed(directory):
        yield directory
        return
    if not secret:
        raise UserError(f"checkpoint {directory.name} is encrypted; start the backend with STEPWISE_ENCRYPTION_KEY set to its key")
    from cryptography.exceptions import InvalidTag

    aead = _aead(secret)
    plain = Path(tempfile.mkdtemp(prefix="stepwise-open-"))
    try:
        for path in directory.iterdir():
            blob = path.read_bytes()
            try:
                data = aead.decrypt(blob[len(MAGIC): len(MAGIC) + 12], blob[len(MAGIC) + 12:], path.name.encode())
            except InvalidTag:
                raise UserError(f"checkpoint {directory.name} cannot be decrypted with this STEPWISE_ENCRYPTION_KEY") from None
            (plain / path.name).write_bytes(data)
        yield plain
    finally:
        shutil.rmtree(plain, ignore_errors=True)
