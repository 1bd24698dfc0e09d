"""Writes deploy/k8s/prometheusrule.yaml from deploy/prometheus/alerts.yml, the one source of the alert rules.

    python deploy/prometheus/to_prometheusrule.py      (tests/unit/test_alerts.py fails until it is rerun)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "alerts.yml"
TARGET = HERE.parent / "k8s" / "prometheusrule.yaml"
HEADER = """\
# Generated from deploy/prometheus/alerts.yml by deploy/prometheus/to_prometheusrule.py: edit that file, then
# rerun the script. The Prometheus Operator's PrometheusRule (CRD monitoring.coreos.com/v1) with the same
# groups; a Prometheus whose ruleSelector matches `release` (kube-prometheus-stack's default) loads it.
"""


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the PromQL expressions), so the output reads like the source."""


def _str(dumper: yaml.SafeDumper, value: str) -> Any:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def prometheus_rule(groups: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "streamfer-worker",
                     "labels": {"app.kubernetes.io/name": "streamfer", "release": "kube-prometheus-stack"}},
        "spec": {"groups": groups},
    }


def render() -> str:
    groups = yaml.safe_load(SOURCE.read_text(encoding="utf-8"))["groups"]
    body = yaml.dump(prometheus_rule(groups), Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)
    return HEADER + body


if __name__ == "__main__":
    TARGET.write_text(render(), encoding="utf-8")
    sys.stdout.write(f"wrote {TARGET}\n")
