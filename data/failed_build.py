"""A dataset build that fails leaves nothing behind (`removed_on_failure`), and says why in our words
(`prepare`: a UserError raised inside the generator surfaces unwrapped).

TFDS writes shards into a temporary directory under the dataset's and keeps it when the
generator raises; a user who fixes the data and re-runs should find the workdir as before.
"""

from __future__ import annotations

import contextlib
import os
import shutil


def first_missing(path: str | os.PathLike) -> str | None:
    """The outermost directory on the way to `path` that does not exist yet (what a build creates)."""
    path = os.path.abspath(os.fspath(path))
    missing = None
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


@contextlib.contextmanager
def removed_on_failure(dataset_dir: str | os.PathLike):
    """Remove the directories a failed build created on the way to `dataset_dir` (none if it existed)."""
    created = first_missing(dataset_dir)
    try:
        yield
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


def prepare(builder, dataset_dir: str | os.PathLike) -> None:
    """`builder.download_and_prepare()`, leaving nothing behind on failure. TFDS wraps errors raised
    inside the generator; a `UserError` among the causes is re-raised as itself."""
    from codedance_jax.errors import UserError

    try:
        with removed_on_failure(dataset_dir):
            builder.download_and_prepare()
    except Exception as e:
        cause = e
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None and cause is not e:
            raise cause from None
        raise
