"""The alert rules are valid Prometheus rules whose unit tests pass, cover every alert, use only series the
worker (or Prometheus) has, point at a runbook section that exists, and are the same for Kubernetes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_deploy_manifests import exposed_series, promql_metric_names, service

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERTS_TEST = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "prometheusrule.yaml"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus; ./dev setup does it)")

# Series Prometheus makes itself for every target.
PROMETHEUS_SERIES = {"up"}


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alert_names() -> list[str]:
    return [rule["alert"] for rule in rules()]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    proc = promtool("check", "rules", str(ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


@needs_promtool
def test_promtool_unit_tests_of_the_rules_pass() -> None:
    proc = promtool("test", "rules", str(ALERTS_TEST))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_accepts_the_compose_prometheus_config() -> None:
    proc = promtool("check", "config", "--syntax-only", str(PROMETHEUS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_firing_case_in_the_unit_tests() -> None:
    tests = yaml.safe_load(ALERTS_TEST.read_text(encoding="utf-8"))["tests"]
    firing = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert set(alert_names()) - firing == set(), "alerts without a test in which they fire"


def test_alert_names_are_unique() -> None:
    assert len(alert_names()) == len(set(alert_names()))


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_alert_uses_only_series_that_exist(rule: dict[str, Any]) -> None:
    names = promql_metric_names(rule["expr"])
    assert names, rule["expr"]
    assert names <= exposed_series() | PROMETHEUS_SERIES, sorted(names - exposed_series() - PROMETHEUS_SERIES)


def troubleshooting_anchors() -> set[str]:
    """GitHub-style anchors of the '## ' headings of docs/troubleshooting.md."""
    headings = re.findall(r"^## (.+)$", TROUBLESHOOTING.read_text(encoding="utf-8"), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_alert_has_a_runbook_section_and_a_severity(rule: dict[str, Any]) -> None:
    url = rule["annotations"]["runbook_url"]
    path, _, anchor = url.partition("#")
    assert path == "docs/troubleshooting.md"
    assert anchor == rule["alert"].lower() and anchor in troubleshooting_anchors()
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["annotations"]["summary"]


def test_every_runbook_section_belongs_to_an_alert() -> None:
    assert troubleshooting_anchors() == {name.lower() for name in alert_names()}


def test_runbook_names_only_settings_that_exist() -> None:
    import dataclasses

    from worker.config import Settings

    def names(cls: Any, prefix: str) -> set[str]:
        out = set()
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            nested = dataclasses.is_dataclass(default)
            out |= names(type(default), f"{prefix}{f.name}.") if nested else {prefix + f.name}
        return out

    existing = names(Settings, "")
    text = TROUBLESHOOTING.read_text(encoding="utf-8")
    mentioned = {m.replace("<class>", "realtime") for m in re.findall(r"`((?:kafka|topics|batching|model|runtime|"
                                                                      r"delivery|observability)\.[\w.<>]+)`", text)}
    assert mentioned and mentioned - existing == set()


def test_kubernetes_prometheusrule_has_the_same_rules() -> None:
    (rule,) = [d for d in yaml.safe_load_all(PROMETHEUS_RULE.read_text(encoding="utf-8")) if d]
    assert rule["kind"] == "PrometheusRule"
    source = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    assert rule["spec"]["groups"] == source, "rerun: python deploy/prometheus/to_prometheusrule.py"


def test_kubernetes_prometheusrule_is_the_generators_output() -> None:
    sys.path.insert(0, str(ALERTS.parent))
    try:
        import to_prometheusrule
    finally:
        sys.path.remove(str(ALERTS.parent))
    assert PROMETHEUS_RULE.read_text(encoding="utf-8") == to_prometheusrule.render(), \
        "rerun: python deploy/prometheus/to_prometheusrule.py"


def test_compose_prometheus_loads_the_alert_rules() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    mounts = {dst: (ROOT / src).resolve() for src, dst, *_ in (v.split(":") for v in service("prometheus")["volumes"])}
    loaded = {mounts.get(str(Path("/etc/prometheus") / f)) for f in config["rule_files"]}
    assert loaded == {ALERTS}
