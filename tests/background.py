"""A subprocess started now and waited for later (conftest.py's `_background_starts`):
its output goes to files, not pipes (a pipe nobody reads yet could fill and stall it).
`session_fixture` makes the session fixture that starts one, yields it and stops it."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Callable


@dataclasses.dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


class Background:
    def __init__(self, argv: list[str], out_dir, env: dict | None = None, cwd=None):
        self.out_dir = Path(out_dir)
        self.argv = argv
        with open(self.out_dir / "stdout", "w") as out, open(self.out_dir / "stderr", "w") as err:
            self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL)

    def wait(self, timeout: float = 600) -> Finished:
        """Waits for the end (killed, AssertionError, after `timeout` seconds more)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"{self.argv[:3]} ran over {timeout:.0f} s more: "
                                 f"{self._read('stderr')[-4000:]}") from None
        return Finished(self.proc.returncode, self._read("stdout"), self._read("stderr"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _read(self, name: str) -> str:
        return (self.out_dir / name).read_text(errors="replace")


def session_fixture(name: str, start: Callable[[Path], Background], doc: str):
    """A session-scoped pytest fixture `name`: `start(a fresh temporary folder)` when the
    session first asks for it (its output files go there), the started subprocess
    yielded, stopped (killed if still running) at the end of the session."""
    import pytest

    def fixture(tmp_path_factory):
        run = start(tmp_path_factory.mktemp(name))
        yield run
        run.stop()

    fixture.__name__ = name
    fixture.__doc__ = doc
    return pytest.fixture(scope="session", name=name)(fixture)
