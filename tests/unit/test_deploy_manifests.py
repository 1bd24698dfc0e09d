"""The deployment files agree with the code: ports, probe paths, consumer group and topics, and every
metric name on the dashboard and in docs/metrics.md is one the worker really exposes.

Nothing here builds an image or talks to a cluster: the files are parsed and compared with
`worker/config.py` defaults (or the ConfigMap's settings) and a `Metrics()` registry.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from worker.config import KafkaSettings, ObservabilitySettings, Settings, TopicSettings, load_settings
from worker.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "streamfer.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA_PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
METRICS_DOC = ROOT / "docs" / "metrics.md"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"

DEFAULT_PORT = ObservabilitySettings().metrics_port


# -- loading ----------------------------------------------------------------------------------------------
def yaml_docs(path: Path) -> list[Any]:
    with open(path, encoding="utf-8") as fh:
        return [d for d in yaml.safe_load_all(fh) if d is not None]


def all_yaml_files() -> list[Path]:
    files = sorted(p for p in (ROOT / "deploy").rglob("*.y*ml") if "local-kafka" not in p.parts)
    return [COMPOSE, *files]


@cache
def k8s_objects() -> tuple[dict[str, Any], ...]:
    objs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            objs.extend(yaml_docs(path))
    return tuple(objs)


def k8s(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in k8s_objects() if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''} in deploy/k8s, found {len(found)}"
    return found[0]


def worker_container() -> dict[str, Any]:
    containers = k8s("Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["worker"]
    return containers[0]


def container_port(name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in worker_container()["ports"]}
    return ports[name]


@cache
def compose() -> dict[str, Any]:
    (doc,) = yaml_docs(COMPOSE)
    return doc


def service(name: str) -> dict[str, Any]:
    return compose()["services"][name]


def config_map(name: str) -> dict[str, str]:
    return k8s("ConfigMap", name)["data"]


def configmap_settings_file() -> tuple[str, str]:
    """(key, TOML text) of the settings file the Deployment passes with --config."""
    args = worker_container()["args"]
    config_path = Path(args[args.index("--config") + 1])
    mounts = {m["name"]: m["mountPath"] for m in worker_container()["volumeMounts"]}
    volumes = k8s("Deployment")["spec"]["template"]["spec"]["volumes"]
    for volume in volumes:
        if "configMap" in volume and Path(mounts[volume["name"]]) == config_path.parent:
            data = config_map(volume["configMap"]["name"])
            return config_path.name, data[config_path.name]
    raise AssertionError(f"no ConfigMap volume is mounted at {config_path.parent}")


def configmap_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for source in worker_container().get("envFrom", []):
        env.update(config_map(source["configMapRef"]["name"]))
    return env


@cache
def deployed_settings() -> Settings:
    """The settings a pod runs with: the ConfigMap's file and env over the defaults."""
    import tempfile

    _key, text = configmap_settings_file()
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write(text)
    try:
        return load_settings(fh.name, env=configmap_env())
    finally:
        Path(fh.name).unlink()


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        instruction, _, args = full.partition(" ")
        out.append((instruction.upper(), args.strip()))
    return out


def dockerfile_stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """[(stage name, its instructions)] in order."""
    stages: list[tuple[str, list[tuple[str, str]]]] = []
    for instruction, args in dockerfile_instructions():
        if instruction == "FROM":
            words = args.split()
            name = words[words.index("AS") + 1] if "AS" in words else words[0]
            stages.append((name, []))
        elif stages:
            stages[-1][1].append((instruction, args))
    return stages


def dockerfile_global_args() -> dict[str, str]:
    args = {}
    for instruction, value in dockerfile_instructions():
        if instruction == "FROM":
            break
        if instruction == "ARG":
            name, _, default = value.partition("=")
            args[name] = default
    return args


# -- metric names -----------------------------------------------------------------------------------------
SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


def families() -> list[Any]:
    return list(Metrics().registry.collect())


def exposed_series() -> set[str]:
    """Every series name the worker can expose. Labelled metrics have no samples until used, so the names
    come from each family's name and type as well as from the samples present."""
    names: set[str] = set()
    for family in families():
        assert family.type in SERIES_SUFFIXES, f"{family.name}: unexpected metric type {family.type}"
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in SERIES_SUFFIXES[family.type])
    return names


def scraped_name(name: str, kind: str) -> str:
    """The name a metric is documented under: counters with _total, info with _info, others as defined."""
    return {"counter": name + "_total", "info": name + "_info"}.get(kind, name)


def declared_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """scraped name -> (type, label names) of every metric object on Metrics()."""
    out = {}
    for value in vars(Metrics()).values():
        if isinstance(value, MetricWrapperBase):
            out[scraped_name(value._name, value._type)] = (value._type, tuple(value._labelnames))
    return out


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "atan2", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label names
    (in {...} matchers or by/without/on lists) or inside strings and [ranges]."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"'(?:[^'\\]|\\.)*'", "''", s)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for match in re.finditer(r"(?<![\w:.$])[A-Za-z_:][\w:]*", s):
        word = match.group(0)
        if s[match.end():].lstrip().startswith("(") or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def dashboard_panels() -> list[dict[str, Any]]:
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            out.append(panel)
            walk(panel.get("panels", []))

    walk(dashboard()["panels"])
    return out


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    queries = []
    for panel in dashboard_panels():
        for t in panel.get("targets", []):
            queries.append((f"panel {panel['title']!r} target {t['refId']}", t["expr"]))
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"\s*label_values\((.+),\s*[\w]+\)\s*", q)
        queries.append((f"variable {var['name']}", m.group(1) if m else q))
    return queries


def metrics_doc_rows() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, labels) from the metrics table of docs/metrics.md."""
    rows = {}
    for line in METRICS_DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`streamfer_\w+`", cells[0]):
            rows[cells[0].strip("`")] = (cells[1], set(re.findall(r"`([^`]+)`", cells[2])))
    return rows


# -- every file parses ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", all_yaml_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_yaml_file_parses_to_mappings(path: Path) -> None:
    docs = yaml_docs(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize("obj", k8s_objects(), ids=lambda o: f"{o.get('kind')}/{o.get('metadata', {}).get('name')}")
def test_kubernetes_object_has_kind_version_and_name(obj: dict[str, Any]) -> None:
    assert obj.get("apiVersion") and obj.get("kind") and obj["metadata"].get("name")


def test_kustomization_lists_every_manifest() -> None:
    (kustomization,) = yaml_docs(K8S / "kustomization.yaml")
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests


def test_kustomization_image_rewrite_matches_the_deployment_image() -> None:
    (kustomization,) = yaml_docs(K8S / "kustomization.yaml")
    image_name = worker_container()["image"].rsplit(":", 1)[0]
    assert image_name in {i["name"] for i in kustomization["images"]}


def test_dashboard_json_parses_with_unique_panel_ids() -> None:
    ids = [p["id"] for p in dashboard_panels()]
    assert len(ids) == len(set(ids))
    assert dashboard()["uid"] and dashboard()["title"]


# -- one metrics port everywhere --------------------------------------------------------------------------
def ports_in_deployment() -> set[int]:
    annotations = k8s("Deployment")["spec"]["template"]["metadata"]["annotations"]
    return {container_port("metrics"), int(annotations["prometheus.io/port"])}


def ports_in_service() -> set[int]:
    (port,) = k8s("Service")["spec"]["ports"]
    assert port["name"] == "metrics"
    target = port["targetPort"]
    return {port["port"], container_port(target) if isinstance(target, str) else target}


def ports_in_configmap() -> set[int]:
    _key, text = configmap_settings_file()
    return {tomllib.loads(text).get("observability", {}).get("metrics_port", DEFAULT_PORT),
            deployed_settings().observability.metrics_port}


def ports_in_prometheus() -> set[int]:
    (job,) = [j for j in yaml_docs(PROMETHEUS)[0]["scrape_configs"] if j["job_name"] == "streamfer-worker"]
    ports = {d["port"] for d in job.get("dns_sd_configs", [])}
    ports |= {int(t.rsplit(":", 1)[1]) for s in job.get("static_configs", []) for t in s["targets"]}
    return ports


def ports_in_dockerfile() -> set[int]:
    exposed = {int(p.split("/")[0]) for i, a in dockerfile_instructions() if i == "EXPOSE" for p in a.split()}
    (healthcheck,) = [a for i, a in dockerfile_instructions() if i == "HEALTHCHECK"]
    defaults = {int(p) for p in re.findall(r"WORKER_OBSERVABILITY_METRICS_PORT',\s*'(\d+)'", healthcheck)}
    return exposed | defaults


def ports_in_compose() -> set[int]:
    worker = service("worker")
    ports = {int(str(p)) for p in worker.get("expose", [])}
    ports |= {int(str(p).rsplit(":", 1)[-1]) for p in worker.get("ports", [])}
    ports.add(int(worker["environment"].get("WORKER_OBSERVABILITY_METRICS_PORT", DEFAULT_PORT)))
    return ports


@pytest.mark.parametrize("where", [ports_in_deployment, ports_in_service, ports_in_configmap, ports_in_prometheus,
                                   ports_in_dockerfile, ports_in_compose], ids=lambda f: f.__name__)
def test_metrics_port_is_the_configured_default(where: Callable[[], set[int]]) -> None:
    assert where() == {DEFAULT_PORT}


# -- probes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("probe, path", [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz"),
                                         ("startupProbe", "/healthz")])
def test_probe_uses_the_health_endpoint_on_the_metrics_port(probe: str, path: str) -> None:
    get = worker_container()[probe]["httpGet"]
    assert get["path"] == path
    port = container_port(get["port"]) if isinstance(get["port"], str) else get["port"]
    assert port == DEFAULT_PORT


def test_dockerfile_healthcheck_calls_healthz_with_python() -> None:
    (healthcheck,) = [a for i, a in dockerfile_instructions() if i == "HEALTHCHECK"]
    assert "/healthz" in healthcheck and "urllib" in healthcheck


# -- Kubernetes: ConfigMap, Deployment, KEDA --------------------------------------------------------------
def test_configmap_settings_are_valid() -> None:
    deployed_settings()  # raises ConfigError naming every bad field


def test_configmap_env_and_file_set_different_fields() -> None:
    _key, text = configmap_settings_file()
    data = tomllib.loads(text)
    in_file = {f"WORKER_{section}_{name}".upper() for section, values in data.items() for name in values}
    assert all(k.startswith("WORKER_") for k in configmap_env())
    assert not in_file & set(configmap_env())


def test_worker_id_is_the_pod_name() -> None:
    env = {e["name"]: e for e in worker_container()["env"]}
    assert env["WORKER_OBSERVABILITY_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_pod_runs_as_the_images_non_root_user() -> None:
    pod = k8s("Deployment")["spec"]["template"]["spec"]["securityContext"]
    runtime_user = [a for i, a in dockerfile_stages()[-1][1] if i == "USER"][-1]
    assert pod["runAsNonRoot"] is True
    assert str(pod["runAsUser"]) == runtime_user.split(":")[0] != "0"


def test_termination_grace_covers_the_drain() -> None:
    # The drain waits up to 30 s for the broker's acks after running what is pending.
    assert k8s("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60


def test_deployment_leaves_replicas_to_keda() -> None:
    assert "replicas" not in k8s("Deployment")["spec"]


@pytest.mark.parametrize("kind", ["Service", "PodDisruptionBudget"])
def test_selector_matches_the_worker_pods(kind: str) -> None:
    spec = k8s(kind)["spec"]
    selector = spec["selector"].get("matchLabels", spec["selector"])
    labels = k8s("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selector and selector.items() <= labels.items()


def test_keda_scales_the_worker_deployment() -> None:
    target = k8s("ScaledObject")["spec"]["scaleTargetRef"]
    assert target["name"] == k8s("Deployment")["metadata"]["name"]


def keda_triggers() -> list[dict[str, Any]]:
    triggers = k8s("ScaledObject")["spec"]["triggers"]
    assert all(t["type"] == "kafka" for t in triggers)
    return triggers


def test_keda_has_one_trigger_per_input_topic() -> None:
    topics = [t["metadata"]["topic"] for t in keda_triggers()]
    assert sorted(topics) == sorted(deployed_settings().topics.input_topics())
    assert sorted(topics) == sorted(TopicSettings().input_topics())  # the ConfigMap keeps the default names


def test_keda_measures_the_workers_consumer_group() -> None:
    groups = {t["metadata"]["consumerGroup"] for t in keda_triggers()}
    assert groups == {deployed_settings().kafka.group_id} == {KafkaSettings().group_id}


def test_keda_reads_the_workers_brokers() -> None:
    servers = {t["metadata"]["bootstrapServers"] for t in keda_triggers()}
    assert servers == {deployed_settings().kafka.bootstrap_servers}


def test_keda_lag_thresholds_are_positive() -> None:
    assert all(int(t["metadata"]["lagThreshold"]) > 0 for t in keda_triggers())


def test_keda_trigger_metadata_values_are_strings() -> None:
    # The ScaledObject CRD types trigger metadata as map[string]string: an unquoted 20 or false is rejected.
    for trigger in keda_triggers():
        assert all(isinstance(v, str) for v in trigger["metadata"].values()), trigger["metadata"]


def created_partitions() -> set[int]:
    """Partition counts the documented `worker topics` commands create (compose and docs/deploy.md)."""
    command = service("topics")["command"]
    counts = {int(command[command.index("--partitions") + 1])}
    doc = DEPLOY_DOC.read_text(encoding="utf-8")
    counts |= {int(n) for n in re.findall(r"\btopics --bootstrap-servers \S+ --partitions (\d+)", doc)}
    return counts


def test_keda_max_replicas_do_not_exceed_the_input_partitions() -> None:
    spec = k8s("ScaledObject")["spec"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] <= min(created_partitions())


# -- docker compose ---------------------------------------------------------------------------------------
def test_compose_has_the_whole_stack() -> None:
    assert {"kafka", "topics", "worker", "producer", "prometheus", "grafana"} <= set(compose()["services"])


def test_compose_kafka_is_a_single_kraft_node_with_a_healthcheck() -> None:
    kafka = service("kafka")
    env = {k: str(v) for k, v in kafka["environment"].items()}
    assert kafka["image"] == "apache/kafka:4.1.1"
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@kafka:9093"
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    for name in ("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
                 "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"):
        assert env[name] == "1"
    assert env["KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS"] == "0"
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
    assert kafka["healthcheck"]["test"]


def test_compose_creates_topics_once_kafka_is_healthy() -> None:
    topics = service("topics")
    assert topics["command"][:3] == ["topics", "--bootstrap-servers", "kafka:9092"]
    assert topics["depends_on"]["kafka"]["condition"] == "service_healthy"


@pytest.mark.parametrize("name", ["worker", "producer"])
def test_compose_service_starts_after_topics_exist(name: str) -> None:
    assert service(name)["depends_on"]["topics"]["condition"] == "service_completed_successfully"


def test_compose_worker_reads_the_compose_broker() -> None:
    worker = service("worker")
    assert worker["environment"]["WORKER_KAFKA_BOOTSTRAP_SERVERS"] == "kafka:9092"
    assert worker["command"][0] == "run"


def test_compose_producer_feeds_an_input_topic_at_a_fixed_rate() -> None:
    command = service("producer")["command"]
    assert command[0] == "produce"
    assert command[command.index("--topic") + 1] == TopicSettings().standard
    assert float(command[command.index("--rate") + 1]) == 50
    assert "," in command[command.index("--shape") + 1]


def test_compose_worker_tools_share_one_image() -> None:
    images = {service(n)["image"] for n in ("topics", "worker", "producer")}
    assert len(images) == 1


@pytest.mark.parametrize("name", ["topics", "producer"])
def test_compose_one_shot_tools_skip_the_images_healthcheck(name: str) -> None:
    # The image's HEALTHCHECK probes /healthz, which only `worker run` serves.
    assert service(name)["healthcheck"]["disable"] is True


def test_prometheus_scrapes_the_compose_worker_service() -> None:
    (job,) = [j for j in yaml_docs(PROMETHEUS)[0]["scrape_configs"] if j["job_name"] == "streamfer-worker"]
    hosts = {n for d in job.get("dns_sd_configs", []) for n in d["names"]}
    hosts |= {t.rsplit(":", 1)[0] for s in job.get("static_configs", []) for t in s["targets"]}
    assert hosts == {"worker"}
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_prometheus_config_is_mounted_by_compose() -> None:
    mounts = [v.split(":") for v in service("prometheus")["volumes"]]
    assert any((ROOT / src).resolve() == PROMETHEUS and dst == "/etc/prometheus/prometheus.yml"
               for src, dst, *_ in mounts)


def test_grafana_datasource_points_at_compose_prometheus() -> None:
    (doc,) = yaml_docs(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")
    (source,) = doc["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090:9090" in service("prometheus")["ports"]


def test_grafana_loads_the_dashboard_from_its_mount() -> None:
    (doc,) = yaml_docs(GRAFANA_PROVISIONING / "dashboards" / "streamfer.yml")
    (provider,) = doc["providers"]
    mounts = {dst: (ROOT / src).resolve() for src, dst, *_ in (v.split(":") for v in service("grafana")["volumes"])}
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    assert mounts["/etc/grafana/provisioning"] == GRAFANA_PROVISIONING


def test_dashboard_latency_panels_show_exemplars_linked_to_their_traces() -> None:
    latency = [p for p in dashboard_panels() if any("_seconds_bucket" in t["expr"] and "commit" not in t["expr"]
                                                    for t in p.get("targets", []))]
    assert {p["title"] for p in latency} == {"Queue wait", "Preprocess and inference per batch", "End to end"}
    for panel in latency:
        assert all(t.get("exemplar") is True for t in panel["targets"]), panel["title"]
    (doc,) = yaml_docs(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")
    (destination,) = doc["datasources"][0]["jsonData"]["exemplarTraceIdDestinations"]
    assert destination["name"] == "trace_id" and destination["url"].endswith("/trace/$${__value.raw}")
    assert "--enable-feature=exemplar-storage" in service("prometheus")["command"]


def test_dashboard_uses_the_provisioned_datasource() -> None:
    (doc,) = yaml_docs(GRAFANA_PROVISIONING / "datasources" / "prometheus.yml")
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == doc["datasources"][0]["uid"]
    for panel in dashboard_panels():
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


# -- Dockerfile -------------------------------------------------------------------------------------------
def test_dockerfile_offers_a_cpu_and_a_cuda_base() -> None:
    args = dockerfile_global_args()
    assert args["VARIANT"] == "cpu"
    assert args["CPU_BASE"].startswith("python:3.11-slim")
    assert re.fullmatch(r"nvidia/cuda:13\.0\.\d+-cudnn-runtime-ubuntu24\.04", args["CUDA_BASE"])
    froms = [a for i, a in dockerfile_instructions() if i == "FROM"]
    assert "${CPU_BASE} AS base-cpu" in froms and "${CUDA_BASE} AS base-cuda" in froms


def test_dockerfile_default_target_is_the_runtime_stage() -> None:
    name, instructions = dockerfile_stages()[-1]
    assert name == "runtime"
    assert ("ENTRYPOINT", '["worker"]') in instructions
    assert ("CMD", '["run"]') in instructions
    user = [a for i, a in instructions if i == "USER"][-1]
    assert user.split(":")[0].isdigit() and user.split(":")[0] != "0"


def test_dockerfile_installs_the_project_with_its_schemas() -> None:
    runs = " ".join(a for i, a in dockerfile_instructions() if i == "RUN")
    copies = [shlex.split(a) for i, a in dockerfile_instructions() if i == "COPY" and "--from" not in a]
    sources = {Path(s).name for c in copies for s in c[:-1]}
    assert {"pyproject.toml", "worker", "schemas"} <= sources
    assert "pip install /src" in runs
    assert "import worker.codec.schemas" in runs  # the build fails if the installed package misses its schemas


def test_dockerignore_keeps_local_state_out_but_not_the_sources() -> None:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    for required in (".venv", ".local-kafka", "deploy/local-kafka/lib", "bench/results", ".git"):
        assert required in patterns
    for needed in ("pyproject.toml", "worker", "worker/cli.py", "schemas", "schemas/frame.avsc"):
        assert not any(fnmatch.fnmatch(needed, p) for p in patterns), needed


# -- metric names: dashboard and docs ---------------------------------------------------------------------
def test_promql_name_check_catches_a_typo() -> None:
    exposed = exposed_series()
    good = 'histogram_quantile(0.99, sum by (le, priority) (rate(streamfer_queue_wait_seconds_bucket{x=~"$y"}[5m])))'
    assert promql_metric_names(good) == {"streamfer_queue_wait_seconds_bucket"} <= exposed
    for bad in ("sum(rate(streamfer_frames_consumed[5m]))",          # a counter without _total
                "streamfer_model",                                     # an info metric without _info
                "rate(streamfer_batch_size[1m])",                      # a histogram without a series suffix
                "sum by (topic) (streamfer_consumer_lags)"):           # a typo
        assert not promql_metric_names(bad) <= exposed, bad


@pytest.mark.parametrize("where, expr", dashboard_queries(), ids=[w for w, _ in dashboard_queries()])
def test_dashboard_query_uses_only_exposed_metrics(where: str, expr: str) -> None:
    names = promql_metric_names(expr)
    assert names, f"{where}: no metric in {expr!r}"
    assert names <= exposed_series(), f"{where}: not exposed by the worker: {sorted(names - exposed_series())}"


def test_dashboard_quantiles_are_taken_over_buckets_by_le() -> None:
    for where, expr in dashboard_queries():
        for inner in re.findall(r"histogram_quantile\(\s*[\d.]+\s*,(.*)", expr):
            assert re.search(r"by \((?:[^)]*\b)?le\b", inner), f"{where}: histogram_quantile without `by (le…)`"
            assert all(n.endswith("_bucket") for n in promql_metric_names(inner)), where


def test_dashboard_shows_every_metric() -> None:
    used = {n for _, expr in dashboard_queries() for n in promql_metric_names(expr)}
    for family in families():
        series = {family.name + s for s in SERIES_SUFFIXES[family.type]}
        assert series & used, f"{family.name} has no panel"


def test_metrics_doc_names_only_exposed_metrics() -> None:
    histograms = {f.name for f in families() if f.type == "histogram"}
    mentioned = set(re.findall(r"\bstreamfer_\w+", METRICS_DOC.read_text(encoding="utf-8")))
    assert mentioned
    assert mentioned <= exposed_series() | histograms, sorted(mentioned - exposed_series() - histograms)


def test_metrics_doc_queries_use_only_exposed_metrics() -> None:
    queries = re.findall(r"\| `([^`]*\(.*\))` \|", METRICS_DOC.read_text(encoding="utf-8"))
    assert queries
    for query in queries:
        assert promql_metric_names(query) <= exposed_series(), query


@pytest.mark.parametrize("name", sorted(declared_metrics()))
def test_metric_is_documented_with_its_type_and_labels(name: str) -> None:
    rows = metrics_doc_rows()
    assert name in rows, f"{name} is missing from the table in docs/metrics.md"
    kind, labels = declared_metrics()[name]
    doc_kind, doc_labels = rows[name]
    assert doc_kind == kind
    if kind != "info":  # an info metric's labels are its keys, set when the model loads
        assert doc_labels == set(labels)


def test_metrics_doc_lists_no_metric_the_code_lacks() -> None:
    assert set(metrics_doc_rows()) == set(declared_metrics())


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/readyz"])
def test_metrics_doc_describes_the_endpoint(path: str) -> None:
    rows = re.findall(r"^\| `(/\w*)` \|", METRICS_DOC.read_text(encoding="utf-8"), re.MULTILINE)
    assert path in rows, f"no row for {path} in the endpoints table of docs/metrics.md"
