"""The graded tests' own process never imports a submitted file: tools/sandbox.py runs it.

An import of an assignment module (tools/assignments.py's ASSIGNMENT_FILES) or of the probes is
refused here: always in a grading session (tools/grade.py sets GRADE_ISOLATED), and in a plain
pytest run when the import comes from a file in this folder. A grading session run as root also
refuses to start when the sandbox user could write this process's working folder or a folder on
its sys.path (a planted .py or .pyc would run here).

Marker `ungraded`: a case of a graded test that the grader leaves out (3 and 4 ranks: more than
the autograder's container affords); the slow tier (`make test-slow`) still runs it.
"""

import importlib.abc
import os
import stat
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import assignments  # noqa: E402
import sandbox  # noqa: E402

os.environ["CUDA_VISIBLE_DEVICES"] = ""
torch.set_num_threads(1)  # as the workers: a bitwise comparison needs their reduction order
MODULES = {
    os.path.splitext(f)[0].replace(os.sep, ".")
    for f in [*assignments.ASSIGNMENT_FILES, *assignments.assignment_files(ROOT)]
} | {os.path.splitext(r.file)[0] for r in assignments.graded_regions(ROOT)}
ISOLATED = os.environ.get("GRADE_ISOLATED") == "1"


class RefuseSubmittedFiles(importlib.abc.MetaPathFinder):
    """Refuses importing an assignment module or a probe in the graded tests' process."""

    def find_spec(self, name, path=None, target=None):
        if name in MODULES or name == "probes" or name.startswith("probes."):
            if ISOLATED or _from_here():
                raise ImportError(
                    f"{name}: a graded test never imports a submitted file (or a probe, which "
                    "does); it calls the probe through sandbox.call / on_ranks / torchrun"
                )
        return None


def _from_here():
    frame = sys._getframe(2)
    probes = os.path.join(HERE, "probes") + os.sep
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(HERE + os.sep) and not name.startswith(probes):
            return True
        frame = frame.f_back
    return False


sys.meta_path.insert(0, RefuseSubmittedFiles())
if ISOLATED:
    for name in list(sys.modules):
        if name in MODULES:
            raise RuntimeError(f"{name} was imported into the grading process before the tests")


def _writable_by(uid, gid, path):
    """Whether ``uid`` can put a file in ``path`` or replace it or a folder above it (a folder
    with the sticky bit, like /tmp, lets others add entries but not replace root's)."""
    path, first = os.path.realpath(path), True
    while True:
        try:
            info = os.stat(path)
        except OSError:
            return False
        writes = info.st_mode & stat.S_IWOTH or (info.st_gid == gid and info.st_mode & stat.S_IWGRP)
        if info.st_uid == uid or (writes and (first or not info.st_mode & stat.S_ISVTX)):
            return True
        if path == os.path.dirname(path):
            return False
        path, first = os.path.dirname(path), False


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "ungraded: a case of a graded test the grader leaves out (beyond the container: "
        "3-4 ranks); make test-slow runs it",
    )
    uid, gid, _ = sandbox.identity()
    if ISOLATED and uid is not None:
        places = [os.getcwd(), *(p for p in sys.path if p and os.path.exists(p))]
        open_to = [p for p in places if _writable_by(uid, gid, p)]
        if open_to:
            pytest.exit(f"grading refused: the sandbox user can write {open_to[0]}", returncode=3)


def pytest_runtest_setup(item):
    deadline = os.environ.get("GRADE_DEADLINE")
    if deadline and time.time() > float(deadline) - sandbox.GRACE_S:
        item.session.shouldstop = "the time for this test file ran out"
        pytest.fail("not run: the time for this test file ran out", pytrace=False)
