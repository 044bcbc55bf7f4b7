"""What both attack suites share: the course kit of this repository (its student repository and
autograder zip, unpacked as Gradescope unpacks it) and the virtualenv its setup.sh makes, as root,
once per session (GRADE_ATTACK_VENV names one made already, to try the attacks again quickly)."""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import release  # noqa: E402
import sandbox  # noqa: E402


def python_for_setup():
    """A Python >= 3.11 that every user can read (setup.sh's venv is made from it), or None."""
    for name in ("python3.13", "python3.12", "python3.11", "python3"):
        path = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
        if path and sandbox._readable_by_all(path):
            check = [path, "-c", "import sys, venv; sys.exit(sys.version_info < (3, 11))"]
            if subprocess.run(check, capture_output=True).returncode == 0:
                return path
    return None


def unpack(zip_path, base):
    """The zip in ``base``/source, closed to other users as setup.sh closes it."""
    source = os.path.join(base, "source")
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(source)
    for name in ("setup.sh", "run_autograder"):
        os.chmod(os.path.join(source, name), 0o755)
    subprocess.run(["chmod", "-R", "go-rwx", source], check=True)
    return source


@pytest.fixture(scope="session")
def unpacked():
    """unpack(zip_path, base), for the suites' own zips."""
    return unpack


@pytest.fixture(scope="session")
def chapters_kit(tmp_path_factory):
    """(student repository, unpacked autograder source) of this repository's release."""
    if os.geteuid() != 0:
        pytest.skip("the attacks run as Gradescope runs them: as root")
    kit = tmp_path_factory.mktemp("chapters")
    student = str(kit / "student")
    release.write_student_repo(student, ROOT)
    zip_path = str(kit / "autograder.zip")
    release.write_autograder(student, zip_path, ROOT)
    base = tempfile.mkdtemp(prefix="chapters-")  # pytest's folders are root's alone: this is not
    os.chmod(base, 0o755)
    yield student, unpack(zip_path, base)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def autograder_venv(chapters_kit):
    """The venv the release's setup.sh makes, as root, as Gradescope runs it (its own Python, no
    development .pth, the sandbox user made): every attack is graded with it."""
    if os.environ.get("GRADE_ATTACK_VENV"):
        yield os.environ["GRADE_ATTACK_VENV"]
        return
    python = python_for_setup()
    if python is None:
        pytest.skip("no Python >= 3.11 readable by every user for setup.sh's venv")
    base = tempfile.mkdtemp(prefix="attack-venv-")
    os.chmod(base, 0o755)
    venv = os.path.join(base, "venv")
    source = chapters_kit[1]
    env = dict(os.environ, AUTOGRADER_ROOT=base, AUTOGRADER_VENV=venv, TORCH_INDEX="")
    env["AUTOGRADER_PYTHON_BIN"] = python
    proc = subprocess.run(
        ["bash", os.path.join(source, "setup.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "student code will run as" in proc.stdout, proc.stdout
    yield venv
    shutil.rmtree(base, ignore_errors=True)
