"""The `--enable-nsa-prefill-cp-shared-kv` flag. Mirrors `sglang/srt/server_args.py`.

Targets:
- `sglang.srt.server_args.ServerArgs.add_cli_args` (AFTER): adds the flag to the parser, so it
  shows in `--help` and works in `--config` YAML files.
- `sglang.srt.server_args.ServerArgs.from_cli_args` (AROUND): copies the parsed value onto the
  record as the bookkeeping attribute `_nsa_cp_shared_kv_requested`.

ServerArgs is a msgspec struct assembled from SGLang's field namespaces; there is no public way to
add a field. Underscore attributes are bookkeeping: ServerArgs allows them at any time and
`ServerArgs.__reduce__` pickles them, so the value reaches every scheduler process. `Engine(**kw)`
builds ServerArgs without a parser, hence the env var `SGLANG_NSA_CP_SHARED_KV=1`. The request
(flag or env var) is validated during resolution (`arg_groups/parallel_hook.py`), which then
writes the decision `_nsa_cp_shared_kv = True` on a prefill, `_nsa_cp_shared_kv_decode = True` on a decode (the same
flag there is the decode's opt-in: it serves shared-KV prefills); the runtime hooks read only those
decisions, so without the flag every hook hands SGLang its own classes and results.
"""

from __future__ import annotations

import argparse

from sglang_nsa_cp.envs import envs

FLAG = "--enable-nsa-prefill-cp-shared-kv"
REQUEST_ATTR = "_nsa_cp_shared_kv_requested"  # what the operator asked for (CLI)
ATTR = "_nsa_cp_shared_kv"  # the validated decision the runtime reads (a PD prefill)
DECODE_ATTR = "_nsa_cp_shared_kv_decode"  # the validated decision of a PD decode (its opt-in)
_DEST = "enable_nsa_prefill_cp_shared_kv"

HELP = (
    "Keep one shared copy of the DSA KV cache (MLA latent and indexer keys) per prefill CP "
    "group instead of one per rank, on Hopper: turns on SGLang's own KV sharding "
    "(--enable-kv-cache-sharding) for --dsa-prefill-backend flashmla_sparse or flashmla_sparse_q8 with "
    "bf16 or fp8 KV; "
    "each CP rank stores the pages it owns, and a layer's cached prefix is all-gathered one layer "
    "ahead. Needs a DSA model "
    "(DeepSeek-V3.2, GLM-5), --enable-prefill-cp --cp-strategy interleave --attn-cp-size N>1 "
    "and --disaggregation-mode prefill with --disaggregation-transfer-backend mooncake. "
    "On a --disaggregation-mode decode instance the same flag is its opt-in to serve such prefills "
    "(a shared-KV prefill refuses a decode without it); it still serves every other prefill as SGLang does. "
    "Provided by the sglang-nsa-cp plugin; SGLANG_NSA_CP_SHARED_KV=1 is the same for "
    "sglang.Engine users."
)


def add_cli_args(result, parser: argparse.ArgumentParser) -> None:
    """AFTER hook on `ServerArgs.add_cli_args`: declare the flag (once per parser)."""
    if any(FLAG in action.option_strings for action in parser._actions):
        return
    parser.add_argument(FLAG, dest=_DEST, action="store_true", default=False, help=HELP)


class SharedKVConfigError(ValueError):
    """Server arguments that shared-KV prefill CP cannot run with."""

    @classmethod
    def listing(cls, problems: list[str]) -> "SharedKVConfigError":
        lines = "\n".join(f"  - {p}" for p in problems)
        return cls(f"{FLAG}: {len(problems)} problem(s) with the server arguments:\n{lines}")


def from_cli_args(original, cls, args: argparse.Namespace):
    """AROUND hook on `ServerArgs.from_cli_args`: carry the flag on the record; refuse it at once
    when no resolution step would validate it (SGLang refused those hooks: it would be ignored)."""
    server_args = original(cls, args)
    setattr(server_args, REQUEST_ATTR, bool(getattr(args, _DEST, False)))
    if requested(server_args):
        from sglang_nsa_cp.sglang_ext.ledger import unvalidated_problem

        problem = unvalidated_problem()
        if problem:
            raise SharedKVConfigError.listing([problem])
    return server_args


def requested(server_args) -> bool:
    """Whether the operator asked for shared KV: the flag, or SGLANG_NSA_CP_SHARED_KV=1."""
    return bool(getattr(server_args, REQUEST_ATTR, False)) or envs.SGLANG_NSA_CP_SHARED_KV.get()


def _decision(attr: str) -> bool:
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # "Global server args is not set yet!"
        return envs.SGLANG_NSA_CP_SHARED_KV.get()
    return bool(getattr(server_args, attr, False))


def is_enabled() -> bool:
    """Whether this process is a shared-KV prefill (the resolved decision on the published
    ServerArgs). Processes without published ServerArgs (unit tests, tools) read the env var."""
    return _decision(ATTR)


def decode_opted_in() -> bool:
    """Whether this process is a PD decode that opted in to shared-KV prefills (the flag on the
    decode, resolved); without published ServerArgs, the env var."""
    return _decision(DECODE_ATTR)


def acts() -> bool:
    """Whether the plugin acts in this process at all (a shared-KV prefill or an opted-in decode);
    else every hook hands SGLang its own classes and results."""
    return is_enabled() or decode_opted_in()
