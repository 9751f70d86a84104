"""The one download step of the demo datasets (MNIST, WikiText2), and what happens offline.

    if ensure_file(url, path, download=True, what="WikiText2"):
        ...read path...
    else:
        ...build the synthetic stand-in...

The demo datasets fetch the same public files as Lightning's. Without a network (or with
`download=False` and nothing on disk) they do not fail: the caller builds a deterministic synthetic
dataset of the same shapes, so the examples still run end to end. The user is told once per
process and per file, with the address that failed, that the data is synthetic.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

from lightspeed.utilities.rank_zero import rank_zero_warn

# Files already reported missing in this process, and addresses that already failed: a second
# dataset built on the same path neither waits on the network again nor repeats the warning. A
# file missing with download=False is still fetched by a later call with download=True.
_MISSING: set[str] = set()
_FAILED: set[str] = set()

_TIMEOUT_S = 30.0


def ensure_file(url: str, path: str | Path, download: bool, what: str) -> bool:
    """Make sure `path` holds the file published at `url`.

    Args:
        url: the public address of the file.
        path: where the file lives on disk; its folder is created when downloading.
        download: whether to fetch the file when it is not on disk.
        what: the dataset's name, for the warning.

    Returns:
        True when the file is on disk (it was there, or the download succeeded). False when it is
        not: the caller then uses synthetic data. The first miss per file warns; nothing raises.
    """
    path = Path(path)
    if path.is_file():
        return True
    if not download or url in _FAILED:
        if str(path) not in _MISSING:
            _MISSING.add(str(path))
            why = "download=False" if not download else f"{url} failed earlier in this process"
            rank_zero_warn(
                f"{what}: {path} does not exist ({why}); using a SYNTHETIC {what} of the same "
                f"shapes instead (the real file is {url})."
            )
        return False
    try:
        _fetch(url, path)
    except OSError as err:  # URLError, HTTPError, timeouts and disk errors are all OSErrors
        _FAILED.add(url)
        _MISSING.add(str(path))
        rank_zero_warn(
            f"{what}: could not download {url} ({err}); using a SYNTHETIC {what} of the same "
            "shapes instead. Results on it mean nothing about the real dataset."
        )
        return False
    return True


def _fetch(url: str, path: Path) -> None:
    """Download `url` to `path` through a temporary name, so a broken download leaves no file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        # a fixed https URL (Lightning's), not user input
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:  # noqa: S310
            partial.write_bytes(response.read())
        # Several ranks may download at once; the rename is atomic, so readers see a whole file.
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
