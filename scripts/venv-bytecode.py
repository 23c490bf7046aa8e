"""Bytecode for .venv's site-packages, compiled once per installed file on this machine
(scripts/setup-venv.sh runs it after `uv pip install`).

uv hardlinks every installed file from its own cache, so a fresh clone's .venv holds the
very files (same inode, same modification time) of the .venv before it. The .pyc of such
a file is kept in a store (hardlinked, named by the file's device, inode, modification
time in ns and size, under the interpreter's cache tag) and linked into the next .venv's __pycache__ instead of being
compiled again. Only files that another link keeps alive (uv's cache) are stored, so the
inode in the name cannot be reused by another file while the entry is in use; Python
itself still checks each .pyc against its source (modification time and size) when it
imports it. The rest is compiled on every core, as `compileall` would.

    python scripts/venv-bytecode.py SITE_PACKAGES STORE
"""

from __future__ import annotations

import os
import py_compile
import sys
from concurrent.futures import ProcessPoolExecutor
from importlib.util import cache_from_source


def _compile(job: tuple[str, str, str | None]) -> int:
    src, pyc, kept = job
    try:
        py_compile.compile(src, cfile=pyc, doraise=True)
    except (py_compile.PyCompileError, OSError, ValueError):
        return 0  # as compileall -q: a file that does not compile is left without .pyc
    if kept:
        try:
            os.link(pyc, kept)
        except OSError:
            pass
    return 1


def main(site: str, store: str) -> None:
    store = os.path.join(store, sys.implementation.cache_tag)  # one per bytecode format
    os.makedirs(store, exist_ok=True)
    jobs, linked = [], 0
    for root, dirs, files in os.walk(site):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if not name.endswith(".py"):
                continue
            src = os.path.join(root, name)
            st = os.stat(src)
            pyc = cache_from_source(src)
            kept = None
            if st.st_nlink > 1:
                kept = os.path.join(store, f"{st.st_dev}-{st.st_ino}-{st.st_mtime_ns}-"
                                           f"{st.st_size}.pyc")
                if os.path.exists(kept):
                    os.makedirs(os.path.dirname(pyc), exist_ok=True)
                    try:
                        if os.path.lexists(pyc):
                            os.unlink(pyc)
                        os.link(kept, pyc)
                        linked += 1
                        continue
                    except OSError:
                        pass  # compiled below
            os.makedirs(os.path.dirname(pyc), exist_ok=True)
            jobs.append((src, pyc, kept))
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    with ProcessPoolExecutor(max_workers=workers) as pool:
        compiled = sum(pool.map(_compile, jobs, chunksize=64))
    print(f"scripts/venv-bytecode.py: {linked} .pyc linked from {store}, {compiled} compiled")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
