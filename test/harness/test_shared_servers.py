"""CPU (importing SGLang's server helpers): the plan of the system tests' shared cluster
(test/helpers/shared_servers.py): one start for the union of the roles the collected files declare,
stopped after its last user, a test that kills a server moved after every other user, and a file
that uses the cluster without declaring its roles, or names a role that does not exist, refused
before any server starts."""

import sys
from types import SimpleNamespace

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from helpers import shared_servers as SS

register_cpu_ci(est_time=10, suite="nsa-cp-test-cpu-unit")


class Item:
    """What the plan reads of a pytest item: its id, module, fixtures and markers."""

    def __init__(self, nodeid, roles=None, uses=True, stops=False):
        self.nodeid, self.stops = nodeid, stops
        self.module = SimpleNamespace(__name__=nodeid.split("::")[0])
        if roles is not None:
            setattr(self.module, SS.ROLES_ATTR, roles)
        self.fixturenames = [SS.FIXTURE] if uses else ["tmp_path"]

    def get_closest_marker(self, name):
        return object() if self.stops and name == SS.MARKER else None


def test_one_start_serves_the_union_of_the_declared_roles_in_order():
    items = [Item("a.py::t1", uses=False),
             Item("pd.py::t1", ("shared", "decode", "router")), Item("hicache.py::t1", ("hicache_shared", "decode")),
             Item("unit.py::t1", uses=False)]  # fmt: skip
    plan = SS.Plan.from_items(items)
    assert plan.roles == ("shared", "decode", "hicache_shared") and plan.router
    assert plan.last_user == "hicache.py::t1"
    assert [i.nodeid for i in items] == ["a.py::t1", "pd.py::t1", "hicache.py::t1", "unit.py::t1"]  # unchanged


def test_a_test_that_kills_a_server_runs_after_every_other_user():
    items = [Item("pd.py::kill", ("shared",), stops=True), Item("pd.py::t2", ("shared",)),
             Item("split.py::t1", ("layer_split",)), Item("unit.py::t1", uses=False)]  # fmt: skip
    plan = SS.Plan.from_items(items)
    assert [i.nodeid for i in items] == ["pd.py::t2", "split.py::t1", "pd.py::kill", "unit.py::t1"]
    assert plan.last_user == "pd.py::kill" and plan.roles == ("shared", "layer_split") and not plan.router


def test_no_user_no_servers():
    assert SS.Plan.from_items([Item("unit.py::t1", uses=False)]) == SS.Plan()


@pytest.mark.parametrize(
    "item, message",
    [(Item("x.py::t1"), f"x.py uses {SS.FIXTURE} without declaring {SS.ROLES_ATTR}"),
     (Item("x.py::t1", ("shared", "sharde")), "names roles sglang_servers.ROLES lacks: ['sharde']")],
)  # fmt: skip
def test_an_undeclared_or_unknown_role_is_refused_before_any_start(item, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SS.Plan.from_items([item])


def test_the_router_needs_its_prefill_and_decode():
    servers = SS.SharedServers(SS.Plan(roles=("decode",), router=True, last_user="x.py::t1"))
    with pytest.raises(RuntimeError, match="the router needs the shared and decode roles"):
        servers.get(None)


def test_a_stopped_cluster_is_not_handed_out_again():
    servers = SS.SharedServers(SS.Plan(roles=("decode",), last_user="x.py::t1"))
    servers.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        servers.get(None)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
