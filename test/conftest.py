"""Test-wide setup. Triton's interpreter must be chosen before anything imports triton
(sglang does at import time), so it is set here, before any test module is collected.

NSA_CP_FAIL_ON_SKIP=1 (scripts/gpu_run.sh sets it) turns every skipped test into a failure: on
the GPU machine a skip means the bundle or CUDA is missing, and a run of skips must not pass."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("NSA_CP_FAIL_ON_SKIP") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, and NSA_CP_FAIL_ON_SKIP=1 makes a skip a failure: {reason}"
