"""Self-signed certificates for the TLS tests, made with the openssl command.

Without openssl the TLS tests skip locally; in CI (``CI`` set) they fail
instead, so a missing tool can never pass for a tested feature.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["self_signed"]


def self_signed(folder: Path, name: str, alt_name: str) -> tuple[Path, Path]:
    """A certificate and key for ``name`` (CN), valid for ``alt_name`` (``DNS:host`` or ``IP:addr``)."""
    if shutil.which("openssl") is None:
        if os.environ.get("CI"):
            pytest.fail("openssl is needed to make the TLS tests' certificate")
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}"]
        + ["-addext", f"subjectAltName={alt_name}"],
        check=True,
        capture_output=True,
    )
    return cert, key
