"""The suite and file tables of docs/testing.md, generated from the test files' registrations.

    .venv/bin/python scripts/gen_test_tables.py           # print the tables
    .venv/bin/python scripts/gen_test_tables.py --write   # replace them in docs/testing.md

Each `test/**/test_*.py` declares its suite and `est_time` with SGLang's `register_cpu_ci` /
`register_cuda_ci` (read from the source by SGLang's `ut_parse_one_file`, as scripts/run_suite.py
does); the "checks" column is the first line of the file's docstring. docs/testing.md carries the
output between `<!-- tests:begin -->` and `<!-- tests:end -->`; test/test_docs.py keeps the two equal,
so after adding, moving or re-timing a test file, run this with --write.

Its claims table (`<!-- claims:begin -->` ... `<!-- claims:end -->`) is CLAIMS below: for every row of
README.md's status table, the tests that hold it. test/test_docs.py fails when a README row has no
entry here (or an entry names no README row), and when a test named here no longer exists.
"""

from __future__ import annotations

import ast
import os
import sys

from sglang.test.ci.ci_register import ut_parse_one_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_DIR = os.path.join(REPO, "test")
DOC = os.path.join(REPO, "docs", "testing.md")
BEGIN, END = "<!-- tests:begin -->\n", "\n<!-- tests:end -->"
MACHINES = {"cpu": "CPU; what CI runs (`.ci/run`)", "cuda": "one or two H200s"}
CLAIMS_BEGIN, CLAIMS_END = "<!-- claims:begin -->\n", "\n<!-- claims:end -->"
README = os.path.join(REPO, "README.md")
NOT_A_CLAIM = {"not done": "what the project has not done; no test holds it"}
# README status row (its first cell) -> the tests that hold it, `file::test` (GPU files: the GPU suite)
CLAIMS = {
    "correctness through SGLang's own forward": (
        "test_page_interleave_pool.py::test_sharded_pool_equals_replicated_cp_bit_for_bit",
        "test_page_interleave_pool.py::test_sharded_pool_equals_cp_off_where_replicated_cp_does",
        "test_page_interleave_pool.py::test_sglangs_own_class_equals_replicated_cp_with_a_poisoned_scratch",
        "test_sglang_gpu_forward.py::test_shared_kv_equals_replicated_cp_bit_for_bit",
        "test_sglang_gpu_forward.py::test_history_is_gathered_one_layer_ahead_by_the_pools_communicator",
    ),
    "SGLang's real servers": (
        "test_sglang_server_pd.py::test_servers_start_with_the_plugin_and_report_n_times_the_capacity",
        "test_sglang_server_pd.py::test_concurrent_requests_of_mixed_lengths_match_the_oracles",
        "test_sglang_server_pd.py::test_long_prompt_prefilled_in_several_chunks",
        "test_sglang_server_pd.py::test_second_request_hits_the_prefill_radix_cache",
        "test_sglang_server_pd.py::test_client_abort_mid_prefill_frees_everything",
        "test_sglang_server_pd.py::test_killed_cp_rank_fails_the_request_and_the_prefill_exits",
        "test_sglang_server_fp8.py::test_prompt_of_three_chunks_reads_fp8_history",
        "test_sglang_server_hicache.py::test_prefix_evicted_to_host_is_loaded_back_with_the_same_tokens",
        "test_sglang_server_layer_split.py::test_tokens_equal_the_oracle",
        "test_sglang_server_layer_split.py::test_counted_bytes_per_forward_equal_the_formula",
    ),
    "the fused fp8 store (`kernels/`)": (
        "test_mla_fp8_owned_and_scratch.py::test_matches_sglang_quantizer",
        "test_page_interleave_pool.py::test_fp8_chunk_is_quantized_once_per_layer_write",
        "test_kernels_gpu.py::test_store_mla_fp8_owned_and_scratch",
        "test_kernels_gpu.py::test_sglang_fp8_rounding_of_every_bf16_value_by_every_scale",
    ),
    "PD (`disagg/`, `sglang_ext/disaggregation/`)": (
        "test_sglang_ext_pd.py::test_rank_self_check_names_what_it_did_not_send",
        "test_sglang_ext_pd.py::test_decode_commit_rule_over_the_manifests",
        "test_sglang_ext_pd.py::test_decode_manager_commits_only_full_coverage",
        "test_sglang_ext_pd.py::test_a_replayed_manifest_of_an_earlier_use_does_not_commit_a_reused_room",
        "test_sglang_ext_pd.py::test_two_ranks_serve_a_plugin_decode_and_refuse_a_stock_decode",
        "test_disagg.py::test_macs_catch_a_wrong_or_missing_secret",
        "test_status_guard.py::test_every_hostile_message_gets_its_reason",
        "test_status_guard.py::test_behind_the_guard_sglangs_decode_thread_drops_the_fuzz_and_still_commits",
        "test_owner_grouped_decode.py::test_decode_reads_owner_grouped_pages_as_request_order",
    ),
    "`flashmla_sparse_q8`": (
        "test_sglang_q8_forward.py::test_shared_kv_equals_replicated_cp_under_q8_bit_for_bit",
        "test_sglang_q8_gpu_forward.py::test_shared_kv_equals_replicated_cp_under_q8_bit_for_bit",
    ),
    "MTP speculative decoding": (
        "test_sglang_server_speculative.py::test_both_prefills_serve_eagle_and_only_the_flag_shards_its_pools",
        "test_sglang_server_speculative.py::test_short_and_chunked_prompts_decode_the_oracles_tokens_with_equal_accept_counts",
        "test_sglang_server_speculative.py::test_radix_hit_decodes_the_oracles_tokens_with_equal_accept_counts",
        "test_sglang_server_speculative.py::test_the_draft_is_accepted",
        "test_sglang_server_speculative.py::test_a_corrupted_draft_page_is_committed_and_only_the_accept_length_drops",
        "test_sglang_speculative_forward.py::test_sharded_equals_replicated_cp_bitwise",
        "test_sglang_gpu_servers.py::test_the_speculative_check_runs_eagle_on_both_prefills_and_the_decode_but_not_the_oracle",
    ),
    "plugin scope": (
        "test_sglang_ext.py::test_without_the_flag_sglang_gets_its_own_classes_and_results",
        "test_sglang_server_pd.py::test_only_the_servers_that_ask_run_the_plugins_classes",
        "test_ledger.py::test_every_target_resolves_with_its_recorded_signature",
        "test_ledger.py::test_every_fingerprint_covers_the_body_and_is_distinct",
        "test_ledger.py::test_a_changed_overridden_method_refuses_the_flag",
    ),
}


def test_files() -> list[str]:
    found = []
    for root, dirs, files in os.walk(TEST_DIR):
        dirs[:] = sorted(d for d in dirs if d not in ("helpers", "__pycache__"))
        found += [os.path.join(root, f) for f in sorted(files) if f.startswith("test_") and f.endswith(".py")]
    return sorted(found)


def first_docstring_line(path: str) -> str:
    with open(path) as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.split("\n\n")[0].replace("\n", " ").replace("|", "/").strip()


def rows() -> list[tuple[str, str, str, float, str]]:
    """(file under test/, suite, backend, est_time, checks) for every registered test file."""
    out = []
    for path in test_files():
        registries, _ = ut_parse_one_file(path)
        for reg in registries:
            name = os.path.relpath(path, TEST_DIR)
            out.append((name, reg.effective_suite, reg.backend.name.lower(), reg.est_time, first_docstring_line(path)))
    return out


def tables() -> str:
    data = rows()
    suites = sorted({(suite, backend) for _, suite, backend, _, _ in data})
    lines = ["| suite | marker | machine | files | est_time in all |", "| --- | --- | --- | ---: | ---: |"]
    for suite, backend in suites:
        mine = [r for r in data if r[1] == suite]
        marker = f"`register_{backend}_ci`"
        lines.append(f"| `{suite}` | {marker} | {MACHINES.get(backend, backend)} | {len(mine)} | "
                     f"{sum(r[3] for r in mine):.0f} s |")  # fmt: skip
    lines += ["", "| file (under test/) | suite | est_time (s) | checks (its docstring's first paragraph) |",
              "| --- | --- | ---: | --- |"]  # fmt: skip
    lines += [f"| `{name}` | `{suite}` | {est:.0f} | {checks} |" for name, suite, _, est, checks in data]
    return "\n".join(lines)


def readme_status_rows(text: str | None = None) -> list[str]:
    """The first cell of every row of README.md's "## Status" table."""
    if text is None:
        with open(README) as f:
            text = f.read()
    section = text.split("\n## Status\n", 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("|")]
    return cells[2:]  # past the header and its rule


def claims_table() -> str:
    lines = ["| README status row | the tests that hold it |", "| --- | --- |"]
    for piece, tests in CLAIMS.items():
        lines.append(f"| {piece} | {', '.join(f'`{t}`' for t in tests)} |")
    return "\n".join(lines)


def _between(text: str, begin: str, end: str) -> str:
    return text.split(begin, 1)[1].split(end, 1)[0]


def current_doc_tables() -> str:
    with open(DOC) as f:
        return _between(f.read(), BEGIN, END)


def current_doc_claims() -> str:
    with open(DOC) as f:
        return _between(f.read(), CLAIMS_BEGIN, CLAIMS_END)


def _replace(text: str, begin: str, end: str, body: str) -> str:
    head, rest = text.split(begin, 1)
    return head + begin + body + end + rest.split(end, 1)[1]


def write() -> None:
    with open(DOC) as f:
        text = f.read()
    text = _replace(_replace(text, BEGIN, END, tables()), CLAIMS_BEGIN, CLAIMS_END, claims_table())
    with open(DOC, "w") as f:
        f.write(text)


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
        print(f"wrote the tables of {os.path.relpath(DOC, REPO)}")
    else:
        print(tables() + "\n\n" + claims_table())
