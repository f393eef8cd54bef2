"""Encryption at rest of checkpoint files, with a key the operator supplies (STEPWISE_ENCRYPTION_KEY);
and age encryption of exported weights to the recipients a user names (save_weights_external).

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

from kernel_backend.errors import UserError

# The checkpoint's manifest (kernel_backend/persistence/checkpoint_storage.py): checksums of the files as stored, so it is
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


# ---- age encryption of exported weights (save_weights_external) ---------------------------------------

# The SDK allows at most this many recipients.
MAX_AGE_RECIPIENTS = 10
AGE_SUFFIX = ".age"


def age_recipients(recipients) -> list:
    """Parse age recipients (native `age1...` keys or SSH public keys); UserError naming a bad one."""
    import pyrage

    if not isinstance(recipients, list) or not 1 <= len(recipients) <= MAX_AGE_RECIPIENTS:
        raise UserError(f"age_encryption_recipients must be a list of 1 to {MAX_AGE_RECIPIENTS} recipients, "
                        "or null for no encryption")
    parsed = []
    for text in recipients:
        kind = pyrage.x25519 if isinstance(text, str) and text.startswith("age1") else pyrage.ssh
        try:
            parsed.append(kind.Recipient.from_str(text if isinstance(text, str) else ""))
        except Exception:
            shown = repr(text) if len(repr(text)) <= 80 else repr(text)[:77] + "..."
            raise UserError(f"age recipient {shown} is neither an age public key (age1...) nor an SSH public key "
                            "(ssh-ed25519 ... or ssh-rsa ...)") from None
    return parsed


def age_encrypt_folder(directory: Path, recipients: list) -> None:
    """Encrypt every file of `directory` to the parsed `recipients`, as `<name>.age` (decrypt with
    `age -d -i <identity>`), removing the plain files."""
    import pyrage

    for path in sorted(p for p in Path(directory).iterdir() if p.is_file()):
        path.with_name(path.name + AGE_SUFFIX).write_bytes(pyrage.encrypt(path.read_bytes(), recipients))
        path.unlink()
