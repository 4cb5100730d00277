"""Dashboards operators expect (issue 20, item 12): the Grafana dashboard and the
Prometheus alert rules in deploy/monitoring load, and every metric they name is one a
real agent or master exports (read from their own collectors, as a scrape reads them).
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import TEST_STATE_DIR
from prometheus_client import CollectorRegistry, generate_latest

from hixl.server.agent.config import AgentConfig
from hixl.server.agent.runtime import AgentServer
from hixl.server.master.leadership import Leadership
from hixl.server.master.master import MasterConfig, ObjectStore, metrics_registry
from hixl.server.registry import Registry

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
ALERTS = MONITORING / "prometheus-alerts.yaml"
METRIC = re.compile(r"\bhixl_[a-z_]+")
#: Prometheus' own series, not hixl's
BUILTIN = {"up"}


def _sample_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a scrape of `registry` can carry (a histogram's _bucket, _sum
    and _count; a counter's _total), families without samples included."""
    names: set[str] = set()
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= ({f"{name}_bucket", f"{name}_sum", f"{name}_count"}
                      if kind == "histogram" else {name})
    return names


@pytest.fixture(scope="module")
def exported() -> Iterator[set[str]]:
    with tempfile.TemporaryDirectory(prefix="hxm-") as workdir:
        agent = AgentServer(AgentConfig(grpc_port=0, runtime_dir=f"{workdir}/run",
                                        state_dir=TEST_STATE_DIR)).start()
        try:
            names = _sample_names(agent.metrics_registry)
        finally:
            agent.stop()
    store = ObjectStore(MasterConfig().store.options())
    # the master's registry, with the store RPC outcomes its servicer counts
    names |= _sample_names(metrics_registry(Registry(), lambda: store,
                                            {("PutStart", 0): 1}))
    yield names


def _is_leader(leadership: Leadership | None) -> float:
    store = ObjectStore(MasterConfig().store.options())
    metrics = metrics_registry(Registry(), lambda: store, leadership=leadership)
    value = metrics.get_sample_value("hixl_master_is_leader")
    assert value is not None
    return value


def test_the_no_leader_alert_reads_each_masters_own_role() -> None:
    """hixl_master_is_leader: 1 for a single master and for the leader, 0 for a standby
    (elected or not) and a deposed one; the "no leader" alert and the dashboard use it."""
    assert _is_leader(None) == 1.0
    leadership = Leadership("127.0.0.1:50051")
    assert _is_leader(leadership) == 0.0   # a standby
    leadership.observed("127.0.0.1:50051")
    assert _is_leader(leadership) == 0.0   # elected, still loading the store
    leadership.lead()
    assert _is_leader(leadership) == 1.0
    leadership.depose("lost the election lease")
    assert _is_leader(leadership) == 0.0
    rules = {rule["alert"]: rule["expr"] for group in yaml.safe_load(
        ALERTS.read_text(encoding="utf-8"))["groups"] for rule in group["rules"]}
    assert "hixl_master_is_leader" in rules["HixlNoLeader"]
    assert "hixl_master_is_leader" in " ".join(_dashboard_exprs())


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [var["query"] for var in dashboard["templating"]["list"]
              if var["type"] == "query"]
    assert exprs
    return exprs


def _alert_exprs() -> list[str]:
    rules = [rule for group in yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
             for rule in group["rules"]]
    assert {"HixlAgentNotPublished", "HixlNoLeader", "HixlStoreNearlyFull",
            "HixlLeaseRenewalsFailing"} <= {rule["alert"] for rule in rules}
    for rule in rules:
        assert rule["annotations"]["summary"] and rule["labels"]["severity"]
    return [rule["expr"] for rule in rules]


@pytest.mark.parametrize("exprs", [_dashboard_exprs, _alert_exprs],
                         ids=["dashboard", "alerts"])
def test_every_metric_named_exists(exprs: object, exported: set[str]) -> None:
    named = {name for expr in exprs() for name in METRIC.findall(expr)}  # type: ignore[operator]
    assert named, "no hixl metric named"
    missing = sorted(named - exported - BUILTIN)
    assert not missing, f"named but not exported: {missing}"


def test_dashboard_covers_what_operators_ask_for() -> None:
    """Traffic by path, latency, errors by code, leases, store space, the leader."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = " ".join(_dashboard_exprs())
    for metric in ("hixl_agent_data_bytes_total", "hixl_agent_data_seconds_bucket",
                   "hixl_agent_data_errors_total", "hixl_store_results_total",
                   "hixl_agent_registry_published", "hixl_store_used_bytes",
                   "hixl_store_capacity_bytes"):
        assert metric in exprs, metric
    titles = " ".join(panel["title"] for panel in dashboard["panels"]).lower()
    for word in ("traffic", "latency", "errors", "lease", "store", "leader"):
        assert word in titles, word
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
