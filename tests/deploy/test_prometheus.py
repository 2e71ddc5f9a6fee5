"""The Prometheus config, the alert rules and the Grafana dashboard against a real Prometheus (Debian's
``prometheus`` package) scraping a real ``rnnserve serve`` under load: every metric the dashboard and the alerts
query exists, and every dashboard expression returns data."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from rnnserve.engine.llm_engine import EngineLoad
from rnnserve.engine.models.base import StateSpec
from rnnserve.engine.prefix_cache import TierUsage
from rnnserve.server import dashboard
from rnnserve.server.metrics import ServerMetrics
from rnnserve.server.sessions import SessionCodec, SessionStore
from tests.server.server_process import REPO, ServerProcess, free_port, stop

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
DEPLOY = REPO / "deploy"
GRAFANA = json.loads((DEPLOY / "grafana" / "rnnserve.json").read_text())
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\b((?:rnnserve|process)_[a-z0-9_]+)\b")
REGEX_SPECIAL = re.compile(r"([\\^$.|?*+()\[\]{}])")
LABEL_VALUES = re.compile(r"^label_values\((\w+)(\{.*\})?, (\w+)\)$")
TARGET_LABELS = {"job", "instance", "namespace", "pod"}  # added by the scrape, not by the server
SELECTOR = re.compile(r"\b((?:rnnserve|process)_[a-z0-9_]+)\b(?:\{([^}]*)\})?")
COUNTER_FUNCTIONS = re.compile(r"\b(?:rate|irate|increase)\(\s*((?:rnnserve|process)_[a-z0-9_]+)")
GAUGE_FUNCTIONS = re.compile(r"\b(?:deriv|delta|\w+_over_time)\(\s*((?:rnnserve|process)_[a-z0-9_]+)")
BY_CLAUSE = re.compile(r"\bby\s*\(([^)]*)\)")

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian's prometheus package)")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus package")


def panels() -> list[dict[str, Any]]:
    return [p for p in GRAFANA["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def exported_samples() -> dict[str, tuple[str, frozenset[str]]]:
    """Each sample name a server exports (with a pool, both prefix-cache tiers and sessions), with its family's
    type and its labels."""
    metrics = ServerMetrics("m", 64)
    metrics.set_pool(num_slots=4, bytes_per_slot=8)
    metrics.set_load(EngineLoad(1, 0, 4, 1, 8, [TierUsage("device", 10, 20, 3), TierUsage("host", 1, 2, 1)]))
    with tempfile.TemporaryDirectory() as folder:
        codec = SessionCodec("ab" * 32, [StateSpec("h", (2,), torch.float32)], vocab_size=10)
        SessionStore(Path(folder), codec, 10, 1 << 20, 1 << 20, metrics=metrics.sessions).create()
        text = metrics.render().decode()
    samples: dict[str, tuple[str, frozenset[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = samples.get(sample.name, (family.type, frozenset()))[1] | set(sample.labels)
            samples[sample.name] = (family.type, frozenset(labels))
    return samples


def every_query() -> dict[str, str]:
    """Every PromQL expression of deploy/: the Grafana panels and variables, the alert rules, the autoscaler's
    metric (prometheus-adapter's series query), by where it is."""
    queries = {f"panel {p['title']!r} {t['refId']}": t["expr"] for p in panels() for t in p["targets"]}
    for variable in GRAFANA["templating"]["list"]:
        if variable["type"] == "query":
            queries[f"variable {variable['name']}"] = LABEL_VALUES.match(variable["query"]["query"]).group(1)  # type: ignore[union-attr]
    queries |= {f"alert {name}": expr for name, expr in alert_exprs().items()}
    adapter = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml").read_text())
    queries |= {f"adapter rule {i}": rule["seriesQuery"] for i, rule in enumerate(adapter["rules"]["custom"])}
    return queries


def alert_exprs() -> dict[str, str]:
    text = ALERTS.read_text()
    names = re.findall(r"- alert: (\w+)", text)
    bodies = re.split(r"\n\s+- alert: \w+\n", text)[1:]
    exprs = [re.search(r"expr: (\|\n(?:\s{10,}.*\n)+|.*\n)", body).group(1) for body in bodies]  # type: ignore[union-attr]
    return {name: expr.removeprefix("|").strip() for name, expr in zip(names, exprs, strict=True)}


@needs_promtool
@pytest.mark.parametrize(
    "args",
    [("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml"), ("test", "rules", "alerts_test.yml")],
    ids=["check-config", "check-rules", "test-rules"],
)
def test_promtool(args: tuple[str, ...]) -> None:
    done = subprocess.run([PROMTOOL, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_dashboard_layout() -> None:
    ids = [p["id"] for p in GRAFANA["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in GRAFANA["panels"]:
        box = panel["gridPos"]
        assert box["x"] >= 0 and box["x"] + box["w"] <= 24
        area = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert not cells & area, f"panel {panel['title']!r} overlaps another"
        cells |= area
    for panel in panels():
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    variables = {v["name"] for v in GRAFANA["templating"]["list"]}
    assert variables == {"datasource", "job", "model_name"}
    assert {v for e in dashboard_exprs() for v in re.findall(r"\$(\w+)", e)} <= variables | {"__rate_interval"}


def test_queries_use_series_as_the_server_exports_them() -> None:
    """Without a Prometheus: every series a dashboard panel, an alert or the autoscaler reads is exported under
    that name, with the labels the query selects and groups by, and of the type its function expects (rate of
    counters and histogram series, deriv and *_over_time of gauges, histogram_quantile by le)."""
    samples = exported_samples()
    counter_series = {name for name, (kind, _) in samples.items() if kind in {"counter", "histogram"}}
    counter_series -= {name for name in counter_series if name.endswith("_created")}
    for where, expr in every_query().items():
        used: set[str] = set()
        for name, matchers in SELECTOR.findall(expr):
            assert name in samples, f"{where}: {name} is not exported"
            labels = samples[name][1] | TARGET_LABELS
            used |= labels
            selected = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
            assert selected <= labels, f"{where}: {name} has no label {selected - labels}"
        for name in COUNTER_FUNCTIONS.findall(expr):
            assert name in counter_series, f"{where}: rate of {name}, a {samples[name][0]}"
        for name in GAUGE_FUNCTIONS.findall(expr):
            assert samples[name][0] == "gauge", f"{where}: {name} is a {samples[name][0]}, not a gauge"
        for group in BY_CLAUSE.findall(expr):
            missing = {label.strip() for label in group.split(",")} - used
            assert not missing, f"{where}: grouped by {missing}, which its series do not carry"
        if "histogram_quantile" in expr:
            assert all("le" in g for g in BY_CLAUSE.findall(expr)), f"{where}: histogram_quantile needs by (le)"
            assert all(n.endswith("_bucket") for n, _ in SELECTOR.findall(expr)), where


def test_grafana_covers_the_live_dashboard() -> None:
    """Every series the built-in page reads has a Grafana panel too."""
    used = {m for e in dashboard_exprs() for m in METRIC.findall(e)}
    page = {*dashboard.COUNTERS.values(), *dashboard.GAUGES.values()}
    page |= {f"{name}_bucket" for name in dashboard.HISTOGRAMS.values()}
    assert page <= used, page - used


@pytest.fixture(scope="module")
def prometheus(loaded_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus scraping the loaded server every second, with deploy/prometheus/alerts.yml loaded."""
    home = tmp_path_factory.mktemp("prometheus")
    config = home / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: [{json.dumps(str(ALERTS))}]\n"
        "scrape_configs:\n"
        f"  - {{job_name: rnnserve, static_configs: [{{targets: ['127.0.0.1:{loaded_server.port}']}}]}}\n"
    )
    port = free_port()
    command = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={home / 'data'}",
               f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: query(url, 'sum(rate(rnnserve_generation_tokens_total{job="rnnserve"}[5s])) > 0'), proc)
        yield url
    finally:
        stop(proc)


def wait_for(ready: Any, proc: subprocess.Popen, timeout: float = 45.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else proc.returncode
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "Prometheus has no rnnserve data"
        time.sleep(0.5)


def api(url: str, path: str, **params: Any) -> Any:
    response = httpx.get(f"{url}/api/v1/{path}", params=params, timeout=10)
    response.raise_for_status()  # Prometheus answers 503 "Service Unavailable" while it starts (wait_for retries)
    body = response.json()
    assert body["status"] == "success", body
    return body["data"]


def query(url: str, expr: str) -> list[dict[str, Any]]:
    return api(url, "query", query=expr)["result"]


def resolve_variables(url: str) -> dict[str, str]:
    """Each template variable's values, asked of Prometheus as Grafana asks them, as Grafana's "All" regex (regex
    characters escaped with a backslash, itself escaped in the PromQL string)."""
    values = {"__rate_interval": "10s"}
    for variable in GRAFANA["templating"]["list"]:
        if variable["type"] != "query":
            continue
        metric, selector, label = LABEL_VALUES.match(variable["query"]["query"]).groups()  # type: ignore[union-attr]
        for name, value in values.items():
            selector = (selector or "").replace(f"${name}", value)
        found = api(url, f"label/{label}/values", **{"match[]": f"{metric}{selector}"})
        assert found, variable["name"]
        values[variable["name"]] = "|".join(REGEX_SPECIAL.sub(r"\\\\\1", v) for v in found)
    return values


@needs_prometheus
@pytest.mark.timeout(120)
def test_every_grafana_query_returns_data(prometheus: str) -> None:
    variables = resolve_variables(prometheus)
    assert variables["job"] == "rnnserve" and variables["model_name"] == "random:mingru-tiny"
    exported = set(api(prometheus, "label/__name__/values"))
    used = {m for e in dashboard_exprs() for m in METRIC.findall(e)}
    assert used <= exported, f"the dashboard queries series the server does not export: {sorted(used - exported)}"
    for panel in panels():
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in variables.items():
                expr = expr.replace(f"${name}", value)
            result = query(prometheus, expr)
            assert result, f"panel {panel['title']!r}: no data for {expr}"
            assert any(not math.isnan(float(r["value"][1])) for r in result), f"{panel['title']!r}: NaN for {expr}"


@needs_prometheus
@pytest.mark.timeout(120)
def test_alert_rules_evaluate_on_real_series(prometheus: str) -> None:
    exprs = alert_exprs()
    exported = set(api(prometheus, "label/__name__/values")) | {"up"}
    for name, expr in exprs.items():
        missing = set(METRIC.findall(expr)) - exported
        assert not missing, f"{name} queries series the server does not export: {missing}"
        query(prometheus, expr)  # evaluates (a healthy server fires none)

    def evaluated() -> bool:
        rules = [r for g in api(prometheus, "rules")["groups"] for r in g["rules"]]
        return {r["name"] for r in rules} == set(exprs) and all(r["health"] == "ok" for r in rules)

    deadline = time.monotonic() + 20
    while not evaluated():
        assert time.monotonic() < deadline, api(prometheus, "rules")
        time.sleep(0.5)
    assert not [a for a in api(prometheus, "alerts")["alerts"] if a["state"] == "firing"]
