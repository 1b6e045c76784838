"""The owned-page transfer's rules (disagg/): the commit rule names every problem, the manifest's
wire types refuse absurd values before any code iterates them, and the MACs catch a wrong or
missing secret (CPU, no process). The transfer itself runs inside SGLang's Mooncake manager:
test/sglang_ext/disaggregation/ and test/system/test_sglang_server_pd.py."""

from __future__ import annotations

import sys

import msgspec
import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_nsa_cp.disagg import PageClaims, auth, check_coverage
from sglang_nsa_cp.disagg.manifest import MAX_CP_SIZE, MAX_TEXT, cut

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")

SECRET = b"test-disagg-secret-0123456789abcdef"


def _claims(rank, positions, pages, cp_size=2, num_pages=6):
    return PageClaims(rank, cp_size, num_pages, tuple(positions), tuple(pages))


def test_check_coverage_names_every_problem():
    good = {0: _claims(0, [0, 2, 4], [10, 12, 14]), 1: _claims(1, [1, 3, 5], [11, 13, 15])}
    assert check_coverage(6, 2, good).ok and check_coverage(6, 2, good).describe() == "ok"
    bad = {0: _claims(0, [0, 2, 3], [10, 12, 14]), 1: _claims(1, [1, 3, 9], [11, 12, 15])}
    report = check_coverage(6, 2, bad)
    got = (report.missing, report.duplicated, report.wrong_owner, report.out_of_range)
    assert got == ((4, 5), (3,), (3,), (9,)), report
    assert "duplicated positions [3 (ranks [0, 1])]" in report.describe(), report.describe()
    silent = check_coverage(6, 2, {1: good[1]})
    assert silent.silent_ranks == (0,) and "no manifest from rank(s) [0]" in silent.describe()


@pytest.mark.parametrize("cp_size", [1, 2, 3, 8])
def test_owner_claims_of_every_page_commit(cp_size):
    for num_pages in range(1, 3 * cp_size + 2):
        pages = [100 + k for k in range(num_pages)]
        claims = {
            r: _claims(r, [k for k, p in enumerate(pages) if p % cp_size == r],
                       [p for p in pages if p % cp_size == r], cp_size, num_pages)
            for r in range(cp_size)
        }  # fmt: skip
        assert check_coverage(num_pages, cp_size, claims).ok, f"{cp_size=}, {num_pages=}"


def test_wire_types_refuse_values_past_their_bounds():
    wire = msgspec.msgpack.encode(_claims(0, [0], [10]))
    assert msgspec.msgpack.decode(wire, type=PageClaims) == _claims(0, [0], [10])
    for field, value in (("cp_size", MAX_CP_SIZE + 1), ("rank", -1), ("num_pages", 0)):
        raw = msgspec.msgpack.encode({**msgspec.structs.asdict(_claims(0, [0], [10])), field: value})
        with pytest.raises(msgspec.ValidationError, match=field):
            msgspec.msgpack.decode(raw, type=PageClaims)


def test_shape_problems_are_named():
    assert _claims(0, [0, 2], [10, 12]).shape_problem(with_checksums=False) is None
    assert "2 positions, 1 pages" in _claims(0, [0, 2], [10]).shape_problem(with_checksums=False)
    assert "expected 2" in _claims(0, [0, 2], [10, 12]).shape_problem(with_checksums=True)
    assert "of a request of 1 pages" in _claims(0, [0, 2], [10, 12], num_pages=1).shape_problem(False)
    assert len(cut("x" * (MAX_TEXT * 2))) <= MAX_TEXT and cut("short") == "short"


def test_macs_catch_a_wrong_or_missing_secret():
    mac = auth.sign(SECRET, b"room-7", b"manifest")
    assert len(mac) == auth.MAC_BYTES and auth.verify(SECRET, b"room-7", b"manifest", mac) is None
    assert "bad MAC" in auth.verify(SECRET, b"room-8", b"manifest", mac), "a MAC is bound to its label"
    assert "bad MAC" in auth.verify(SECRET[::-1], b"room-7", b"manifest", mac)
    assert "no secret" in auth.verify(None, b"room-7", b"manifest", mac)
    assert "does not sign" in auth.verify(SECRET, b"room-7", b"manifest", b"")
    assert auth.sign(None, b"room-7", b"manifest") == b"" and auth.verify(None, b"r", b"m", b"") is None
    with pytest.raises(ValueError, match="at least 16"):
        auth.pd_secret(b"short")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
