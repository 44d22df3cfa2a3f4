"""Backend errors as one-line ``StorageError``s that name the fix.

fsspec backends raise what their client raises (``PermissionError``, ``FileNotFoundError``, botocore's and
aiohttp's own classes). Every store operation runs inside :func:`mapped`, so a caller sees the library's
hierarchy only, and a message never quotes what could carry credentials (an access-denied text may name the key id).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..errors import StorageError, VerifiedCkptError

__all__ = ["mapped"]


@contextlib.contextmanager
def mapped(url: str, container: str, what: str, writing: bool = False) -> Iterator[None]:
    """Run the body, turning a backend failure of ``what`` at ``url`` into a ``StorageError``.

    ``FileNotFoundError`` passes through on reads (callers treat "absent" as an answer); on writes it means the
    ``container`` (a bucket, a root folder) is missing.
    """
    try:
        yield
    except FileNotFoundError as e:
        if not writing:
            raise
        raise StorageError(f"{what} at {url!r} failed: {container} does not exist; "
                           "create it (or fix the URL) and retry") from e
    except PermissionError as e:
        raise StorageError(f"{what} at {url!r} was denied: check the credentials "
                           "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or -o key=... -o secret=...) and their "
                           f"permissions on {container}") from e
    except VerifiedCkptError:
        raise
    except Exception as e:
        raise StorageError(f"{what} at {url!r} failed ({type(e).__name__}: {str(e)[:200]}); "
                           "check that the store is reachable, then retry") from e
