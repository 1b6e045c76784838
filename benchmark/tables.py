"""What the benchmarks (benchmark/bench_*.py) share: plain-text tables, comma-separated list
arguments, saved raw numbers and plots. Imported as `tables` (a benchmark's own folder is on sys.path)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
from typing import Any, Callable, Sequence


def format_table(rows: Sequence[Sequence[Any]], align: str = "l", header_rule: bool = False) -> str:
    """Rows of cells as aligned columns two spaces apart, one row per line (the first row is the
    header). `align`: one 'l' or 'r' per column, or one letter for all; `header_rule` draws a line
    of dashes under the header."""
    cells = [[str(c) for c in r] for r in rows]
    if not cells:
        return ""
    ncols = len(cells[0])
    align = align * ncols if len(align) == 1 else align
    if len(align) != ncols or set(align) - {"l", "r"}:
        raise ValueError(f"align must be 'l'/'r' once or once per column ({ncols}), got {align!r}")
    widths = [max(len(r[i]) for r in cells) for i in range(ncols)]
    lines = [
        "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)).rstrip() for r in cells
    ]
    if header_rule:
        lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def _article(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def parse_comma_list(text: str, item: Callable[[str], Any] = int, *, low=None, noun: str = "integer") -> list:
    """'16,64,256' -> [16, 64, 256]: each item through `item`, none empty, none below `low`.

    Raises ValueError naming the item and the rule, e.g. "item 2 'x' is not an integer; must be
    comma-separated integers >= 1"."""
    rule = f"must be comma-separated {noun}s" + (f" >= {low}" if low is not None else "")
    values = []
    for i, raw in enumerate(text.split(","), 1):
        raw = raw.strip()
        if not raw:
            raise ValueError(f"item {i} is empty; {rule}")
        try:
            value = item(raw)
        except ValueError:
            raise ValueError(f"item {i} {shlex.quote(raw)} is not {_article(noun)}; {rule}") from None
        if low is not None and value < low:
            raise ValueError(f"item {i} is {value}; {rule}")
        values.append(value)
    return values


def int_pair(text: str) -> tuple[int, int]:
    """'61440:4096' -> (61440, 4096)."""
    first, sep, second = text.partition(":")
    if not sep:
        raise ValueError(f"{text!r} has no ':'")
    return int(first), int(second)


def comma_list(item: Callable[[str], Any] = int, *, low=None, noun: str = "integer") -> Callable[[str], list]:
    """An argparse `type=` for a comma-separated list (parse_comma_list; errors become usage errors)."""

    def parse(text: str) -> list:
        try:
            return parse_comma_list(text, item, low=low, noun=noun)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return parse


def save_plot(fig, path: str) -> None:
    """Write a benchmark's matplotlib figure and say where."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def save_results(raw: dict, out_dir: str, name: str, plot=None) -> None:
    """DIR/NAME.json with the raw numbers (and the machine line printed); DIR/NAME_timeline.png
    from `plot(raw, path)` when given."""
    print(json.dumps(raw["machine"]))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(raw, f, indent=1)
    if plot is not None:
        plot(raw, os.path.join(out_dir, f"{name}_timeline.png"))
