"""tools/warm_pytest.py, the warm parent the grading checks fork their pytest sessions from: a
session runs in its folder with its environment and reports pytest's exit code; one whose parent
dies is ended and reported killed, never left running or raised as a parse error."""

import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
import warm_pytest  # noqa: E402

TESTS = """
import os, time

def test_reads_its_environment():
    assert os.environ["GRADE_WHICH"] == "{which}", os.environ.get("GRADE_WHICH")

def test_waits():
    time.sleep(float(os.environ.get("GRADE_SLEEP", "0")))
"""


def start_server():
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return warm_pytest.Server(env), env


@pytest.fixture(scope="module")
def server():  # one warm parent for the tests that leave it alive (it imports torch: seconds)
    started, env = start_server()
    yield started, env
    started.close()


@pytest.fixture
def own_server():  # a warm parent of its own, for the test that kills it
    started, env = start_server()
    yield started, env
    started.close()


def session(server, folder, which, sleep=0, env_extra=None):
    started, env = server
    (folder / "test_it.py").write_text(TESTS.format(which=which))
    env = dict(env, GRADE_WHICH=which, GRADE_SLEEP=str(sleep), **(env_extra or {}))
    log = open(folder / "log", "w")
    return started.start(["-q", "-p", "no:cacheprovider", "test_it.py"], str(folder), env, log)


def test_a_session_runs_in_its_folder_with_its_environment(server, tmp_path):
    a = session(server, tmp_path, "a")
    assert isinstance(a, warm_pytest.Session), f"not forked from the warm parent: {a!r}"
    assert a.wait(timeout=120) == 0, (tmp_path / "log").read_text()
    (tmp_path / "test_it.py").write_text(TESTS.format(which="b"))  # the file says b, env says c
    started, env = server
    log = open(tmp_path / "log", "w")
    failing = started.start(
        ["-q", "-p", "no:cacheprovider"], str(tmp_path), {**env, "GRADE_WHICH": "c"}, log
    )
    assert failing.wait(timeout=120) == 1, f"a failing session did not exit 1: {failing.returncode}"


def test_another_environment_starts_a_plain_process(server, tmp_path):
    # torch reads some variables at import: the warm parent's import would not honour them
    plain = session(server, tmp_path, "a", env_extra={"OMP_NUM_THREADS": "1"})
    assert isinstance(plain, subprocess.Popen), "a session with another environment was forked"
    assert plain.wait(timeout=120) == 0, (tmp_path / "log").read_text()


def test_a_session_whose_parent_dies_is_ended_and_counted_killed(own_server, tmp_path):
    running = session(own_server, tmp_path, "a", sleep=60)
    time.sleep(2)
    own_server[0].proc.kill()
    own_server[0].proc.wait()
    code = running.wait(timeout=30)  # no JSONDecodeError: the parent's silence is read as a kill
    assert code == -signal.SIGKILL, f"a session left by its parent reported {code}"
    assert not alive(running.pid), "the session sleeps on after its parent died"


def alive(pid):  # running, not gone and not a zombie left for init to reap
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True
