"""The sandbox (tools/sandbox.py) that graded tests run student code through, on its own probes
(tests/graded/probes/selftest.py): values come back plain; every way a worker can fail (raise, a
stub, hang, exit, crash, a rank failing while the others wait) raises StudentCodeError with a
first line in the student's terms, fast; nothing a call starts outlives it; this process never
imports a submitted file; a file that could not be imported gives its importers a placeholder;
and, when run as root with the sandbox user, the worker is that user and can write only its
scratch folder.
"""

import os
import pathlib
import secrets
import shutil
import sys
import tempfile
import time

import pytest
import sandbox
import torch
from sandbox import StudentCodeError, call, on_ranks, torchrun


def test_values_come_back_plain():
    got = call("selftest:double", torch.ones(2))
    assert torch.equal(got["y"], torch.full((2,), 2.0)) and got["n"] == 3
    assert got["plan"] == {"steps": 2, "name": "p"}  # a dataclass comes back as a dict
    ranks = on_ranks("selftest:ranked", 2, torch.ones(2))
    assert [t.tolist() for t in ranks] == [[3.0, 3.0], [3.0, 3.0]]


def test_a_stub_and_an_exception_say_what_happened_first():
    with pytest.raises(StudentCodeError) as stub:
        call("selftest:stub")
    assert stub.value.kind == "stub" and stub.value.stubs == ("muon_zero.newton_schulz",)
    assert str(stub.value).startswith("NotImplementedError: muon_zero.newton_schulz: write it")
    with pytest.raises(StudentCodeError) as raised:
        call("selftest:raises")
    first, *rest = str(raised.value).splitlines()
    assert first == "ValueError: the shapes differ: 3 vs 4"
    assert "some output before the error" in "\n".join(rest)
    with pytest.raises(StudentCodeError) as odd:  # a lone surrogate would crash the report
        call("selftest:raises", "bad \ud800 shapes")
    assert str(odd.value).splitlines()[0] == "ValueError: bad ? shapes", str(odd.value).encode(
        "utf-8", "backslashreplace"
    )


@pytest.mark.parametrize("how", ["module", "meter", "function"])
def test_a_probe_or_meter_changed_by_the_worker_fails_the_call(how):
    """The probe is bound before the submission runs: a value measured after the worker swapped
    the probe module, patched a meter or rebound a probe function never comes back."""
    with pytest.raises(StudentCodeError) as error:
        call("selftest:tamper", how)
    assert "changed the grader's" in str(error.value).splitlines()[0], str(error.value)


@pytest.mark.parametrize("how", ["fd 3, then return", "fd 3, then exit", "real fd"])
def test_a_record_the_worker_writes_itself_fails_the_call(how):
    """A forged record on descriptor 3 lands on a decoy the grader watches; one on the real
    result descriptor makes two records when the probe returns: either way, nothing counts."""
    with pytest.raises(StudentCodeError) as error:
        call("selftest:forge", how)
    assert error.value.kind == "tampered", str(error.value)
    first = str(error.value).splitlines()[0]
    assert "result pipe" in first and "forged" not in str(error.value), first


def test_the_record_is_written_with_what_was_bound_before_the_submission_ran():
    """A worker that wraps os.fdopen and os.write to rewrite the record on its way out changes
    nothing: the record goes out through functions bound before any submitted code ran."""
    assert call("selftest:rewrite") == "honest"


def test_a_failing_rank_stops_the_others_at_once():
    start = time.monotonic()
    with pytest.raises(StudentCodeError) as error:
        on_ranks("selftest:fails_on_rank", 2, timeout=60)
    assert str(error.value).startswith("RuntimeError: rank 1 went wrong (rank 1 of 2)")
    assert time.monotonic() - start < 30, "rank 0 waited out its timeout"


def test_a_hang_names_where_it_hung_and_ends_at_its_timeout():
    start = time.monotonic()
    with pytest.raises(StudentCodeError) as error:
        call("selftest:hang", timeout=3)
    assert error.value.kind == "timeout"
    first = str(error.value).splitlines()[0]
    assert first.startswith("did not finish in 3 s; it was at ") and "in hang" in first, first
    assert time.monotonic() - start < 3 + sandbox.GRACE_S + 10


@pytest.mark.parametrize(
    "how, first",
    [
        ("sys.exit", "the code called sys.exit(0) instead of returning"),
        ("os._exit", "exited (exit code 3) before returning"),
        ("segfault", "crashed (segmentation fault) before returning"),
    ],
)
def test_exits_and_crashes_are_failures(how, first):
    with pytest.raises(StudentCodeError) as error:
        call("selftest:exits", how)
    assert str(error.value).startswith(first), str(error.value)


def test_nothing_a_call_starts_outlives_it():
    pid = call("selftest:detach", 300)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    z = sandbox.zygote()
    assert z.alive()
    left = sandbox.descendants(z.proc.pid) if z.proc else []
    assert not left, f"processes left behind by the call: {left}"
    uid = sandbox.identity()[0]
    if uid is not None:
        assert not [p for p in sandbox._pids() if sandbox._owner(p) == uid]


def test_only_plain_values_and_a_capped_size_come_back(monkeypatch):
    with pytest.raises(StudentCodeError) as error:
        call("selftest:not_plain")
    assert "TypeError: the value is a object" in str(error.value)
    monkeypatch.setattr(sandbox, "MAX_RESULT_BYTES", 10_000)
    with pytest.raises(StudentCodeError) as error:
        call("selftest:big", 100_000)
    assert "the probe returned more than" in str(error.value)


@pytest.fixture
def readable(tmp_path):
    """A folder the sandbox user can read (pytest's own are root's alone)."""
    path = tempfile.mkdtemp(prefix="sandbox-test-")
    os.chmod(path, 0o755)
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_torchrun_runs_the_staged_file(readable, monkeypatch):
    tmp_path = readable
    (tmp_path / "hello.py").write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "ranks = torch.tensor([float(dist.get_rank())])\n"
        "dist.all_reduce(ranks)\n"
        "if dist.get_rank() == 0:  # one printer: two ranks' lines interleave\n"
        "    print('sum of ranks', ranks.item(), flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    os.chmod(tmp_path / "hello.py", 0o644)
    monkeypatch.setenv("GRADE_STAGE", str(tmp_path))
    out = torchrun("hello.py", 2, timeout=240).stdout
    assert "sum of ranks 1.0" in out, out


def test_a_broken_file_imports_as_a_placeholder_that_says_why(monkeypatch):
    why = "muon_zero.py could not be imported: SyntaxError at line 3: invalid syntax"
    monkeypatch.setenv("GRADE_BROKEN", '{"muon_zero": "%s"}' % why)
    with pytest.raises(StudentCodeError) as error:
        call("selftest:uses", "muon_zero", "newton_schulz")
    assert str(error.value).startswith(f"ImportError: {why}")


def test_the_import_check_names_the_failing_file(readable, monkeypatch):
    tmp_path = readable
    (tmp_path / "good.py").write_text("import bad\nvalue = 1\n")
    (tmp_path / "bad.py").write_text("x = 1\ndef broken(:\n")
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "spins.py").write_text("while True:\n    pass\n")
    for f in tmp_path.iterdir():
        os.chmod(f, 0o644)
    monkeypatch.setenv("GRADE_STAGE", str(tmp_path))
    found = sandbox.import_check(["bad", "good", "quits", "spins"], timeout=3)
    assert found["bad.py"].startswith("SyntaxError at line 2"), found
    assert "good.py" not in found, found  # its import of bad.py got the placeholder
    assert found["quits.py"] == "it called sys.exit(0) while being imported", found
    assert found["spins.py"].startswith("importing it did not finish in 3 s; it was at spins.py")


def test_this_process_refuses_to_import_a_submitted_file(monkeypatch):
    monkeypatch.delitem(sys.modules, "compose", raising=False)  # put back after: others use it
    with pytest.raises(ImportError, match="never imports a submitted file"):
        import compose  # noqa: F401
    with pytest.raises(ImportError, match="never imports a submitted file"):
        import probes.selftest  # noqa: F401


def test_the_call_stops_where_this_files_time_ends(monkeypatch):
    monkeypatch.setenv("GRADE_DEADLINE", str(time.time() + 1))
    with pytest.raises(StudentCodeError) as error:
        call("selftest:double", torch.ones(1))
    assert error.value.kind == "budget"


def test_a_rank_gets_its_own_inputs_and_nothing_of_the_others():
    """Each rank's inputs carry a secret drawn here; no rank finds another's in its own memory
    (inherited from the zygote, which forked every rank), and no file of inputs is named there:
    they come by a descriptor of an anonymous memory file. Can fail: inputs passed as a file
    named in the spawn request put that name in the zygote's heap, where the ranks forked after
    it could find it."""
    shards = [torch.full((2,), float(r)) for r in range(3)]
    marks = [f"SECRET-{secrets.token_hex(8)}" for _ in shards]
    own = [{"shard": t, "secret": c} for t, c in zip(shards, marks, strict=True)]
    for _ in range(2):  # the second call's ranks fork from a zygote that served the first
        got = on_ranks("selftest:own_shard", 3, per_rank=own)
        assert [r["shard"].tolist() for r in got] == [t.tolist() for t in shards]
        leaked = {rank: r["secrets"] for rank, r in enumerate(got) if r["secrets"]}
        assert not leaked, f"a rank found another rank's inputs: {leaked}"
        named = {rank: r["named"] for rank, r in enumerate(got) if r["named"]}
        assert not named, f"a rank's memory names files of inputs it can open: {named}"
        if sandbox.identity()[0] is not None:  # a worker of another user than the grader's
            assert not any(r["readable"] for r in got), "a worker read another rank's memory"


@pytest.mark.skipif(sandbox.identity()[0] is None, reason=sandbox.identity()[2])
def test_as_root_the_worker_is_the_sandbox_user_and_writes_only_its_scratch(tmp_path):
    uid = sandbox.identity()[0]
    me = call("selftest:who")
    assert me["uid"] == uid and me["cwd"] == sandbox._scratch()
    assert not any(k.startswith("GRADE_REPORT") for k in me["environ"])
    secret = tmp_path / "secret.txt"
    secret.write_text("the reference")
    os.chmod(secret, 0o600)
    assert not call("selftest:can", str(secret), "r")
    assert not call("selftest:can", os.path.join(sandbox.stage(), "launch.py"), "a")
    assert call("selftest:can", os.path.join(sandbox._scratch(), "mine.txt"), "w")


@pytest.mark.skipif(sandbox.identity()[0] is None, reason=sandbox.identity()[2])
def test_what_a_call_leaves_in_the_kernel_and_the_shared_folders_goes_with_it():
    """System V shared memory outlives every process (and stays charged to the container): one
    file's leftovers would sink every later call unless each call removes them."""
    left = call("selftest:leave_behind")
    made = {(kind, ident) for kind, ident in left["ipc"]}
    assert all(ident >= 0 for _, ident in made), f"the probe could not make its objects: {made}"
    deadline = time.monotonic() + 5  # an attached segment goes once its holder's exit completes
    while made & set(sandbox.ipc_of(sandbox.identity()[0])) and time.monotonic() < deadline:
        time.sleep(0.1)
    still = made & set(sandbox.ipc_of(sandbox.identity()[0]))
    assert not still, f"System V IPC objects of the sandbox user outlived the call: {still}"
    files = [p for p in left["paths"] if os.path.lexists(p)]
    assert not files, f"files of the sandbox user outlived the call: {files}"
    assert os.listdir(sandbox._scratch()) == [], "the scratch folder was not emptied"
    assert not left["mq"], "a worker made a POSIX message queue, which no one can list or remove"
    after = call("selftest:what_is_left")  # notes a worker keeps outside any process
    assert after["xattrs"] == [], f"the scratch folder kept a worker's attributes: {after}"
    assert left["key"] < 0 or after["key"] < 0, "the user's keyring kept a worker's key"
