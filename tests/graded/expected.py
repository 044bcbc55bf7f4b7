"""Expected values for the graded tests, from references the student repository does not hold.

The independent references (tests/graded/hidden/references_<stem>.py: V4's mHC model, the
per-matrix Muon loop, the scalar compression) ship only in the autograder zip: in the student
repository each one would be an answer for the region it checks. There, a test reads the value
the reference gave for the same public case, stored in tests/graded/stored/<stem>.pt by
`make expected`; in the reference and the autograder the reference computes it, and (for a
public case) must equal what is stored, so a stale store fails here first.

    H = hidden("mhc")                                 # the module, or None without it
    want = stored("mhc", "sinkhorn", lambda: H.v4_sinkhorn(logits))
"""

import hashlib
import importlib
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STORE = os.path.join(HERE, "stored")
WRITE = os.environ.get("GRADE_WRITE_EXPECTED") == "1"  # make expected
# the autograder's draw (tools/gradescope.py sets it at grading time): the graded tests' seeds
# move with it; 0 is the student repository's public cases, the only ones stored
DRAW = int(os.environ.get("GRADE_DRAW") or 0)
_STORES, _WRITTEN = {}, {}


def _hashed(*label):  # 63 bits of sha256 over the draw and the label
    digest = hashlib.sha256(repr((DRAW, *label)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def case_seed(public, *label):
    """The seed of a graded case: ``public`` in the student repository (draw 0); at grading, a
    hash of the draw, ``public`` and ``label``. torch keeps a seed's low 32 bits, so a worker can
    search a seed out of values it was handed (2^32 tries); a seed linear in the draw would then
    give the draw away, and with it every hidden case. A hash tells nothing of the others."""
    return public if DRAW == 0 else _hashed(public, *label)


def generator(*label):
    """A torch.Generator for one tensor that a rank alone is handed, seeded by a hash of the draw
    and ``label``. mt19937's output is linear in its state, so values drawn from one generator
    can give its state away, and with it every value it drew before and after; a generator per
    rank's share keeps what one rank can work out to what it was given."""
    return torch.Generator().manual_seed(_hashed(*label))


def hidden(stem):
    """tests/graded/hidden/references_<stem>.py, or None where it does not ship."""
    try:
        return importlib.import_module(f"graded.hidden.references_{stem}")
    except ModuleNotFoundError as error:
        if error.name not in ("graded.hidden", f"graded.hidden.references_{stem}"):
            raise
        return None


def _path(stem):
    return os.path.join(STORE, f"{stem}.pt")


def _store(stem):
    if stem not in _STORES:
        path = _path(stem)
        _STORES[stem] = torch.load(path, weights_only=True) if os.path.exists(path) else {}
    return _STORES[stem]


def same(a, b):
    """Equal through dicts, lists and tuples: ints and bools exactly, floating values to the
    rounding of their dtype relative to the largest (another CPU may sum in another order)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if not a.is_floating_point():
            return torch.equal(a, b)
        rel = {torch.float64: 1e-10, torch.float32: 1e-5}.get(a.dtype, 1e-2)
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        return diff <= rel * max(b.double().abs().max().item() if b.numel() else 0.0, 1e-30)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(abs(b), 1e-30)
    return type(a) is type(b) and a == b


def stored(stem, key, compute, public=None):
    """What ``compute()`` (a reference from tests/graded/hidden/) gives: computed where
    the references ship, else read from the store. ``public``: the case is the student
    repository's (default: DRAW is 0; a case drawn at grading time is never stored)."""
    public = DRAW == 0 if public is None else public
    if hidden(stem) is None:
        values = _store(stem)
        assert key in values, (
            f"no stored expected value {key!r} for {stem}: run `make expected` in the reference"
        )
        return values[key]
    value = compute()
    if not public:
        return value
    if WRITE:
        _WRITTEN.setdefault(stem, dict(_store(stem)))[key] = value
        os.makedirs(STORE, exist_ok=True)
        torch.save(_WRITTEN[stem], _path(stem))
        return value
    values = _store(stem)
    assert key in values and same(values[key], value), (
        f"tests/graded/stored/{stem}.pt is stale at {key!r}: the reference gives another value "
        f"(run `make expected` and commit it)"
    )
    return value
