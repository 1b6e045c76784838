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
- every GPU stand-in each server used (its log), and each server's start-up time.

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
# The configurations share one GPU. Four clusters at once (32 processes) ran an H200 out of memory
# (oracles on their long prompts, then a prefill mid-request): --at-once 2 by default.
# A long prompt's oracle needs GBs for a moment (SGLang's unfused top-k over 8,192 x 100k logits), so
# the long prompts also take turns, each cluster stopping before the next one's turn.
LONG_PROMPT_TURN = threading.Lock()


def _cached_tokens_since(server, mark: int) -> list[int]:
    return [int(n) for n in re.findall(r"#cached-token: (\d+)", server.log_text(mark))]


def run_requests(cluster, S, page: int, chunk: int, context: int) -> list[dict]:
    """Each case's tokens on the three paths; an exception becomes the case's `error`."""
    shared = cluster.servers["shared"]
    prefix = S.prompt_ids(2 * page + 5, seed=11)
    cases = [
        ("one page", S.prompt_ids(page - 10, seed=1)),
        ("multi-page", S.prompt_ids(5 * page + 7, seed=2)),
        (f"chunked ({chunk}-token chunks)", S.prompt_ids(2 * chunk + 40, seed=3)),
        ("radix: first", prefix + S.prompt_ids(20, seed=12)),
        ("radix: hit", prefix + S.prompt_ids(30, seed=13)),
        ("abort", S.prompt_ids(min(8 * chunk, context - page), seed=21)),  # several chunks, within the context
        ("after the abort", S.prompt_ids(page + 17, seed=22)),
    ]
    rows = []
    for name, ids in cases:
        row = {"case": name, "tokens": len(ids)}
        mark = len(shared.log_text())
        t0 = time.monotonic()
        try:
            if name == "abort":
                row.update(_abort(cluster, S, ids, context))
            else:
                row.update(S.three_paths(cluster, ids, NEW_TOKENS, timeout_s=300))
                row["equal"] = row["shared"] == row["replicated"] == row["oracle"] and len(row["oracle"]) > 0
            if name == "radix: hit":
                row["shared_cached_tokens"] = max(_cached_tokens_since(shared, mark), default=0)
                row["equal"] = row["equal"] and row["shared_cached_tokens"] >= 2 * page
        except Exception:  # noqa: BLE001 -- a case's failure is recorded and the run goes on
            row.update(equal=False, error=traceback.format_exc(limit=3))
        row["seconds"] = round(time.monotonic() - t0, 1)
        rows.append(row)
    return rows


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


def long_prompt(cluster, S, length: int) -> dict:
    """A prompt past one rank's pool: replicated refuses it (SGLang's message), shared serves it."""
    from helpers import demo

    ids = S.prompt_ids(length, seed=31)
    out = {"tokens": length}
    t0 = time.monotonic()
    out["oracle"] = S.generate(cluster.servers["single"].url, ids, NEW_TOKENS, timeout_s=600)["output_ids"]
    out["shared"] = S.generate(cluster.router_url, ids, NEW_TOKENS, timeout_s=600)["output_ids"]
    out["shared_seconds"] = round(time.monotonic() - t0, 1)
    message = demo.refusal(cluster.servers["replicated"], ids, timeout_s=120)  # HTTP 400's message, or None
    out["replicated"] = f"HTTP 400: {message}" if message is not None else "taken in"
    out["replicated_refused"] = message is not None
    out["ok"] = out["replicated_refused"] and out["shared"] == out["oracle"]
    return out


def run_config(result: dict, args) -> None:
    """Fills `result` (kv_cache_dtype, cp) as it goes, so a run cut short still reports what it did."""
    from helpers import demo

    kv, cp = result["kv_cache_dtype"], result["cp"]

    if args.device == "cuda":
        from helpers import sglang_gpu_servers as GS
        from helpers import sglang_servers as S

        cluster = GS.GpuCluster(Path(tempfile.mkdtemp(prefix=f"srv_{kv}_cp{cp}_")), cp=cp, kv_cache_dtype=kv)
        page, chunk, per_rank, context = S.PAGE, GS.CHUNK_TOKENS, GS.PREFILL_TOKENS_PER_RANK, GS.CONTEXT_TOKENS
    else:
        from helpers import sglang_servers as S

        cluster = S.Cluster(Path(tempfile.mkdtemp(prefix="srv_cpu_")))
        page, chunk, per_rank = S.PAGE, S.CHUNK_TOKENS, S.MAX_TOTAL_TOKENS
        context = S.MODEL["max_position_embeddings"]
    result["workdir"] = str(cluster.workdir)
    try:
        with contextlib.ExitStack() as turn, cluster.running(timeout_s=args.startup_timeout_s):
            result["startup_s"] = round(cluster.startup_s, 1)
            result["requests"] = run_requests(cluster, S, page, chunk, context)
            result["capacity"] = {name: demo.capacity(cluster.servers[name]) for name in ("shared", "replicated")}
            if args.long_prompt and args.device == "cuda":
                turn.enter_context(LONG_PROMPT_TURN)  # released after the servers stop
                result["long_prompt"] = long_prompt(cluster, S, min(args.long_prompt, cp * per_rank - 4 * chunk))
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
    return "error" not in r and reqs_ok and long_ok


def print_table(results: list[dict]) -> None:
    for r in results:
        head = f"{r['kv_cache_dtype']} CP={r['cp']}"
        if "error" in r or "requests" not in r or "capacity" not in r:
            print(f"{head}: FAILED: {r.get('error_summary') or r.get('error', 'incomplete')}")
            continue
        print(f"{head}: servers up in {r['startup_s']} s")
        for q in r["requests"]:
            detail = q.get("error", "").strip().splitlines()[-1:] or [q.get("note", "")]
            print(f"  {q['case']:<28} {q['tokens']:>7} tok  {'= oracle' if q.get('equal') else 'DIFFERS'}  "
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
                  f"{'= oracle' if lp['shared'] == lp['oracle'] else 'DIFFERS'} ({lp['shared_seconds']} s)")  # fmt: skip
        used = sorted({u for names in r["stand_ins"].values() for u in names})
        print(f"  GPU stand-ins used: {len(used)}" + "".join(f"\n    {u}" for u in used))


def run_provenance(results: list[dict]) -> dict:
    """benchmark/provenance.py's block: commit, machine, command, the checkpoint's shape, stand-ins."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
    from provenance import provenance

    from helpers.sglang_gpu_servers import MODEL

    shape = {k: MODEL[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "kv_lora_rank",
                                   "qk_rope_head_dim", "index_topk", "vocab_size") if k in MODEL}  # fmt: skip
    model = {"toy model": f"{shape.get('num_hidden_layers')} layers, hidden {shape.get('hidden_size')}, random weights",
             **shape}  # fmt: skip
    used = sorted({u for r in results for names in r.get("stand_ins", {}).values() for u in names})
    return provenance(model, used)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--configs", nargs="+", help="KV_DTYPE:CP, e.g. fp8_e4m3:4 (default: bf16 and fp8 at CP 2 and 4 "
                   "on cuda, bfloat16:2 on cpu)")  # fmt: skip
    p.add_argument("--long-prompt", type=int, help="tokens of the long prompt (cuda only; default 100000; 0: none)")
    p.add_argument("--startup-timeout-s", type=float, default=400)
    p.add_argument("--at-once", type=int, default=2, help="configurations running side by side (default 2)")
    p.add_argument("--deadline-s", type=float, default=3000, help="report what finished by then, and stop")
    p.add_argument("--out", default="benchmark/results")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    args.configs = args.configs or (GPU_CONFIGS if gpu else ["bfloat16:2"])
    args.long_prompt = (100_000 if gpu else 0) if args.long_prompt is None else args.long_prompt
    configs = []
    for c in args.configs:
        kv, _, cp = c.partition(":")
        if kv not in ("bfloat16", "fp8_e4m3") or not cp.isdigit() or int(cp) < 2:
            p.error(f"--configs {c!r}: expected bfloat16:N or fp8_e4m3:N with N >= 2")
        configs.append((kv, int(cp)))
    if args.at_once < 1:
        p.error(f"--at-once {args.at_once}: expected 1 or more")
    if not gpu and configs != [("bfloat16", 2)]:
        p.error(f"--device cpu runs bfloat16:2 only (the CPU servers' roles), got {' '.join(args.configs)}")
    t0 = time.monotonic()
    # the clusters write their tokenizers in parallel threads: transformers' lazy import is not thread-safe
    from transformers import PreTrainedTokenizerFast  # noqa: F401

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
        json.dump({"provenance": run_provenance(results), "ok": ok, "wall_s": round(time.monotonic() - t0, 1),
                   "configs": results}, f, indent=1, default=str)  # fmt: skip
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
