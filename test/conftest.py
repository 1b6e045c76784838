"""Test-wide setup. Triton's interpreter must be chosen before anything imports triton
(sglang does at import time), so it is set here, before any test module is collected.

NSA_CP_FAIL_ON_SKIP=1 (scripts/gpu_run.sh sets it) turns every skipped test into a failure: on
the GPU machine a skip means the bundle or CUDA is missing, and a run of skips must not pass.

`shared_servers`: one cluster of SGLang's real CPU servers for the system test files that declare
the roles they use (test/helpers/shared_servers.py), started once for all of them."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_SERVERS = None  # helpers.shared_servers.SharedServers, when a collected test uses the fixture


def pytest_configure(config):
    config.addinivalue_line("markers", "stops_shared_servers: kills a shared server; runs after their other users")


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the plan covers the tests that run
def pytest_collection_modifyitems(session, config, items):
    global SHARED_SERVERS
    if any("shared_servers" in getattr(item, "fixturenames", ()) for item in items):
        from helpers import shared_servers  # imports SGLang's server helpers: only when a test needs them

        SHARED_SERVERS = shared_servers.SharedServers(shared_servers.Plan.from_items(items))


@pytest.fixture(scope="session")
def shared_servers(tmp_path_factory):
    yield SHARED_SERVERS.get(tmp_path_factory.mktemp("sglang_cpu_servers"))
    SHARED_SERVERS.stop()  # a session that ended before the plan's last user (-x, a failure)


def pytest_runtest_teardown(item, nextitem):
    if SHARED_SERVERS is not None and item.nodeid == SHARED_SERVERS.plan.last_user:
        SHARED_SERVERS.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("NSA_CP_FAIL_ON_SKIP") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, and NSA_CP_FAIL_ON_SKIP=1 makes a skip a failure: {reason}"
