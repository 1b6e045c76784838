"""The demo's command-line options: parsed as text, then every value checked before any work.

A bad value ends the command with one line naming the option, the value and what is accepted,
and argparse's exit status 2:

    python -m sglang_nsa_cp demo: error: --page-size 0: must be an integer from 1 to 4096 (tokens per KV page)

`DemoOptions` is what the demo runs with; `check_demo_args` builds it from argparse's namespace
and raises `UsageError` on the first bad value.
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass

from sglang_nsa_cp.cli import parse_comma_list
from sglang_nsa_cp.oracle import DTYPES, PATH_SPLIT_MODES
from sglang_nsa_cp.pd.demo import DEFAULT_DECODE_STEPS
from sglang_nsa_cp.reference.config import CONFIGS

# Bounds that keep a CPU demo a demo: every rank is a process, every pool is allocated up front.
MAX_RANKS = 64
MAX_PAGE_SIZE = 4096
MAX_TOKENS = 65536  # all requests' cached and new tokens together
MAX_DECODE_STEPS = 1024
MAX_SEED = 2**63 - 1  # the model seeds torch with seed, the tokens with seed + 1
DEFAULT_EXTEND_LENS = [200, 57, 5, 120]
DEFAULT_PREFIX_LENS = [0, 150, 0, 0]
MOONCAKE_LOG_LEVELS = ("trace", "info", "warning", "error")  # Mooncake's MC_LOG_LEVEL values


class UsageError(ValueError):
    """A bad command-line value; the message is one line: option, value, rule."""


@dataclass(frozen=True)
class DemoOptions:
    cp: int
    split: str
    page_size: int
    extend_lens: list[int]
    prefix_lens: list[int]
    seed: int
    config: str
    dtype: str
    prefetch: bool
    pd: bool
    decode_steps: int
    json_path: str | None
    mooncake_log: str | None


def add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    """Every value is read as text and checked by `check_demo_args`, so all errors read alike."""
    demo.add_argument(
        "--cp", metavar="N", default="4", help=f"CP ranks (one process each), 1 to {MAX_RANKS}; default 4"
    )
    demo.add_argument("--split", metavar="MODE", default="zigzag", help="zigzag or interleave; default zigzag")
    demo.add_argument(
        "--page-size", metavar="P", default="16", help=f"tokens per KV page, 1 to {MAX_PAGE_SIZE}; default 16"
    )
    demo.add_argument(
        "--extend-lens",
        metavar="A,B,...",
        help="new tokens per request, comma-separated, each >= 1; default " + ",".join(map(str, DEFAULT_EXTEND_LENS)),
    )
    demo.add_argument(
        "--prefix-lens",
        metavar="X,Y,...",
        help="cached tokens per request (one per --extend-lens value), each >= 0; default "
        + ",".join(map(str, DEFAULT_PREFIX_LENS))
        + " with the default --extend-lens, else all 0",
    )
    demo.add_argument("--seed", metavar="S", default="0", help="weights and tokens seed, 0 to 2**63-1; default 0")
    demo.add_argument(
        "--config", metavar="NAME", default="tiny", help=f"reference model config: {', '.join(CONFIGS)}; default tiny"
    )
    demo.add_argument("--dtype", metavar="DTYPE", default="float32", help=f"{' or '.join(DTYPES)}; default float32")
    demo.add_argument(
        "--no-prefetch", action="store_true", help="shared path: materialize in place, not one layer ahead"
    )
    demo.add_argument("--pd", action="store_true", help="also transfer to a decode process and decode (PD end to end)")
    demo.add_argument(
        "--decode-steps",
        metavar="K",
        help=f"with --pd: greedy decode steps, 0 to {MAX_DECODE_STEPS}; default {DEFAULT_DECODE_STEPS}",
    )
    demo.add_argument("--json", metavar="PATH", help="also write the full report as JSON (checked before the run)")
    demo.add_argument(
        "--mooncake-log",
        metavar="LEVEL",
        help=f"with --pd: Mooncake's log level ({', '.join(MOONCAKE_LOG_LEVELS)}); default warning, "
        "or MC_LOG_LEVEL from the environment",
    )


def _show(value: str) -> str:
    return shlex.quote(value)


def _int(option: str, value: str, low: int, high: int, what: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        n = None
    if n is None or not low <= n <= high:
        raise UsageError(f"{option} {_show(value)}: must be an integer from {low} to {high} ({what})")
    return n


def _choice(option: str, value: str, choices, what: str) -> str:
    if value not in choices:
        raise UsageError(f"{option} {_show(value)}: must be one of {', '.join(choices)} ({what})")
    return value


def _int_list(option: str, value: str, low: int, what: str, example: str) -> list[int]:
    try:
        return parse_comma_list(value, low=low)
    except ValueError as exc:
        raise UsageError(f"{option} {_show(value)}: {exc} ({what}), e.g. {example}") from None


def _lengths(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    if args.extend_lens is None:
        extend = DEFAULT_EXTEND_LENS
        if args.prefix_lens is None:
            return extend, DEFAULT_PREFIX_LENS
    else:
        extend = _int_list("--extend-lens", args.extend_lens, 1, "new tokens per request", "200,57")
    if args.prefix_lens is None:
        return extend, [0] * len(extend)
    prefix = _int_list("--prefix-lens", args.prefix_lens, 0, "cached tokens per request", "0,150")
    if len(prefix) != len(extend):
        given = "" if args.extend_lens is not None else "the default "
        raise UsageError(
            f"--prefix-lens {_show(args.prefix_lens)}: {len(prefix)} value{'s' * (len(prefix) != 1)} for the "
            f"{len(extend)} requests of {given}--extend-lens {','.join(map(str, extend))}; give one cached "
            "length per request, or leave --prefix-lens out for none"
        )
    return extend, prefix


def check_json_path(value: str) -> str:
    """The report path can be written: probed by opening it for append (a new file is removed)."""
    if os.path.isdir(value):
        raise UsageError(f"--json {_show(value)}: is a directory; give a file path")
    existed = os.path.exists(value)
    try:
        with open(value, "a"):
            pass
    except OSError as e:
        raise UsageError(
            f"--json {_show(value)}: cannot be written ({e.strerror}); give a file in a writable directory"
        ) from None
    if not existed:
        os.remove(value)
    return value


def check_demo_args(args: argparse.Namespace) -> DemoOptions:
    """Every option of the demo checked, in the order --help lists them, before any work."""
    cp = _int("--cp", args.cp, 1, MAX_RANKS, "CP ranks, one process each")
    split = _choice("--split", args.split, list(PATH_SPLIT_MODES), "how tokens are split across ranks")
    page_size = _int("--page-size", args.page_size, 1, MAX_PAGE_SIZE, "tokens per KV page")
    extend, prefix = _lengths(args)
    if sum(extend) + sum(prefix) > MAX_TOKENS:
        given = " ".join(
            f"{option} {_show(value)}"
            for option, value in (("--extend-lens", args.extend_lens), ("--prefix-lens", args.prefix_lens))
            if value is not None
        )
        raise UsageError(f"{given}: {sum(extend) + sum(prefix)} tokens in all; the CPU demo takes at most {MAX_TOKENS}")
    seed = _int("--seed", args.seed, 0, MAX_SEED, "weights and tokens seed")
    config = _choice("--config", args.config, list(CONFIGS), "reference model config")
    dtype = _choice("--dtype", args.dtype, list(DTYPES), "model and KV dtype on CPU")
    decode_steps = DEFAULT_DECODE_STEPS
    if args.decode_steps is not None:
        decode_steps = _int("--decode-steps", args.decode_steps, 0, MAX_DECODE_STEPS, "greedy decode steps")
        if not args.pd:
            raise UsageError(f"--decode-steps {_show(args.decode_steps)}: only used with --pd; add --pd or drop it")
    mooncake_log = None
    if args.mooncake_log is not None:
        mooncake_log = _choice("--mooncake-log", args.mooncake_log, MOONCAKE_LOG_LEVELS, "Mooncake's log level")
        if not args.pd:
            raise UsageError(f"--mooncake-log {_show(args.mooncake_log)}: only used with --pd; add --pd or drop it")
    json_path = None if args.json is None else check_json_path(args.json)
    return DemoOptions(
        cp=cp,
        split=split,
        page_size=page_size,
        extend_lens=extend,
        prefix_lens=prefix,
        seed=seed,
        config=config,
        dtype=dtype,
        prefetch=not args.no_prefetch,
        pd=args.pd,
        decode_steps=decode_steps,
        json_path=json_path,
        mooncake_log=mooncake_log,
    )
