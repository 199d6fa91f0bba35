"""configs/grafana/ecd-dashboard.json: only metrics the daemon exports, and the panels operators need."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "configs" / "grafana" / "ecd-dashboard.json"

# What the daemon exports (ecd/daemon/ops/metrics.py): name -> label -> allowed values (None: any).
HISTOGRAM = {"op": None, "le": None}
METRICS: dict[str, dict[str, set[str] | None]] = {
    "ecd_requests_total": {"op": None, "outcome": None},
    "ecd_request_duration_seconds_bucket": HISTOGRAM,
    "ecd_request_duration_seconds_sum": {"op": None},
    "ecd_request_duration_seconds_count": {"op": None},
    "ecd_written_bytes_total": {},
    "ecd_read_bytes_total": {},
    "ecd_entries": {"state": {"ready", "writing", "retired", "reserved"}},
    "ecd_pool_used_bytes": {"pool": None},
    "ecd_pool_capacity_bytes": {"pool": None},
    "ecd_cuda_arena_info": {"pool": None, "device_uuid": None},  # only with [pool.cuda]
    "ecd_evictions_total": {"reason": {"capacity", "quota", "deleted", "replaced"}},
    "ecd_namespace_used_bytes": {"namespace": None},
    "ecd_namespace_quota_bytes": {"namespace": None},
    "ecd_namespace_guaranteed_bytes": {"namespace": None},
    "ecd_namespace_quota_exceeded_total": {"namespace": None},
    "ecd_lookups_total": {"result": {"hit", "miss"}},
    "ecd_leases": {"kind": {"read", "pin", "write"}},
    "ecd_leases_reclaimed_total": {"reason": {"client_exit", "session_ttl", "write_ttl", "pin_expired"}},
    "ecd_frames_dropped_total": {"reason": {"refused", "unanswerable", "send_failed"}},
    "ecd_clients": {},
    "ecd_waiters": {},
    "ecd_http_connections": {},
    "ecd_http_connections_shed_total": {"reason": {"oldest_closed", "refused"}},
    "ecd_ring_events_total": {},
    "ecd_ring_reader_overruns_total": {},
    "ecd_auth_rejected_total": {},
    "ecd_integrity_failures_total": {"where": {"read", "inline_put"}},
    "ecd_start_time_seconds": {},
    "ecd_build_info": {"version": None, "python": None, "node": None},
}
TARGET_LABELS = {"instance", "job"}  # added by Prometheus to every series it scrapes
NODE_FILTER = 'instance=~"$node"'


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = [(f"panel {p.get('title')!r}", t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append((f"variable {var['name']!r}", query))
    return found


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """[(metric, [(label, op, value), ...])] for every ecd_* selector in expr."""
    out = []
    for match in re.finditer(r"\b(ecd_[a-z_]+)\s*(\{[^}]*\})?", expr):
        matchers = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', match.group(2) or "")
        out.append((match.group(1), matchers))
    return out


def test_every_expression_uses_only_exported_metrics(dashboard):
    all_exprs = exprs(dashboard)
    assert len(all_exprs) >= 15
    for where, expr in all_exprs:
        names = re.findall(r"ecd_[a-z_]+", expr)
        assert names, f"{where}: no ecd metric in {expr!r}"
        unknown = sorted(set(names) - set(METRICS))
        assert not unknown, f"{where}: unknown metric(s) {unknown} in {expr!r}"


def test_label_matchers_and_groupings_fit_the_metrics(dashboard):
    for where, expr in exprs(dashboard):
        used = selectors(expr)
        for metric, matchers in used:
            labels = METRICS[metric]
            for label, op, value in matchers:
                assert label in labels or label in TARGET_LABELS, f"{where}: {metric} has no label {label!r}"
                allowed = labels.get(label)
                if allowed is not None and op in ("=", "=~"):
                    values = set(value.split("|")) if op == "=~" else {value}
                    assert values <= allowed, f"{where}: {metric}{{{label}}} is never {values - allowed}"
        known = TARGET_LABELS | {label for metric, _ in used for label in METRICS[metric]}
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            for label in (l.strip() for l in group.split(",") if l.strip()):
                assert label in known, f"{where}: groups by {label!r}, which none of its metrics has"


def test_every_panel_query_follows_the_node_variable(dashboard):
    for where, expr in exprs(dashboard):
        if where.startswith("variable"):
            continue
        for metric, matchers in selectors(expr):
            assert ("instance", "=~", "$node") in matchers, f"{where}: {metric} ignores $node ({NODE_FILTER})"


def test_dashboard_identity_datasource_and_node_variable(dashboard):
    assert dashboard["uid"] == "ecd-node"
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    node = variables["node"]
    query = node["query"]["query"] if isinstance(node["query"], dict) else node["query"]
    assert query.replace(" ", "") == "label_values(ecd_build_info,instance)"
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    assert node["datasource"] == ds
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == ds, panel["title"]
        assert all(t["datasource"] == ds for t in panel["targets"]), panel["title"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]), panel["title"]


def find_panel(dashboard: dict, *words: str) -> dict:
    for panel in panels(dashboard):
        if all(w.lower() in panel["title"].lower() for w in words):
            return panel
    raise AssertionError(f"no panel titled with {words}; have {[p['title'] for p in panels(dashboard)]}")


def panel_exprs(panel: dict) -> str:
    return "\n".join(t["expr"] for t in panel["targets"])


def test_required_panels_exist_and_compute_what_their_title_says(dashboard):
    hit = panel_exprs(find_panel(dashboard, "hit rate"))
    assert 'result="hit"' in hit and "/" in hit and "rate(ecd_lookups_total" in hit

    assert "by (instance, op)" in panel_exprs(find_panel(dashboard, "request rate", "op"))

    latency = panel_exprs(find_panel(dashboard, "latency", "p50", "p99"))
    assert "histogram_quantile(0.5," in latency and "histogram_quantile(0.99," in latency
    assert "ecd_request_duration_seconds_bucket" in latency and re.search(r"by \([^)]*\bop\b[^)]*\ble\b", latency)

    use = find_panel(dashboard, "pool use")
    assert {"ecd_pool_used_bytes", "ecd_pool_capacity_bytes"} <= set(re.findall(r"ecd_[a-z_]+", panel_exprs(use)))
    assert use["fieldConfig"]["defaults"]["unit"] == "percentunit"
    pool_bytes = find_panel(dashboard, "pool bytes")
    assert pool_bytes["fieldConfig"]["defaults"]["unit"] == "bytes"

    assert "by (instance, state)" in panel_exprs(find_panel(dashboard, "entries", "state"))
    assert "ecd_evictions_total" in panel_exprs(find_panel(dashboard, "evictions", "reason"))
    clients = panel_exprs(find_panel(dashboard, "clients", "waiters"))
    assert "ecd_clients" in clients and "ecd_waiters" in clients
    assert "ecd_leases{" in panel_exprs(find_panel(dashboard, "leases", "kind"))
    assert "ecd_leases_reclaimed_total" in panel_exprs(find_panel(dashboard, "reclaimed"))
    ring = panel_exprs(find_panel(dashboard, "ring", "overruns"))
    assert "ecd_ring_events_total" in ring and "ecd_ring_reader_overruns_total" in ring
    uptime = find_panel(dashboard, "uptime")
    assert "time() - ecd_start_time_seconds" in panel_exprs(uptime) and uptime["fieldConfig"]["defaults"]["unit"] == "s"
