"""Encryption at rest of checkpoint files, with a key the operator supplies (STEPWISE_ENCRYPTION_KEY);
and age encryption of exported weights to the recipients a user names (save_weights_external).

Each file of a checkpoint folder is sealed with AES-256-GCM (the key is the SHA-256 of the
operator's secret), in chunks of CHUNK bytes so that memory stays bounded whatever the file's size
(a full fine-tune's checkpoint is GBs): a file is `MAGIC2 + an 8-byte random nonce prefix`, then each
chunk's ciphertext and tag. A chunk's nonce is the prefix and its index; its associated data is the
file's name, its index and whether it is the last, so chunks cannot be reordered, dropped, swapped
between files, or the file cut at a chunk boundary without the tag failing. Files sealed whole in the
first format (MAGIC, one nonce per file) still open. The engine reads and writes plain folders: the
service seals a folder after saving it and opens a temporary plain copy to load from. Without the key
an encrypted checkpoint cannot be read.
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
MAGIC = b"SWENC01\n"  # the first format: a whole file in one AES-GCM message (read, never written now)
MAGIC2 = b"SWENC02\n"  # chunked: see the module docstring
CHUNK = 4 << 20  # plaintext bytes per chunk
TAG = 16  # AES-GCM's tag, after each chunk's ciphertext


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
        return f.read(len(MAGIC)) in (MAGIC, MAGIC2)


def _chunk_data(name: str, index: int, last: bool) -> bytes:
    return name.encode() + b"\0" + index.to_bytes(8, "big") + (b"\1" if last else b"\0")


def seal(directory: Path, secret: str) -> None:
    """Encrypt every file of `directory` in place, chunk by chunk (each written to a temporary name, then renamed)."""
    aead = _aead(secret)
    for path in _sealable(directory):
        prefix, size = os.urandom(8), path.stat().st_size
        chunks = max(1, -(-size // CHUNK))  # an empty file is one empty chunk
        tmp = path.with_name(f".{path.name}.tmp")
        with open(path, "rb") as plain, open(tmp, "wb") as sealed:
            sealed.write(MAGIC2 + prefix)
            for index in range(chunks):
                nonce = prefix + index.to_bytes(4, "big")
                sealed.write(aead.encrypt(nonce, plain.read(CHUNK), _chunk_data(path.name, index, index == chunks - 1)))
        tmp.replace(path)


def _open_file(aead, path: Path, target: Path) -> None:
    """Decrypt one sealed file into `target`; InvalidTag where anything about it was changed."""
    with open(path, "rb") as sealed:
        magic = sealed.read(len(MAGIC))
        if magic == MAGIC:  # the first format: one message (small files only were ever sealed so, read whole)
            blob = sealed.read()
            target.write_bytes(aead.decrypt(blob[:12], blob[12:], path.name.encode()))
            return
        prefix = sealed.read(8)
        body = path.stat().st_size - len(MAGIC2) - 8
        chunks = max(1, -(-body // (CHUNK + TAG)))
        with open(target, "wb") as plain:
            for index in range(chunks):
                nonce = prefix + index.to_bytes(4, "big")
                plain.write(aead.decrypt(nonce, sealed.read(CHUNK + TAG), _chunk_data(path.name, index,
                                                                                   index == chunks - 1)))


@contextlib.contextmanager
def opened(directory: Path, secret: str | tuple[str, ...] | None, name: str | None = None,
           scratch: Path | None = None):
    """A plain view of a checkpoint folder: itself when not sealed, else a decrypted copy in `scratch`
    (a new temporary folder if None; removed afterwards). `secret`: the key, or the keys to try, the current one first
    (Settings.decryption_keys: a rotated key's old checkpoints open with the old one). Errors call the checkpoint
    `name`."""
    directory = Path(directory)
    name = name or directory.name
    if not is_sealed(directory):
        yield directory
        return
    keys = (secret,) if isinstance(secret, str) else tuple(secret or ())
    keys = tuple(k for k in keys if k)
    plain = Path(scratch) if scratch is not None else Path(tempfile.mkdtemp(prefix="stepwise-open-"))
    try:
        if not keys:
            raise UserError(f"checkpoint {name} is encrypted; start the backend with STEPWISE_ENCRYPTION_KEY set to its key")
        from cryptography.exceptions import InvalidTag

        files, aead = _sealable(directory), None
        for candidate in map(_aead, keys):  # the key its first file opens with opens them all (one seal() sealed it)
            try:
                _open_file(candidate, files[0], plain / files[0].name)
            except InvalidTag:
                continue
            aead = candidate
            break
        if aead is None:
            raise UserError(f"checkpoint {name} cannot be decrypted with STEPWISE_ENCRYPTION_KEY"
                            + (" or STEPWISE_ENCRYPTION_OLD_KEYS" if len(keys) > 1 else "")
                            + " (sealed with another key, or its files were changed)")
        for path in files[1:]:
            try:
                _open_file(aead, path, plain / path.name)
            except InvalidTag:
                raise UserError(f"checkpoint {name} cannot be decrypted: its file {path.name} was changed") from None
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
