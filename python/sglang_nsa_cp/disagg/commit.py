"""The decode side's commit rule, as pure functions of the ranks' claims (no I/O, no threads).

The SGLang plugin's decode applies it to `manifest.PageClaims`, one per buffer kind of each
rank's manifest frame. A request of n pages from a CP group of N ranks commits only when:
  1. all N ranks sent their claims (empty ones if they own none of its pages),
  2. every position 0..n-1 is claimed exactly once, and no claim is out of range,
  3. each claim comes from its owner: logical_page % N == the claiming rank.

Example, N = 2, n = 4: rank 0 claims {0, 2}, rank 1 claims {1, 2}:
    missing = [3], duplicated = [2] (ranks 0, 1): the request fails and its pages are freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from sglang_nsa_cp.disagg.manifest import PageClaims

_SHOWN = 16  # positions listed per problem in a reason string


@dataclass(frozen=True)
class CoverageReport:
    """What is wrong with a request's manifests; all empty means it may commit."""

    missing: tuple[int, ...] = ()
    duplicated: tuple[int, ...] = ()
    wrong_owner: tuple[int, ...] = ()
    out_of_range: tuple[int, ...] = ()
    silent_ranks: tuple[int, ...] = ()
    claimants: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicated or self.wrong_owner or self.out_of_range or self.silent_ranks)

    def describe(self) -> str:
        parts = []
        if self.silent_ranks:
            parts.append(f"no manifest from rank(s) {list(self.silent_ranks)}")
        if self.missing:
            parts.append(f"missing positions {_show(self.missing)}")
        if self.duplicated:
            dup = [f"{k} (ranks {list(self.claimants.get(k, ()))})" for k in self.duplicated]
            parts.append(f"duplicated positions {_show(dup)}")
        if self.wrong_owner:
            parts.append(f"positions from the wrong owner {_show(self.wrong_owner)}")
        if self.out_of_range:
            parts.append(f"out-of-range positions {_show(self.out_of_range)}")
        return "; ".join(parts) or "ok"


def _show(items: Sequence) -> str:
    items = list(items)
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return f"[{', '.join(str(i) for i in items[:_SHOWN])}]{more}"


def check_coverage(num_pages: int, cp_size: int, claims: Mapping[int, PageClaims]) -> CoverageReport:
    """Rules 1-3 over the claims received so far (keyed by the rank that sent them)."""
    claimants: dict[int, list[int]] = {}
    wrong_owner, out_of_range = set(), set()
    for rank, claim in sorted(claims.items()):
        for position, page in zip(claim.positions, claim.logical_pages):
            if not 0 <= position < num_pages:
                out_of_range.add(position)
                continue
            claimants.setdefault(position, []).append(rank)
            if page % cp_size != rank:
                wrong_owner.add(position)
    return CoverageReport(
        missing=tuple(k for k in range(num_pages) if k not in claimants),
        duplicated=tuple(sorted(k for k, ranks in claimants.items() if len(ranks) > 1)),
        wrong_owner=tuple(sorted(wrong_owner)),
        out_of_range=tuple(sorted(out_of_range)),
        silent_ranks=tuple(r for r in range(cp_size) if r not in claims),
        claimants={k: tuple(ranks) for k, ranks in claimants.items()},
    )
