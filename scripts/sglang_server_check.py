"""SGLang 0.5.23's real servers with --enable-nsa-prefill-cp-shared-kv, checked over HTTP against a
non-CP oracle: the GPU run of `bash scripts/gpu_run.sh server` (one H200, every CP rank on GPU 0
over NCCL), and the same checks on CPU (`--device cpu`, the CPU servers of docs/sglang_cpu_server.md).

For each configuration KV_DTYPE:CP (--at-once of them side by side, one cluster each: a PD prefill at CP with
the flag, the same prefill without it, a decode, a non-CP oracle, SGLang's router in front of the
shared-KV prefill and the decode) it sends greedy requests through the three paths and records:
- tokens for a one-page, a multi-page and a chunked prompt, a radix hit (SGLang's cached-token
  count on the shared prefill), and a request after a client abort;
- SGLang's own reports: logical capacity (/v1/loads) and each rank's pool rows and gather
  scratch (its logs);
- `--long-prompt` (GPU): a prompt longer than one rank's pool, the same KV bytes per rank on both
  prefills: the replicated prefill must refuse it (SGLang's message), the shared one serve it
  with the oracle's tokens;
- every GPU stand-in each server used (its log), and each server's start-up time;
- `--layer-split`: SGLang's own layer split (`--enable-dsa-cache-layer-split`, the replicated
  prefill's arguments plus that flag, the same rows per rank) beside the flag: its tokens for the
  same cases against the oracle, its capacity, its answer to the long prompt (a refusal: its
  logical capacity is one rank's rows), and both prefills' collectives counted per forward
  (test/helpers/collective_counter.py) against benchmark/traffic.py's formulas.

`--model glm5-shaped` (helpers/glm5_shaped.py: GLM-5's attention, indexer and vocabulary, 1 dense + 2
MoE layers) also compares SGLang's returned logprobs (helpers/logprob_compare.py) and writes the
memory estimate it checked before starting; `--model toy` (the default) is the 2-layer toy model.

    python scripts/sglang_server_check.py --device cuda --configs bfloat16:2 fp8_e4m3:4 --out DIR
Writes DIR/sglang_server_check_{device}.json and DIR/sglang_server_logs_{device}.tar.xz; exits 1
unless every path gave the oracle's tokens and the long prompt went as expected.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test"))

NEW_TOKENS = 6
GPU_CONFIGS = ["bfloat16:2", "bfloat16:4", "fp8_e4m3:2", "fp8_e4m3:4"]
GLM5_CONFIGS = ["bfloat16:4", "fp8_e4m3:4"]  # --model glm5-shaped: a 128k-token prompt at CP 4
MTP_CONFIGS = ["bfloat16:2", "fp8_e4m3:2"]  # --model mtp-toy: its vocabulary of 128 splits at TP 2
# The configurations share one GPU. Four clusters at once (32 processes) ran an H200 out of memory
# (oracles on their long prompts, then a prefill mid-request): --at-once 2 by default.
# A long prompt's oracle needs GBs for a moment (SGLang's unfused top-k over 8,192 x 100k logits), so
# the long prompts also take turns, each cluster stopping before the next one's turn.
LONG_PROMPT_TURN = threading.Lock()


def _cached_tokens_since(server, mark: int) -> list[int]:
    return [int(n) for n in re.findall(r"#cached-token: (\d+)", server.log_text(mark))]


# The oracle's logprobs may differ from CP's by rounding (another reduction order): this much, in nats.
ORACLE_LOGPROB_ATOL = 0.2
TOKENS_ONLY = "multi-page, no logprobs"  # the narrow tail gather (a logprob request gathers every row)


def run_case(cluster, name: str, ids: list[int], page: int, body, say=print) -> dict:
    """One case: `body(row, ids)` fills the row; a radix hit must also show >= 2 pages cached on the
    shared prefill; an exception becomes the case's `error` and the run goes on."""
    shared = cluster.servers["shared"]
    row = {"case": name, "tokens": len(ids)}
    mark, t0 = len(shared.log_text()), time.monotonic()
    try:
        body(row, ids)
        if name == "radix: hit":
            row["shared_cached_tokens"] = max(_cached_tokens_since(shared, mark), default=0)
            row["equal"] = row["equal"] and row["shared_cached_tokens"] >= 2 * page
    except Exception:  # noqa: BLE001 -- a case's failure is recorded and the run goes on
        row.update(equal=False, error=traceback.format_exc(limit=3))
    row["seconds"] = round(time.monotonic() - t0, 1)
    say(f"{name}: {len(ids)} tokens, {'ok' if row.get('equal') else 'DIFFERS'} in {row['seconds']} s")
    return row


def run_requests(cluster, S, page: int, chunk: int, context: int, top_logprobs: int = 0, say=print,
                 vocab: int | None = None) -> list[dict]:  # fmt: skip
    """Each case's tokens on the three paths (with `top_logprobs`, their logprobs compared too);
    an exception becomes the case's `error`. Prompts draw ids from `vocab` (default: the toy's)."""

    def ids_(n: int, seed: int) -> list[int]:
        return S.prompt_ids(n, seed, vocab)

    prefix = ids_(2 * page + 5, seed=11)
    cases = [
        ("one page", ids_(page - 10, seed=1)),
        ("multi-page", ids_(5 * page + 7, seed=2)),
        *([(TOKENS_ONLY, ids_(5 * page + 7, seed=2))] if top_logprobs else []),
        (f"chunked ({chunk}-token chunks)", ids_(2 * chunk + 40, seed=3)),
        ("radix: first", prefix + ids_(20, seed=12)),
        ("radix: hit", prefix + ids_(30, seed=13)),
        ("abort", ids_(min(8 * chunk, context - page), seed=21)),  # several chunks, within the context
        ("after the abort", ids_(page + 17, seed=22)),
    ]
    rows = []
    for name, ids in cases:

        def body(row, ids, name=name):
            if name == "abort":
                row.update(_abort(cluster, S, ids, context))
            elif name == TOKENS_ONLY:  # deterministic servers: the same tokens as with logprobs
                row.update(S.three_paths(cluster, ids, NEW_TOKENS, timeout_s=300))
                with_logprobs = next(r for r in rows if r["case"] == "multi-page")
                row["equal"] = all(row[p] == with_logprobs.get(p) for p in ("shared", "replicated", "oracle"))
            elif top_logprobs:
                row.update(_with_logprobs(cluster, S, ids, top_logprobs))
            else:
                row.update(S.three_paths(cluster, ids, NEW_TOKENS, timeout_s=300))
                row["equal"] = row["shared"] == row["replicated"] == row["oracle"] and len(row["oracle"]) > 0

        rows.append(run_case(cluster, name, ids, page, body, say))
    return rows


SPEC_NEW_TOKENS = 12


def spec_requests(cluster, S, page: int, chunk: int, say=print) -> list[dict]:
    """`--model mtp-toy` (EAGLE on both prefills and the decode, a non-speculative oracle): for a
    one-chunk prompt, one of three chunks and a radix hit, the three paths' tokens must be the
    oracle's and SGLang's speculative counters equal between the shared and the replicated prefill."""
    from helpers.sglang_gpu_servers import SPEC_FIELDS

    prefix = S.prompt_ids(2 * page + 5, seed=11)
    cases = [("one chunk", S.prompt_ids(40, seed=40)), (f"chunked ({chunk}-token chunks)", S.prompt_ids(3 * chunk + 40, seed=3)),
             ("radix: first", prefix + S.prompt_ids(20, seed=12)), ("radix: hit", prefix + S.prompt_ids(30, seed=13))]  # fmt: skip

    def body(row, ids):
        answers = {}
        row.update(S.three_paths(cluster, ids, SPEC_NEW_TOKENS, timeout_s=300, answers=answers))
        row["spec"] = {p: {k: answers[p]["meta_info"].get(k) for k in SPEC_FIELDS} for p in ("shared", "replicated")}
        row["oracle_speculative"] = "spec_verify_ct" in answers["oracle"]["meta_info"]
        row["equal"] = (row["shared"] == row["replicated"] == row["oracle"] and len(row["oracle"]) == SPEC_NEW_TOKENS
                        and row["spec"]["shared"] == row["spec"]["replicated"] and bool(row["spec"]["shared"]["spec_verify_ct"])
                        and not row["oracle_speculative"])  # fmt: skip
        row["note"] = f"speculative counters, shared prefill: {row['spec']['shared']}"

    rows = [run_case(cluster, name, ids, page, body, say) for name, ids in cases]
    # SGLang's accept length counts the verified token: above 1, the equal counters compare drafts that mattered
    accepted = [r["spec"]["shared"]["spec_accept_length"] for r in rows if r.get("spec")]
    mean = sum(accepted) / len(accepted) if accepted else 0.0
    rows.append({"case": "drafts accepted", "tokens": 0, "seconds": 0.0, "accept_lengths": accepted,
                 "mean_accept_length": mean, "equal": mean > 1, "note": f"mean accept length {mean:.2f}: {accepted}"})  # fmt: skip
    say(f"accept lengths {accepted}: mean {mean:.2f}")
    return rows


def _with_logprobs(cluster, S, ids, top_logprobs: int) -> dict:
    """The three paths with SGLang's logprobs: shared = replicated bit for bit (the same
    arithmetic), each within ORACLE_LOGPROB_ATOL of the oracle (helpers.logprob_compare)."""
    import requests

    from helpers import logprob_compare as LP

    answers = {}
    out = S.three_paths(cluster, ids, NEW_TOKENS, timeout_s=300, extra=LP.logprob_request(top_logprobs),
                        answers=answers)  # fmt: skip
    pos = {path: LP.positions(a) for path, a in answers.items()}
    # The same request to the oracle again with its radix cache flushed: whether the oracle's own
    # answer depends on what it had cached (a difference CP cannot be blamed for).
    single = cluster.servers["single"].url
    requests.post(single + "/flush_cache", timeout=60).raise_for_status()
    fresh = S.generate(single, ids, NEW_TOKENS, timeout_s=300, **LP.logprob_request(top_logprobs))
    pos["oracle_fresh"] = LP.positions(fresh)
    out["oracle_fresh"] = fresh["output_ids"]
    out["logprobs"] = {
        "shared_vs_replicated": LP.exact(pos["shared"], pos["replicated"]),
        "shared_vs_oracle": LP.against_oracle(pos["shared"], pos["oracle"], ORACLE_LOGPROB_ATOL),
        "replicated_vs_oracle": LP.against_oracle(pos["replicated"], pos["oracle"], ORACLE_LOGPROB_ATOL),
        "shared_vs_oracle_fresh": LP.against_oracle(pos["shared"], pos["oracle_fresh"], ORACLE_LOGPROB_ATOL),
        "oracle_fresh_vs_oracle": LP.against_oracle(pos["oracle_fresh"], pos["oracle"], ORACLE_LOGPROB_ATOL),
        "positions": pos,
    }
    lp = out["logprobs"]
    out["equal"] = (lp["shared_vs_replicated"]["equal"] and lp["shared_vs_oracle"]["ok"]
                    and lp["replicated_vs_oracle"]["ok"] and len(out["oracle"]) > 0)  # fmt: skip
    return out


ABORT_NEW_TOKENS = 4000  # a long decode: the client leaves while its request is still being served
CLIENT_LEFT = "disconnected from the client side|Aborted by AbortReq"


def _abort(cluster, S, ids, context: int) -> dict:
    """The client leaves mid-request (mid-prefill on CPU; on a GPU the prefill is done within a
    second, so mid-decode); a server holding it must notice, and both stay usable (the next case)."""
    import requests

    shared, decode = cluster.servers["shared"], cluster.servers["decode"]
    marks = {s.name: len(s.log_text()) for s in (shared, decode)}
    try:
        S.generate(cluster.router_url, ids, min(ABORT_NEW_TOKENS, context - len(ids) - 64), timeout_s=2.0)
        return {"equal": False, "note": "finished before the client left: abort not exercised"}
    except requests.exceptions.ReadTimeout:
        pass
    deadline, seen = time.monotonic() + 90, {}
    while not any(seen.values()) and time.monotonic() < deadline:
        seen = {s.name: bool(re.search(CLIENT_LEFT, s.log_text(marks[s.name]))) for s in (shared, decode)}
        time.sleep(0.5)
    return {"equal": any(seen.values()), "saw_client_leave": seen}


def long_prompt(cluster, S, length: int, top_logprobs: int = 0, vocab: int | None = None) -> dict:
    """A prompt past one rank's pool: replicated refuses it (SGLang's message), shared serves it
    with the oracle's tokens (with `top_logprobs`: within ORACLE_LOGPROB_ATOL of its logprobs)."""
    from helpers import demo
    from helpers import logprob_compare as LP

    ids = S.prompt_ids(length, seed=31, vocab_size=vocab)
    out = {"tokens": length}
    extra = LP.logprob_request(top_logprobs) if top_logprobs else {}
    t0 = time.monotonic()
    oracle = S.generate(cluster.servers["single"].url, ids, NEW_TOKENS, timeout_s=600, **extra)
    out["oracle_seconds"] = round(time.monotonic() - t0, 1)
    shared = S.generate(cluster.router_url, ids, NEW_TOKENS, timeout_s=600, **extra)
    out["shared_seconds"] = round(time.monotonic() - t0 - out["oracle_seconds"], 1)
    out["oracle"], out["shared"] = oracle["output_ids"], shared["output_ids"]
    message = demo.refusal(cluster.servers["replicated"], ids, timeout_s=120)  # HTTP 400's message, or None
    out["replicated"] = f"HTTP 400: {message}" if message is not None else "taken in"
    out["replicated_refused"] = message is not None
    if top_logprobs:
        out["shared_vs_oracle"] = LP.against_oracle(LP.positions(shared), LP.positions(oracle), ORACLE_LOGPROB_ATOL)
        out["ok"] = out["replicated_refused"] and out["shared_vs_oracle"]["ok"]
    else:
        out["ok"] = out["replicated_refused"] and out["shared"] == out["oracle"]
    return out


LAYER_SPLIT_CASES = ("one page", "multi-page", "chunked", "radix: first", "radix: hit")


def layer_split_check(cluster, S, page: int, chunk: int, per_rank: int, long_prompt_tokens: int) -> dict:
    """The layer-split prefill beside the flag: tokens (through it and the decode, as the router
    would) against the oracle for the cases of `run_requests`, capacity, the long prompt."""
    from helpers import demo

    ls, decode, oracle = cluster.servers["layer_split"], cluster.servers["decode"], cluster.servers["single"]
    prefix = S.prompt_ids(2 * page + 5, seed=11)
    prompts = dict(zip(LAYER_SPLIT_CASES, (
        S.prompt_ids(page - 10, seed=1), S.prompt_ids(5 * page + 7, seed=2), S.prompt_ids(2 * chunk + 40, seed=3),
        prefix + S.prompt_ids(20, seed=12), prefix + S.prompt_ids(30, seed=13))))  # fmt: skip
    out = {"requests": []}
    for name, ids in prompts.items():
        mark, t0 = len(ls.log_text()), time.monotonic()
        row = {"case": name, "tokens": len(ids)}
        try:
            _, answer = S.generate_pd(ls, decode, ids, NEW_TOKENS, timeout_s=300)
            if isinstance(answer, Exception):
                raise answer
            row["layer_split"] = answer["output_ids"]
            row["oracle"] = S.generate(oracle.url, ids, NEW_TOKENS, timeout_s=300)["output_ids"]
            row["equal"] = row["layer_split"] == row["oracle"] and len(row["oracle"]) > 0
            if name == "radix: hit":
                row["cached_tokens"] = max(_cached_tokens_since(ls, mark), default=0)
                row["equal"] = row["equal"] and row["cached_tokens"] >= 2 * page
        except Exception:  # noqa: BLE001 -- recorded, the run goes on
            row.update(equal=False, error=traceback.format_exc(limit=3))
        row["seconds"] = round(time.monotonic() - t0, 1)
        out["requests"].append(row)
    out["capacity"] = demo.capacity(ls)
    if long_prompt_tokens:
        message = demo.refusal(ls, S.prompt_ids(long_prompt_tokens, seed=31), timeout_s=120)
        out["long_prompt"] = {"tokens": long_prompt_tokens, "refused": message is not None, "message": message,
                              "ok": message is not None and long_prompt_tokens > per_rank}  # fmt: skip
    return out


def counted_traffic(cluster, kv: str, cp: int, pool_rows: int, layers: int) -> dict:
    """Per prefill and CP rank, each extend forward's counted KV bytes against traffic.py's: layer
    split's owner broadcasts, the flag's history gather (an all-gather's output: bus bytes / ((N-1)/N))."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
    import traffic

    from helpers import collective_counter as C

    row_kind = "fp8" if kv == "fp8_e4m3" else "bf16"
    sites = {"layer_split": ("broadcast", "sglang.srt.mem_cache.dsa_cache_layer_split", "owner broadcast"),
             "shared": ("all_gather", "sglang.srt.mem_cache.page_interleave_pool", "history all-gather")}  # fmt: skip
    out = {}
    for name, (op, site, term) in sites.items():
        rows = []
        for report in C.read_reports(os.environ[C.ENV], cluster.servers[name].ports[0]):
            for f in report["forwards"]:
                if f.get("mode") != "EXTEND":
                    continue
                batch = traffic.Batch(tuple(zip(f["extend_lens"], f["prefix_lens"])))
                terms = [
                    t for t in traffic.kv_terms(name, cp, row_kind, layers, batch, pool_rows) if t.name.startswith(term)
                ]
                scale = 1 if op == "broadcast" else (cp - 1) / cp
                formula = round(sum(t.forward_bus_bytes for t in terms) / scale)
                counted = sum(c["bytes"] for c in f["calls"] if c["op"] == op and c["site"].startswith(site))
                rows.append({"rank": report["attn_cp_rank"], "batch": batch.requests, "counted": counted,
                             "formula": formula})  # fmt: skip
        out[name] = {"forwards": rows, "exact": bool(rows) and all(r["counted"] == r["formula"] for r in rows)}
    return out


def run_config(result: dict, args) -> None:
    """Fills `result` (kv_cache_dtype, cp) as it goes, so a run cut short still reports what it did."""
    from helpers import demo

    from helpers import sglang_gpu_servers as GS
    from helpers import sglang_servers as S

    kv, cp = result["kv_cache_dtype"], result["cp"]
    spec = GS.MODELS[args.model]
    top_logprobs = spec.top_logprobs

    def say(line: str) -> None:
        print(f"[{time.monotonic() - args.t0:5.0f} s] {kv} CP={cp}: {line}", flush=True)

    if args.device == "cuda":
        cluster = GS.GpuCluster(Path(tempfile.mkdtemp(prefix=f"srv_{kv}_cp{cp}_")), cp=cp, kv_cache_dtype=kv,
                                spec=spec, checkpoint=args.checkpoint)  # fmt: skip
        page, chunk, per_rank, context = S.PAGE, spec.chunk, spec.per_rank, spec.context
        vocab = None if args.model == "toy" else spec.config["vocab_size"]  # the toy's prompts: run 7's
    else:
        from helpers import glm5_shaped

        workdir = Path(tempfile.mkdtemp(prefix="srv_cpu_"))
        cluster = S.Cluster(workdir) if args.model == "toy" else glm5_shaped.TinyCluster(workdir)
        page, chunk, per_rank = S.PAGE, S.CHUNK_TOKENS, S.MAX_TOTAL_TOKENS
        cfg = S.MODEL if args.model == "toy" else glm5_shaped.tiny()
        context, vocab = cfg["max_position_embeddings"], cfg["vocab_size"]
    result["workdir"] = str(cluster.workdir)
    if args.layer_split:
        cluster.roles = (*cluster.roles, "layer_split")
    try:
        say("starting the servers")
        with contextlib.ExitStack() as turn, cluster.running(timeout_s=args.startup_timeout_s):
            result["startup_s"] = round(cluster.startup_s, 1)
            say(f"servers up in {result['startup_s']} s")
            if spec.speculative:
                result["requests"] = spec_requests(cluster, S, page, chunk, say)
            else:
                result["requests"] = run_requests(cluster, S, page, chunk, context, top_logprobs, say, vocab)
            result["capacity"] = {name: demo.capacity(cluster.servers[name]) for name in ("shared", "replicated")}
            if args.long_prompt and args.device == "cuda":
                turn.enter_context(LONG_PROMPT_TURN)  # released after the servers stop
                length = min(args.long_prompt, cp * per_rank - 4 * chunk)
                say(f"long prompt: {length} tokens")
                result["long_prompt"] = long_prompt(cluster, S, length, top_logprobs, vocab)
                say(f"long prompt: {'ok' if result['long_prompt']['ok'] else 'FAILED'}")
            if args.layer_split:
                long_tokens = min(args.long_prompt, cp * per_rank - 4 * chunk) if args.device == "cuda" else 0
                result["layer_split"] = layer_split_check(cluster, S, page, chunk, per_rank, long_tokens)
                layers = (spec.config if args.device == "cuda" else cfg)["num_hidden_layers"]
                result["traffic"] = counted_traffic(cluster, kv, cp, per_rank, layers)
            result["stand_ins"] = {name: _stand_ins(p) for name, p in cluster.servers.items()}
    except Exception as e:  # noqa: BLE001 -- what failed goes to the table (which server, its log's end), all to JSON
        result["error"] = traceback.format_exc(limit=4)
        lines = str(e).splitlines() or [""]
        result["error_summary"] = "\n".join([f"{type(e).__name__}: {lines[0]}", *lines[-12:][1:]])


def _stand_ins(server) -> list[str]:
    return sorted(set(re.findall(r"gpu stand-in (?:lookup|call): (\S+ at \S+)", server.log_text())))


def verdict(r: dict) -> bool:
    reqs_ok = bool(r.get("requests")) and all(q.get("equal") for q in r["requests"])
    long_ok = r.get("long_prompt", {"ok": True})["ok"]
    ls = r.get("layer_split", {"requests": [{"equal": True}]})
    ls_ok = all(q.get("equal") for q in ls["requests"]) and ls.get("long_prompt", {"ok": True})["ok"]
    traffic_ok = all(t["exact"] for t in r.get("traffic", {}).values())
    return "error" not in r and reqs_ok and long_ok and ls_ok and traffic_ok


def print_table(results: list[dict]) -> None:
    for r in results:
        head = f"{r['kv_cache_dtype']} CP={r['cp']}"
        if "error" in r or "requests" not in r or "capacity" not in r:
            print(f"{head}: FAILED: {r.get('error_summary') or r.get('error', 'incomplete')}")
            continue
        print(f"{head}: servers up in {r['startup_s']} s")
        for q in r["requests"]:
            detail = q.get("error", "").strip().splitlines()[-1:] or [q.get("note", "") or _logprob_line(q)]
            print(f"  {q['case']:<28} {q['tokens']:>7} tok  {'ok' if q.get('equal') else 'DIFFERS'}  "
                  f"{q['seconds']:>6.1f} s  {detail[0]}")  # fmt: skip
        cap = r["capacity"]
        ratio = cap["shared"]["logical_tokens"] / cap["replicated"]["logical_tokens"]
        print(f"  logical capacity: shared {cap['shared']['logical_tokens']} vs replicated "
              f"{cap['replicated']['logical_tokens']} tokens ({ratio:.2f} x); pool rows per rank "
              f"{cap['shared']['pool_rows']} vs {cap['replicated']['pool_rows']}; scratch MiB per rank "
              f"{cap['shared']['scratch_mib']}")  # fmt: skip
        if "long_prompt" in r:
            lp = r["long_prompt"]
            print(f"  long prompt {lp['tokens']} tokens: replicated {lp['replicated'][:160]!r}; shared "
                  f"{'= oracle' if lp['shared'] == lp['oracle'] else 'DIFFERS'} ({lp['shared_seconds']} s)"
                  + (f"; vs oracle: {_oracle_line(lp['shared_vs_oracle'])}" if "shared_vs_oracle" in lp else ""))  # fmt: skip
        if "layer_split" in r:
            ls = r["layer_split"]
            same = sum(bool(q.get("equal")) for q in ls["requests"])
            print(f"  layer split: {same}/{len(ls['requests'])} cases = oracle; logical capacity "
                  f"{ls['capacity']['logical_tokens']} tokens, pool rows per rank {ls['capacity']['pool_rows']}")  # fmt: skip
            if "long_prompt" in ls:
                print(
                    f"  layer split, long prompt {ls['long_prompt']['tokens']} tokens: {ls['long_prompt']['message']!r}"
                )
        for name, t in r.get("traffic", {}).items():
            sums = [(f["counted"], f["formula"]) for f in t["forwards"]]
            print(f"  {name}: KV bytes per forward counted = formula: {t['exact']} over {len(sums)} rank-forwards "
                  f"(counted, formula: {sums[:6]}{' ...' if len(sums) > 6 else ''})")  # fmt: skip
        used = sorted({u for names in r["stand_ins"].values() for u in names})
        print(f"  GPU stand-ins used: {len(used)}" + "".join(f"\n    {u}" for u in used))


def _oracle_line(c: dict) -> str:
    tie = (
        ""
        if c["first_divergence"] is None
        else (f", tokens part at {c['first_divergence']} (oracle margin {c['oracle_margin_at_divergence']:.3g})")
    )
    return f"max |logprob diff| {c['max_abs_logprob_diff']:.3g}{tie}"


def _logprob_line(q: dict) -> str:
    lp = q.get("logprobs")
    if not lp:
        return ""
    same = (
        "shared = replicated bit for bit"
        if lp["shared_vs_replicated"]["equal"]
        else (f"shared != replicated from token {lp['shared_vs_replicated']['first_difference']}")
    )
    fresh = lp.get("shared_vs_oracle_fresh")
    again = (
        f"; vs the oracle with its cache flushed: {_oracle_line(fresh)}; the oracle against itself (flushed vs "
        f"not): {_oracle_line(lp['oracle_fresh_vs_oracle'])}"
        if fresh
        else ""
    )
    return f"{same}; vs oracle: {_oracle_line(lp['shared_vs_oracle'])}{again}"


def model_shape(name: str, device: str) -> dict:
    """What the results file says about the checkpoint that ran (its config, not a model card)."""
    from helpers import glm5_shaped
    from helpers.sglang_gpu_servers import MODELS

    cfg = MODELS[name].config if device == "cuda" or name == "toy" else glm5_shaped.tiny()
    keys = ("num_hidden_layers", "first_k_dense_replace", "n_routed_experts", "num_experts_per_tok",
            "num_nextn_predict_layers", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
            "qk_rope_head_dim", "index_n_heads", "index_head_dim", "index_topk", "vocab_size",
            "max_position_embeddings")  # fmt: skip
    shape = {k: cfg[k] for k in keys if k in cfg}
    if MODELS[name].speculative:
        line = (f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, GLM-5's architecture and its "
                "NextN layer built from layer 0's weights, served with EAGLE (top-k 1)")  # fmt: skip
        return {"toy model": line, **shape}
    if name == "toy":
        line = f"{shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, random weights"
        return {"toy model": line, **shape}
    dense = min(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
    line = (f"{cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers ({dense} dense, "
            f"{cfg['num_hidden_layers'] - dense} MoE of {cfg['n_routed_experts']} experts, top-{cfg['num_experts_per_tok']}"
            f") + the NextN layer in the checkpoint (not loaded), random seeded bf16 weights")  # fmt: skip
    label = "glm5-shaped model" if device == "cuda" else "glm5-shaped structure at CPU sizes (glm5_shaped.tiny)"
    return {label: line, **shape}


def run_provenance(results: list[dict], model: str = "toy", device: str = "cuda") -> dict:
    """benchmark/provenance.py's block: commit, machine, command, the checkpoint's shape, stand-ins."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
    from provenance import provenance

    used = sorted({u for r in results for names in r.get("stand_ins", {}).values() for u in names})
    return provenance(model_shape(model, device), used)


def memory_plan(args, configs) -> dict:
    """glm5-shaped on the GPU: each configuration's estimate (helpers.glm5_shaped.memory_estimate)
    and whether --at-once of them plus one long prompt fit the GPU."""
    import torch

    from helpers import glm5_shaped
    from helpers.sglang_gpu_servers import MODELS

    spec = MODELS[args.model]
    pools = spec.pools(args.long_prompt)
    est = {f"{kv}:{cp}": glm5_shaped.memory_estimate(spec.config, kv, cp, pools) for kv, cp in configs}
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / glm5_shaped.GIB if torch.cuda.is_available() else 139.0
    ok, need = glm5_shaped.fits(list(est.values()), args.at_once, gpu_gib)
    return {"per_config": est, "at_once": args.at_once, "need_gib": need, "gpu_gib": round(gpu_gib, 1), "fits": ok}


def _write_checkpoint_once(model: str, t0: float) -> str:
    """The checkpoint every cluster loads, written once (its tensors made on the GPU)."""
    import torch

    from helpers import sglang_gpu_servers as GS

    path = tempfile.mkdtemp(prefix=f"{model}_")
    GS.write_model(path, GS.MODELS[model], device="cuda")
    torch.cuda.empty_cache()
    size = sum(f.stat().st_size for f in Path(path).iterdir()) / (1 << 30)
    print(f"[{time.monotonic() - t0:5.0f} s] {model} checkpoint: {size:.2f} GiB in {path}", flush=True)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=("toy", "glm5-shaped", "glm5-shaped-dense", "mtp-toy"), default="toy",
                   help="toy: the 2-layer hidden-64 model; glm5-shaped: GLM-5's attention, indexer and vocabulary, "
                   "1 dense + 2 MoE layers (helpers/glm5_shaped.py; on cpu the same structure at CPU sizes); mtp-toy "
                   "(cuda): GLM-5's architecture with a NextN layer from the target's weights, EAGLE on both "
                   "prefills and the decode")  # fmt: skip
    p.add_argument("--configs", nargs="+", help="KV_DTYPE:CP, e.g. fp8_e4m3:4 (default: bf16 and fp8 at CP 2 and 4 "
                   "on cuda, bfloat16:2 on cpu)")  # fmt: skip
    p.add_argument("--long-prompt", type=int, help="tokens of the long prompt (cuda only; default 100000, "
                   "glm5-shaped 131072; 0: none)")  # fmt: skip
    p.add_argument("--startup-timeout-s", type=float, default=400)
    p.add_argument("--at-once", type=int, default=2, help="configurations running side by side (default 2)")
    p.add_argument("--deadline-s", type=float, default=3000, help="report what finished by then, and stop")
    p.add_argument("--out", default="benchmark/results")
    p.add_argument("--layer-split", action="store_true", help="add SGLang's layer split prefill beside the flag "
                   "(--enable-dsa-cache-layer-split) and count both prefills' collectives per forward")  # fmt: skip
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    defaults = {"glm5-shaped": GLM5_CONFIGS, "mtp-toy": MTP_CONFIGS}.get(args.model, GPU_CONFIGS)
    args.configs = args.configs or (defaults if gpu
                                    else ["bfloat16:2"])  # fmt: skip
    from helpers.sglang_gpu_servers import MODELS

    args.long_prompt = (MODELS[args.model].long_prompt if gpu else 0) if args.long_prompt is None else args.long_prompt
    configs = []
    for c in args.configs:
        kv, _, cp = c.partition(":")
        if kv not in ("bfloat16", "fp8_e4m3") or not cp.isdigit() or int(cp) < 2:
            p.error(f"--configs {c!r}: expected bfloat16:N or fp8_e4m3:N with N >= 2")
        configs.append((kv, int(cp)))
    if args.at_once < 1:
        p.error(f"--at-once {args.at_once}: expected 1 or more")
    if not gpu and args.model == "mtp-toy":
        p.error("--model mtp-toy runs on cuda; on cpu, test/system/test_sglang_server_speculative.py serves it")
    if MODELS[args.model].speculative and args.layer_split:
        p.error(
            "--model mtp-toy with --layer-split: not built (the speculative check compares the flag with replicated CP)"
        )
    if not gpu and configs != [("bfloat16", 2)]:
        p.error(f"--device cpu runs bfloat16:2 only (the CPU servers' roles), got {' '.join(args.configs)}")
    t0 = args.t0 = time.monotonic()
    if gpu:  # this process imports SGLang's CP helpers (traffic.py): sgl_kernel's op library cannot load here
        from helpers import gpu_stand_ins

        gpu_stand_ins.install()
    # the clusters write their tokenizers in parallel threads: transformers' lazy import is not thread-safe
    from transformers import PreTrainedTokenizerFast  # noqa: F401

    plan, args.checkpoint = None, ""
    if gpu and args.model != "toy":
        plan = memory_plan(args, configs)
        print(f"memory estimate: {plan['need_gib']} GiB of {plan['gpu_gib']} for {args.at_once} at once "
              f"({'fits' if plan['fits'] else 'does NOT fit: use --at-once 1'}); per configuration "
              + ", ".join(f"{c} {e['steady_gib']} GiB" for c, e in plan["per_config"].items()), flush=True)  # fmt: skip
        args.checkpoint = _write_checkpoint_once(args.model, t0)
    if args.layer_split:  # every scheduler writes its counts here (test/helpers/collective_counter.py)
        from helpers import collective_counter

        os.environ[collective_counter.ENV] = tempfile.mkdtemp(prefix="collectives_")
    results = [{"kv_cache_dtype": kv, "cp": cp} for kv, cp in configs]
    slots = threading.Semaphore(args.at_once)

    def in_turn(result: dict) -> None:
        with slots:
            run_config(result, args)

    threads = [threading.Thread(target=in_turn, args=(r,), daemon=True) for r in results]
    for t in threads:
        t.start()
    for t, r in zip(threads, results):
        t.join(max(0.0, args.deadline_s - (time.monotonic() - t0)))
        if t.is_alive():  # reported as it stands; the servers die with this process
            r["error"] = f"did not finish within --deadline-s {args.deadline_s:.0f} (stage reached: {sorted(r)})"
    ok = all(verdict(r) for r in results)
    print_table(results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"sglang_server_check_{args.device}.json"), "w") as f:
        json.dump({"provenance": run_provenance(results, args.model, args.device), "ok": ok,
                   "wall_s": round(time.monotonic() - t0, 1), "memory_estimate": plan,
                   "oracle_logprob_atol": ORACLE_LOGPROB_ATOL, "configs": results}, f, indent=1, default=str)  # fmt: skip
    with tarfile.open(os.path.join(args.out, f"sglang_server_logs_{args.device}.tar.xz"), "w:xz") as tar:
        for r in results:
            if os.path.isdir(os.path.join(r.get("workdir", ""), "logs")):
                tar.add(os.path.join(r["workdir"], "logs"), arcname=f"{r['kv_cache_dtype']}_cp{r['cp']}")
    print(f"sglang_server_check: {'ok' if ok else 'FAILED'} in {time.monotonic() - t0:.0f} s", flush=True)
    if any(t.is_alive() for t in threads):
        os._exit(1)  # its servers die with it (PR_SET_PDEATHSIG)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
