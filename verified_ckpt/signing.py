"""Tamper evidence: HMAC-SHA256 signatures over records' canonical JSON.

With a key configured (``VCKPT_SIGNING_KEY``, or a file named by
``VCKPT_SIGNING_KEY_FILE``), every manifest and every record (incident,
verification, rollback) carries ``"signature": {"alg", "key_id", "mac"}``
over the canonical JSON of everything else in it. Without a key they carry
``"signature": null`` and are reported as unsigned.

The rule readers apply: a record that cannot be verified never makes
anything more trusted. A manifest with a missing or wrong signature is
``corrupt``; such a verification record counts as a failed verification;
such an incident still marks its interval; such a rollback answers nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Any

from .errors import InvalidState
from .jsonx import canonical_json

ENV_KEY = "VCKPT_SIGNING_KEY"
ENV_KEY_FILE = "VCKPT_SIGNING_KEY_FILE"
MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096
ALG = "HMAC-SHA256"


class Signature(str, enum.Enum):
    """What a reader can say about a record's signature."""

    VALID = "valid"  # a key is configured and the MAC matches
    UNSIGNED = "unsigned"  # no key configured, no signature: nothing is claimed
    UNCHECKED = "unchecked"  # signed, but no key is configured to check it
    MISSING = "missing"  # a key is configured, the record is unsigned
    INVALID = "invalid"  # a key is configured and the MAC (or key id) does not match

    def __str__(self) -> str:
        return self.value

    @property
    def trusted(self) -> bool:
        """False only where a configured key rejects the record."""
        return self not in (Signature.MISSING, Signature.INVALID)


@dataclasses.dataclass(frozen=True)
class Signer:
    """Signs and checks records with one key (or none)."""

    key: bytes | None = dataclasses.field(default=None, repr=False)

    @staticmethod
    def of(key: bytes) -> Signer:
        """A signer with an explicit key.

        Raises:
            InvalidState: the key is shorter than :data:`MIN_KEY_BYTES`.
        """
        if len(key) < MIN_KEY_BYTES:
            raise InvalidState(f"signing_key is shorter than {MIN_KEY_BYTES} bytes; use a random key of 32 bytes or more")
        return Signer(bytes(key))

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> Signer:
        """The key from ``VCKPT_SIGNING_KEY`` or ``VCKPT_SIGNING_KEY_FILE`` (neither: no key).

        Raises:
            InvalidState: both are set, the file cannot be read, or the key is too short.
                Messages name the variable, never the key.
        """
        env = os.environ if environ is None else environ
        inline, path = env.get(ENV_KEY), env.get(ENV_KEY_FILE)
        if inline and path:
            raise InvalidState(f"both {ENV_KEY} and {ENV_KEY_FILE} are set; unset one of them")
        if path:
            try:
                with open(path, "rb") as f:
                    key = f.read(MAX_KEY_FILE_BYTES + 1)
            except OSError as e:
                raise InvalidState(f"cannot read the signing key file named by {ENV_KEY_FILE} ({e.strerror}); "
                                   "fix the path or its permissions") from None
            if len(key) > MAX_KEY_FILE_BYTES:
                raise InvalidState(f"the file named by {ENV_KEY_FILE} is larger than {MAX_KEY_FILE_BYTES} bytes; "
                                   "it should hold only the key")
            key = key.strip()
            source = ENV_KEY_FILE
        elif inline:
            key, source = inline.encode(), ENV_KEY
        else:
            return Signer(None)
        if len(key) < MIN_KEY_BYTES:
            raise InvalidState(f"the signing key from {source} is shorter than {MIN_KEY_BYTES} bytes; "
                               "use a random key of 32 bytes or more (e.g. `openssl rand -hex 32`)")
        return Signer(key)

    @property
    def key_id(self) -> str | None:
        """A short public name of the key (not derivable back to it), to tell keys apart."""
        if self.key is None:
            return None
        return hashlib.sha256(b"verified-ckpt key id\0" + self.key).hexdigest()[:16]

    def _mac(self, record: Mapping[str, Any]) -> str:
        assert self.key is not None
        body = {k: v for k, v in record.items() if k != "signature"}
        return hmac.new(self.key, canonical_json(body), hashlib.sha256).hexdigest()

    def seal(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """``record`` with its ``signature`` field set (``None`` without a key)."""
        out = {k: v for k, v in record.items() if k != "signature"}
        out["signature"] = None if self.key is None else {"alg": ALG, "key_id": self.key_id, "mac": self._mac(out)}
        return out

    def check(self, record: Mapping[str, Any]) -> Signature:
        sig = record.get("signature")
        if self.key is None:
            return Signature.UNSIGNED if sig is None else Signature.UNCHECKED
        if sig is None:
            return Signature.MISSING
        if not (isinstance(sig, dict) and sig.get("alg") == ALG and sig.get("key_id") == self.key_id
                and isinstance(sig.get("mac"), str)):
            return Signature.INVALID
        try:
            return Signature.VALID if hmac.compare_digest(sig["mac"], self._mac(record)) else Signature.INVALID
        except (TypeError, ValueError):  # non-ASCII mac, or a body canonical JSON cannot express
            return Signature.INVALID

    def why(self, state: Signature, what: str) -> str:
        """A one-line reason for an untrusted signature."""
        if state is Signature.MISSING:
            return (f"{what} is unsigned although a signing key is configured ({ENV_KEY}/{ENV_KEY_FILE}); "
                    "it may have been written or replaced without the key")
        return (f"{what} has an invalid signature (edited after signing, or signed with another key than "
                f"key id {self.key_id}); do not trust it")
