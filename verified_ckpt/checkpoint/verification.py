"""Offline verification: re-read committed checkpoints and record what was found.

Every shard is re-read through the checked read path (digests, headers,
fingerprints, NaN/Inf), the manifest's consensus claim is cross-checked
against the ledger, and an untrusted signature is a problem of its own. The
result is appended as a verification record; a failed one makes the
checkpoint ``corrupt`` (or ``suspect``) from then on.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

from .. import history
from ..errors import VerifiedCkptError
from ..history import Columns
from ..manifest import CheckpointInfo
from ..records import VERIFICATION, Problem, VerificationResult
from ..signing import Signature
from ..store import utc_now
from .catalog import Catalog
from .reading import VERIFY, Reader

__all__ = ["verify_all"]


def verify_all(catalog: Catalog, reader: Reader, infos: Sequence[CheckpointInfo], ledger: Columns | None, *,
               jobs: int, progress: Callable[[int], None] | None) -> list[VerificationResult]:
    """Verify ``infos`` ``jobs`` at a time, record each result, and return them in order."""
    consensus = history.passing_consensus(ledger) if ledger is not None else None

    def one(ck: CheckpointInfo) -> VerificationResult:
        if ck.manifest is None:
            problems = [Problem("manifest", ck.reasons[0] if ck.reasons else "manifest unreadable")]
        else:
            try:
                _, problems = reader.read(ck.manifest, VERIFY, progress=progress)
            except VerifiedCkptError as e:
                problems = [Problem("read", str(e))]
            problems += [Problem("ledger", p) for p in history.consensus_claim_problems(ck.manifest.evidence, consensus)]
            if not Signature(ck.signature).trusted:
                problems.insert(0, Problem("signature", ck.reasons[0]))
        result = VerificationResult(ck.id, ck.step, not problems, problems, utc_now())
        catalog.append(VERIFICATION, result.to_record())
        return result

    with concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="vckpt-verify") as pool:
        return list(pool.map(one, infos))
