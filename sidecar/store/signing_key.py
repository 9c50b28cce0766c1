"""The sidecar's summary signing key: an Ed25519 key pair whose public half a gate trusts.

A promotion gate (``deadweight inspect --trust-key FILE``) runs where the sidecar's state dir
is not, so the summary is signed with an asymmetric key: the private half stays in the state
dir (``summary-signing.key``, created 0600 at the first start, refused when another uid owns
it or when group or others may read it), the public half is written beside it
(``summary-signing.pub``, PEM) for the operator to hand to CI. Without a state dir the key
lives for the process only and its public half is written beside the socket.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import structlog
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

log = structlog.get_logger("deadweight.signing")

KEY_NAME = "summary-signing.key"
PUBLIC_NAME = "summary-signing.pub"


class KeyUnsafe(PermissionError):
    """The private key file could be read or replaced by someone other than the sidecar."""


class BadKey(ValueError):
    """A key file that is not an Ed25519 key in PEM."""


def key_id(public: Ed25519PublicKey) -> str:
    """Which key signed: the first 16 hex characters of SHA-256 over the raw public key."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_pem(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.PEM,
                               serialization.PublicFormat.SubjectPublicKeyInfo)


def load_public(path: Path) -> Ed25519PublicKey:
    """A trusted public key from a PEM file (``--trust-key``); raises BadKey or OSError."""
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except ValueError as err:
        raise BadKey(f"{path}: not a PEM public key ({err})") from err
    if not isinstance(key, Ed25519PublicKey):
        raise BadKey(f"{path}: not an Ed25519 public key")
    return key


def verifies(public: Ed25519PublicKey, body: bytes, signature: bytes) -> bool:
    try:
        public.verify(signature, body)
    except InvalidSignature:
        return False
    return True


def _load_private(path: Path) -> Ed25519PrivateKey:
    info = path.lstat()
    if not stat.S_ISREG(info.st_mode):
        raise KeyUnsafe(f"{path} is not a regular file")
    if info.st_uid != os.geteuid():
        raise KeyUnsafe(f"{path} belongs to uid {info.st_uid}, not to the sidecar's "
                        f"uid {os.geteuid()}: whoever owns it could sign summaries")
    if info.st_mode & 0o077:
        raise KeyUnsafe(f"{path} has mode {stat.S_IMODE(info.st_mode):o}: group or others "
                        "may read the signing key (chmod 600 it, or delete it for a new key)")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except ValueError as err:
        raise BadKey(f"{path}: not a PEM private key ({err})") from err
    if not isinstance(key, Ed25519PrivateKey):
        raise BadKey(f"{path}: not an Ed25519 private key")
    return key


def _create_private(path: Path) -> Ed25519PrivateKey:
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never wider, never twice
    try:
        os.write(fd, pem)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


class SummarySigner:
    """Signs run summaries with the sidecar's key."""

    def __init__(self, key: Ed25519PrivateKey, public_path: Path | None = None) -> None:
        self._key = key
        self.public = key.public_key()
        self.key_id = key_id(self.public)
        #: Where the public half was written (None: nowhere).
        self.public_path = public_path

    @classmethod
    def in_folder(cls, folder: Path, persistent: bool) -> SummarySigner:
        """The key of folder (created at the first start) when persistent, else a fresh one;
        the public half is written into folder either way."""
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if persistent:
            path = folder / KEY_NAME
            key = _load_private(path) if path.exists() else _create_private(path)
            public_path = folder / PUBLIC_NAME
        else:
            key = Ed25519PrivateKey.generate()
            public_path = folder / PUBLIC_NAME
        tmp = public_path.with_name(public_path.name + f".tmp-{os.getpid()}")
        tmp.write_bytes(public_pem(key.public_key()))
        os.chmod(tmp, 0o644)
        tmp.replace(public_path)
        signer = cls(key, public_path)
        log.info("summary_signing_key", public_key=str(public_path), key_id=signer.key_id,
                 persistent=persistent,
                 note="give this file to `deadweight inspect --trust-key`"
                 + ("" if persistent else "; no --state-dir: the key lasts for this process"))
        return signer

    def sign(self, body: bytes) -> bytes:
        return self._key.sign(body)
