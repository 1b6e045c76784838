"""What a run of the demo (test/helpers/demo.py) must show, asserted: by test_demo.py on the runs
that start their own servers, and by test_sglang_server_pd.py on its cluster (the demo's CI case,
which starts no cluster of its own)."""

from __future__ import annotations

from helpers import demo


def assert_demo_run(args, run: demo.DemoRun) -> None:
    """Every prompt's greedy tokens through the shared-KV PD (router), the replicated PD and the
    non-CP oracle are equal; the prompt longer than one prefill rank's pool is refused by the
    replicated prefill with SGLang's own message and served by the shared-KV PD with the oracle's
    tokens; SGLang reports N x the logical tokens for the shared prefill in the same pool rows per
    rank, of the KV dtype asked for, and a gather scratch on every shared rank only; nothing
    outlived the stop (a run on a cluster the caller stops has no leftovers to report)."""
    assert run.error is None, run.error
    assert not run.leftovers, run.leftovers
    assert run.rows and len(run.rows) == len(demo.PROMPT_LENGTHS), run.rows
    for row in run.rows:
        assert len(row["oracle"]) == demo.NEW_TOKENS, row
        assert row["shared"] == row["oracle"] == row["replicated"], row
    long = run.long
    refused = demo.REFUSAL.search(long["refused"] or "")
    assert refused, f"the replicated prefill took in {long['length']} tokens: {long}"
    assert int(refused[1]) == demo.LONG_PROMPT and int(refused[2]) < demo.LONG_PROMPT, long["refused"]
    assert long["shared"] == long["oracle"], long
    assert len(long["oracle"]) == demo.NEW_TOKENS, long
    shared, replicated = run.shared, run.replicated
    assert shared["logical_tokens"] == args.cp * replicated["logical_tokens"], (shared, replicated)
    for report in shared, replicated:
        assert report["pool_rows"] == dict.fromkeys(range(args.cp), demo.PREFILL_RANK_TOKENS), report
        want = "torch.float8_e4m3fn" if args.kv_cache_dtype == "fp8_e4m3" else "torch.bfloat16"
        assert report["pool_dtypes"] == [want], report
    assert sorted(shared["scratch_mib"]) == list(range(args.cp)) and not replicated["scratch_mib"], (shared, replicated)
    assert run.ok
