"""Files the daemon keeps for callers (message batches, stored responses): conversations, so
readable by the daemon's user only (directories 0700, files 0600), UTF-8 always, and durable:
fsynced before they are renamed into place, and the directory after."""

from __future__ import annotations

import os
from pathlib import Path


def private_dir(path: Path) -> Path:
    """`path`, created if needed, readable by the daemon's user only."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)  # also when an older mlxd made it with the default umask
    return path


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text`: a reader, or a crash at any point, sees the old file or the
    new one whole."""
    temp = path.with_name(path.name + ".tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temp, path)
    _sync_dir(path.parent)


def append_line(path: Path, line: str) -> None:
    """Append one line and make it durable before returning."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as out:
        out.write(line + "\n")
        out.flush()
        os.fsync(out.fileno())


def read_lines(path: Path) -> list[str]:
    """`path`'s lines, each decoded on its own: a torn last line (a crash mid-append, maybe
    inside a multibyte character) spoils only itself."""
    lines = []
    for raw in path.read_bytes().splitlines():
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return lines


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
