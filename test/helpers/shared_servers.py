"""One cluster of SGLang's real CPU servers for every system test file that asks for it.

Each server costs a minute or more of both cores to start, and the PD, layer-split and HiCache
files use the same decode, oracle and shared-KV prefill (the demo's: PREFILL_RANK_TOKENS rows a
rank). A file that runs on this cluster names the roles it uses in a module constant,

    SHARED_SERVER_ROLES = ("shared", "layer_split", "decode", "single")

and takes the session fixture `shared_servers` (test/conftest.py). Before the first test the
collected files' roles are gathered (`Plan.from_items`), so one start serves them all; a file run
alone starts only its own roles. The cluster stops after the last test that uses it, not at the
end of the session, so the servers do not sit beside the tests that follow. A test marked
`stops_shared_servers` (it kills a server) runs after every other test on the cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers import collective_counter as C
from helpers import demo
from helpers import sglang_servers as S

ROLES_ATTR = "SHARED_SERVER_ROLES"
ROUTER_ROLE = "router"  # SGLang's PD router in front of shared + decode (a process, not a server)
MARKER = "stops_shared_servers"
FIXTURE = "shared_servers"
# The demo's servers (demo.cluster_options at its defaults), and SGLang's layer split at the same
# rows a rank; the HiCache roles carry their own pool sizes (sglang_servers.ROLES).
PER_RANK = ["--max-total-tokens", str(demo.PREFILL_RANK_TOKENS)]
EXTRA_ARGS = {**demo.cluster_options(demo.parse_args([]))["extra_args"], "layer_split": PER_RANK}
# The decode counts SGLANG_DISAGGREGATION_WAITING_TIMEOUT from the moment it pre-allocates a room
# until the prefill's last chunk lands; with several long prompts at once the prefill works through
# them in turn, and on a loaded machine the last room waited past the default 120 s (load 20).
ENV = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "600"}
START_S_PER_SERVER = 120  # on 2 cores every server's start-up shares them


@dataclass
class Plan:
    """The roles the collected tests ask for, and the last test that uses them."""

    roles: tuple[str, ...] = ()
    router: bool = False
    last_user: str | None = None  # that test's nodeid

    @classmethod
    def from_items(cls, items: list) -> "Plan":
        """Reorders `items` in place: the tests marked MARKER after every other user of the cluster."""
        users = [item for item in items if FIXTURE in getattr(item, "fixturenames", ())]
        if not users:
            return cls()
        stopping = [item for item in users if item.get_closest_marker(MARKER)]
        if stopping:
            for item in stopping:
                items.remove(item)
            last = max(i for i, item in enumerate(items) if item in users)
            items[last + 1 : last + 1] = stopping
        wanted: list[str] = []
        for item in users:
            declared = getattr(item.module, ROLES_ATTR, None)
            if declared is None:
                raise RuntimeError(f"{item.module.__name__} uses {FIXTURE} without declaring {ROLES_ATTR}")
            wanted += [role for role in declared if role not in wanted]
        unknown = [role for role in wanted if role not in S.ROLES and role != ROUTER_ROLE]
        if unknown:
            raise RuntimeError(f"{ROLES_ATTR} names roles sglang_servers.ROLES lacks: {unknown}")
        servers = tuple(role for role in wanted if role != ROUTER_ROLE)
        return cls(servers, ROUTER_ROLE in wanted, max(users, key=items.index).nodeid)


@dataclass
class SharedServers:
    """The session's cluster, started on first use, stopped after the plan's last user."""

    plan: Plan = field(default_factory=Plan)
    cluster: S.Cluster | None = None
    stopped: bool = False

    def get(self, workdir: Path) -> S.Cluster:
        if self.stopped:
            raise RuntimeError("the shared servers were stopped: a test ran after the plan's last user")
        if self.cluster is None:
            if self.plan.router and not {"shared", "decode"} <= set(self.plan.roles):
                raise RuntimeError("the router needs the shared and decode roles in the plan")
            cluster = S.Cluster(workdir, roles=self.plan.roles, router=self.plan.router,
                                extra_args={r: a for r, a in EXTRA_ARGS.items() if r in self.plan.roles},
                                env={**ENV, C.ENV: str(workdir / "collectives")})  # fmt: skip
            t0 = time.monotonic()
            try:
                cluster.start(timeout_s=START_S_PER_SERVER * len(self.plan.roles) + 300)
            except BaseException:
                cluster.stop()
                raise
            cluster.startup_s = time.monotonic() - t0
            self.cluster = cluster
        return self.cluster

    def stop(self) -> None:
        """Stop every server; fail if a process group or a port outlives the stop."""
        self.stopped = True
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            leftovers = cluster.stop()
            assert not leftovers, f"after stopping the shared servers: {leftovers}"
