"""The lab's child processes (pd_extproc_lab/process.py): started without a fork of the caller where
util-linux's setpriv is there, and still ended when the process that started them dies."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pd_extproc_lab import process
from tests.helpers import eventually


def test_setpriv_sets_the_death_signal_so_no_preexec_fn_forces_a_fork() -> None:
    argv, preexec = process.launch(["envoy", "-c", "x.yaml"], "/usr/bin/setpriv")
    assert argv == ["/usr/bin/setpriv", "--pdeathsig", "TERM", "--", "envoy", "-c", "x.yaml"]
    assert preexec is None


def test_without_setpriv_the_child_sets_it_itself() -> None:
    argv, preexec = process.launch(["envoy"], None)
    assert argv == ["envoy"] and preexec is not None


# The parent waits until setpriv has made way for the command: a parent that died before setpriv set the
# signal would leave the child to whoever adopts it (a start-up race of the launcher; `up` lives on).
_PARENT = """
import os, sys, time
from pathlib import Path
from pd_extproc_lab.process import Child
child = Child("sleeper", ["sleep", "120"], dict(os.environ), Path(sys.argv[1]), scan_stdout=False)
child.start()
deadline = time.monotonic() + 30
while Path(f"/proc/{child.process.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
    time.sleep(0.01)
print(child.process.pid, flush=True)
os._exit(0)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux's setpriv is not installed")
def test_a_child_ends_when_the_process_that_started_it_dies(tmp_path: Path) -> None:
    parent = subprocess.run([sys.executable, "-c", _PARENT, str(tmp_path)], capture_output=True, text=True,
                            timeout=60, check=True)
    child = int(parent.stdout)
    assert eventually(lambda: not _running(child), within=30), f"pid {child} outlived its parent"
