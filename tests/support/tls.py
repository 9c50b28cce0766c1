"""A self-signed certificate for the TCP+TLS tests, made with openssl on the spot."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) in folder: self-signed for localhost and 127.0.0.1, valid 2 days."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    return cert, key
