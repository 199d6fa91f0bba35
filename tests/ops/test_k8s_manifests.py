"""deploy/k8s (docs/kubernetes.md): what `kubectl kustomize` renders, checked offline.

Every rendered object of the base, the peer-plane overlay and the engine example is validated
against the Kubernetes OpenAPI schemas of K8S_VERSION (the kubernetes-validate package, strict:
unknown fields are errors). The PodMonitor is a CRD (monitoring.coreos.com/v1) that those schemas
do not hold: its required fields and its agreement with the DaemonSet are checked here by hand.
The node.toml the ConfigMap carries goes through the real `ecd check-config`, the peer-plane
init container's render script runs for real, and a daemon started from the ConfigMap's config
answers the probes' path. The security contract (no host namespaces, non-root, no capabilities
beyond the one init container's CHOWN/FOWNER, the socket directory as the only hostPath) is
checked on every pod the manifests define.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ecd.daemon.restart.holder_wire import socket_path

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUBECTL = shutil.which("kubectl")
# Schemas of the oldest Kubernetes still in upstream support when this was written; the manifests
# use nothing newer (kubernetes-validate 1.37 ships 1.25 to 1.37).
K8S_VERSION = "1.32.0"
SOCKET_DIR = "/run/ecd"
# The one container that may run as root, and all it may do (daemonset.yaml says why).
ROOT_INIT = "socket-dir"
ROOT_INIT_CAPS = {"CHOWN", "FOWNER"}
# What is rendered: deploy/k8s itself, the engine example, and deploy/k8s with the peer-plane
# component through an overlay like the one its kustomization.yaml shows (written to a temporary
# directory: kustomize refuses an overlay inside the directory it builds on).
TARGETS = ["deploy/k8s", "deploy/k8s/examples", "peer-plane overlay"]
PEER_ADDRESSES = "10.0.0.5 10.0.0.6 10.0.0.7"

needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian package "
                                   "kubernetes-client; `make test` installs it when run as root)")


def peer_plane_overlay(directory: Path) -> Path:
    directory.mkdir(exist_ok=True)
    base = os.path.relpath(K8S, directory)  # kustomize takes relative paths only
    (directory / "kustomization.yaml").write_text(f"""apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: ecd
resources: [{base}]
components: [{base}/components/peer-plane]
configMapGenerator:
  - name: ecd-peers
    literals: ["addresses={PEER_ADDRESSES}"]
""")
    return directory


def render(target: str) -> list[dict]:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (pip install -e '.[dev]')")
    with tempfile.TemporaryDirectory(prefix="ecd-k8s-overlay-") as scratch:
        path = peer_plane_overlay(Path(scratch)) if target == "peer-plane overlay" else REPO / target
        out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and 'unknown field "components"' in out.stderr:
        pytest.skip(f"{KUBECTL}'s built-in kustomize predates components (kubectl < 1.21, e.g. Debian 12's "
                    "kubernetes-client 1.20): the peer-plane component is not rendered")
    assert out.returncode == 0, f"kubectl kustomize {target} failed: {out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def daemonset(docs: list[dict], name: str = "ecd") -> dict:
    """The DaemonSet `name`: "ecd" (the daemon) or "ecd-holder" (the pool holder, holder.yaml)."""
    found = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one DaemonSet {name}, got {len(found)}"
    return found[0]


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    specs = []
    for doc in docs:
        if doc["kind"] == "Pod":
            specs.append((f"Pod/{doc['metadata']['name']}", doc["spec"]))
        elif doc["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Job"):
            specs.append((f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]["spec"]))
    return specs


def node_toml(docs: list[dict]) -> str:
    """The node.toml of the ConfigMap the configMapGenerator made (ecd-config-<hash>)."""
    found = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("ecd-config-")]
    assert len(found) == 1, f"expected one ecd-config ConfigMap, got {len(found)}"
    return found[0]["data"]["node.toml"]


def check_config(path: Path) -> subprocess.CompletedProcess:
    """The real CLI, in a fresh interpreter: what `ecd check-config PATH` prints and returns."""
    return subprocess.run([sys.executable, "-m", "ecd", "check-config", str(path)],
                          capture_output=True, text=True, timeout=60)


def parse_quantity(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "": 1}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|)", str(text))
    assert match, f"memory quantity {text!r}: use a binary unit (Ki, Mi, Gi, Ti)"
    return int(match.group(1)) * units[match.group(2)]


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_every_rendered_object_is_valid(target):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is a dev extra: pip install -e '.[dev]'")
    import jsonschema
    docs = render(target)
    assert docs, f"{target} rendered nothing"
    for doc in docs:
        what = f"{doc['kind']}/{doc['metadata'].get('name')}"
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            check_pod_monitor(doc, docs)
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except jsonschema.ValidationError as exc:  # kubernetes_validate's own subclasses it
            pytest.fail(f"{target}: {what} is not a valid Kubernetes {K8S_VERSION} object: "
                        f"{'.'.join(map(str, exc.absolute_path))}: {exc.message}", pytrace=False)


def check_pod_monitor(monitor: dict, docs: list[dict]) -> None:
    """The Prometheus Operator's PodMonitor (not in the core schemas): the fields it requires, and
    that it selects the DaemonSet's pods on a port the ecd container names."""
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert monitor["metadata"]["name"] and monitor["metadata"]["namespace"] == "ecd"
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels",
                         "sampleLimit", "targetLimit"}, f"unexpected PodMonitor spec keys: {sorted(spec)}"
    daemon_set = daemonset(docs)
    pod_labels = daemon_set["spec"]["template"]["metadata"]["labels"]
    selector = spec["selector"]["matchLabels"]
    assert selector and selector.items() <= pod_labels.items(), "the PodMonitor selects no ecd pod"
    ports = {p["name"]: p["containerPort"] for c in daemon_set["spec"]["template"]["spec"]["containers"]
             for p in c.get("ports", [])}
    assert spec["podMetricsEndpoints"], "a PodMonitor needs at least one endpoint"
    for endpoint in spec["podMetricsEndpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "relabelings",
                                 "metricRelabelings", "honorLabels"}, f"unexpected endpoint keys: {sorted(endpoint)}"
        assert endpoint["port"] in ports, f"endpoint port {endpoint['port']!r} is not a named container port"
        assert endpoint.get("path", "/metrics") == "/metrics"
        assert re.fullmatch(r"\d+(ms|s|m)", endpoint.get("interval", "30s"))
        for relabel in endpoint.get("relabelings", []):
            assert relabel["sourceLabels"] and relabel["targetLabel"]


@needs_kubectl
def test_the_config_map_node_toml_passes_check_config(tmp_path):
    docs = render("deploy/k8s")
    text = node_toml(docs)
    assert text == (K8S / "node.toml").read_text(), "the ConfigMap is not generated from deploy/k8s/node.toml"
    path = tmp_path / "node.toml"
    path.write_text(text)
    out = check_config(path)
    assert out.returncode == 0, f"ecd check-config rejects the ConfigMap's node.toml: {out.stderr}"
    effective = tomllib.loads(out.stdout)
    assert effective["control"]["endpoint"] == f"ipc://{SOCKET_DIR}/ecd.sock"
    assert effective["node"]["runtime_dir"] == SOCKET_DIR
    # Probes and Prometheus come to the pod's IP: the loopback default would fail them all.
    host, _, port = effective["metrics"]["listen"].rpartition(":")
    assert host == "0.0.0.0"
    container = daemonset(docs)["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": int(port), "protocol": "TCP"} in container["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe


@needs_kubectl
def test_the_memory_limit_holds_the_pool_and_headroom(tmp_path):
    """The pool's pages are charged to the daemon pod's cgroup: its limit must hold them all, plus
    the ring and the process (a limit below the pool is an OOM kill at start)."""
    sys.path.insert(0, str(REPO))
    from ecd.config import load_config_file
    docs = render("deploy/k8s")
    path = tmp_path / "node.toml"
    path.write_text(node_toml(docs))
    config = load_config_file(path)
    resources = daemonset(docs)["spec"]["template"]["spec"]["containers"][0]["resources"]
    limit = parse_quantity(resources["limits"]["memory"])
    assert parse_quantity(resources["requests"]["memory"]) == limit, "memory request and limit differ"
    floor = int(config.pool.host.size) + config.ring.file_bytes() + (256 << 20)
    assert limit >= floor, f"memory limit {limit} < pool + ring + 256 MiB = {floor}"
    assert "cpu" not in resources["limits"], "a CPU limit throttles the serving loop (daemonset.yaml)"


@needs_kubectl
@pytest.mark.parametrize("target", TARGETS)
def test_no_host_namespaces_no_privilege_and_only_the_socket_dir(target):
    for where, spec in pod_specs(render(target)):
        for key in ("hostIPC", "hostPID", "hostNetwork"):
            assert spec.get(key) is not True, f"{where}: {key}"
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True, f"{where}: runAsNonRoot is not set for the pod"
        assert pod_sc.get("runAsUser", 0) != 0, f"{where}: the pod runs as root"
        host_paths = {v["name"]: v["hostPath"] for v in spec.get("volumes", []) if "hostPath" in v}
        assert [h["path"] for h in host_paths.values()] == [SOCKET_DIR], f"{where}: hostPaths {host_paths}"
        assert list(host_paths.values())[0]["type"] in ("Directory", "DirectoryOrCreate")
        for container in spec.get("initContainers", []) + spec["containers"]:
            name = f"{where}/{container['name']}"
            sc = container.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, f"{name}: allowPrivilegeEscalation"
            assert sc.get("privileged") is not True, f"{name}: privileged"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{name}: does not drop ALL capabilities"
            added = set(sc.get("capabilities", {}).get("add", []))
            runs_as_root = sc.get("runAsUser", pod_sc.get("runAsUser")) == 0 or sc.get("runAsNonRoot") is False
            if container["name"] == ROOT_INIT and where.startswith("DaemonSet/"):
                # root only to give the hostPath to the daemon's uid, and nothing else
                assert added <= ROOT_INIT_CAPS, f"{name}: adds {added}"
                assert container["command"][-1] == "chmod 0770 /run/ecd && chown 10001:10001 /run/ecd"
                assert sc.get("readOnlyRootFilesystem") is True
            else:
                assert not runs_as_root, f"{name}: runs as root"
                assert sc.get("runAsNonRoot") is not False, f"{name}: runAsNonRoot overridden"
                assert not added, f"{name}: adds capabilities {added}"
            for mount in container.get("volumeMounts", []):
                if mount["name"] in host_paths:
                    assert mount["mountPath"] == SOCKET_DIR and not mount.get("subPath"), f"{name}: {mount}"
        if where.startswith("DaemonSet/"):  # the daemon's and the pool holder's
            for container in spec["containers"]:
                assert container["securityContext"]["readOnlyRootFilesystem"] is True, f"{where}/{container['name']}"
            assert spec["automountServiceAccountToken"] is False


@needs_kubectl
def test_the_engine_example_is_one_engine_per_tenant_by_uid_alone():
    """deploy/k8s/examples: an engine per tenant, each in its tenant's namespace (a privileged one,
    for the hostPath) and as the uid node.toml's [tenants.NAME] names, in no group of the daemon's."""
    import json
    import tomllib

    from ecd.config import load_config
    docs = render("deploy/k8s/examples")
    rendered = render("deploy/k8s")
    daemon_sc = daemonset(rendered)["spec"]["template"]["spec"]["securityContext"]
    config = load_config(tomllib.loads(node_toml(rendered)))
    tenants = {name: t for name, t in config.tenants.items() if name != "default"}
    assert config.tenants["default"].admit is False  # a uid of no tenant is refused
    pods = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "Pod"}
    namespaces = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Namespace"}
    assert set(pods) == set(namespaces) == set(tenants), (set(pods), set(namespaces), set(tenants))
    for name, pod in pods.items():
        assert namespaces[name]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
        sc = pod["spec"]["securityContext"]
        assert sc["runAsUser"] in tenants[name].uids and sc["runAsUser"] != daemon_sc["runAsUser"], name
        assert daemon_sc["runAsGroup"] not in sc.get("supplementalGroups", []) + [sc["runAsGroup"]], name
        args = pod["spec"]["containers"][0]["args"]
        configs = {a.split("=", 1)[0]: json.loads(a.split("=", 1)[1]) for a in args if a.startswith("--e") or
                   a.startswith("--kv")}
        socket = f"ipc://{SOCKET_DIR}/ecd.sock"
        assert configs["--ec-transfer-config"]["ec_connector_extra_config"]["endpoint"] == socket
        assert configs["--kv-transfer-config"]["kv_connector_extra_config"]["endpoint"] == socket
        assert configs["--kv-transfer-config"]["kv_connector_module_path"] == "ecd.integrations.vllm"


@needs_kubectl
def test_the_peer_plane_renders_a_config_per_node_that_check_config_accepts(tmp_path):
    """The init container's script, run for real on a node named like a cloud VM, gives a
    node.toml with its own name and address, the other nodes as peers, and passes check-config
    with a key pair from `ecd keygen` in the Secret's place."""
    docs = render("peer-plane overlay")
    daemon_set = daemonset(docs)
    init = next(c for c in daemon_set["spec"]["template"]["spec"]["initContainers"] if c["name"] == "render-config")
    peers_map = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("ecd-peers-"))
    addresses = peers_map["data"]["addresses"].split()
    keys = tmp_path / "keys"
    made = subprocess.run([sys.executable, "-m", "ecd", "keygen", str(keys), "--name", "cluster"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    (tmp_path / "template").mkdir()
    (tmp_path / "template" / "node.toml").write_text(node_toml(docs).replace("/etc/ecd-cluster", str(keys)))
    (tmp_path / "node").mkdir()
    script = init["command"][-1].replace("/etc/ecd-template", str(tmp_path / "template")) \
        .replace("/etc/ecd-node", str(tmp_path / "node")).replace("/etc/ecd-cluster", str(keys))
    env = {"PATH": "/usr/bin:/bin", "NODE_NAME": "ip-10-0-0-6.ec2.internal", "NODE_IP": addresses[1],
           "PEER_IPS": peers_map["data"]["addresses"]}
    out = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    rendered = tmp_path / "node" / "node.toml"
    result = check_config(rendered)
    assert result.returncode == 0, f"ecd check-config rejects the rendered node.toml: {result.stderr}\n" \
                                   f"{rendered.read_text()}"
    effective = tomllib.loads(result.stdout)
    assert effective["node"]["name"] == "ip-10-0-0-6-ec2-internal"
    others = [f"tcp://{ip}:7480" for ip in addresses if ip != addresses[1]]
    assert effective["cluster"]["peers"] == others
    assert sorted(effective["cluster"]["peer_keys"]) == sorted(others)
    assert effective["cluster"]["advertise"] == f"tcp://{addresses[1]}:7480"
    assert effective["cluster"]["data_listen"] == "tcp://0.0.0.0:7481"
    ports = {p["containerPort"]: p.get("hostPort") for p in daemon_set["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports[7480] == 7480 and ports[7481] == 7481
    policy = one(docs, "NetworkPolicy")
    peer_rule = next(r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": 7480} in r["ports"])
    assert peer_rule["from"] == [{"podSelector": {"matchLabels": daemon_set["spec"]["selector"]["matchLabels"]}}]
    assert sorted(p["port"] for p in peer_rule["ports"]) == [7480, 7481]


def holder_command(docs: list[dict]) -> list[str]:
    container = daemonset(docs, "ecd-holder")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in container] == ["holder"], "the holder pod runs the holder alone"
    return container[0]["command"]


def holder_args(command: list[str]) -> dict[str, str]:
    """--node, --runtime-dir and --hold of an `ecd hold` command line."""
    assert command[:2] == ["ecd", "hold"], f"the holder does not run `ecd hold`: {command}"
    args = dict(zip(command[2::2], command[3::2]))
    assert sorted(args) == ["--hold", "--node", "--runtime-dir"] and len(command) == 8, command
    return args


def seconds_of(duration: str) -> float:
    units = {"ms": 1e-3, "s": 1, "m": 60, "min": 60, "h": 3600}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", duration)
    assert match, duration
    return float(match.group(1)) * units[match.group(2) or "s"]


@needs_kubectl
def test_the_holder_daemonset_keeps_the_pool_of_the_daemon_of_its_node(tmp_path):
    """holder.yaml (issue 27): `ecd hold` under the daemon's [node] name in the same socket
    directory (a hostPath), as the daemon's uid (the holder socket admits only its own uid), on
    the same nodes, never restarted by an upgrade (OnDelete), small, and node.toml tells the
    daemon to use it rather than spawn one (a spawned holder dies with the pod)."""
    docs = render("deploy/k8s")
    daemon, holder = daemonset(docs), daemonset(docs, "ecd-holder")
    path = tmp_path / "node.toml"
    path.write_text(node_toml(docs))
    out = check_config(path)
    assert out.returncode == 0, out.stderr
    effective = tomllib.loads(out.stdout)
    assert effective["restart"]["adopt"] is True and effective["restart"]["keeper"] == "holder"
    args = holder_args(holder_command(docs))
    assert args["--node"] == effective["node"]["name"], "the holder holds another node's pool"
    assert args["--runtime-dir"] == effective["node"]["runtime_dir"] == SOCKET_DIR
    assert float(args["--hold"]) == seconds_of(effective["restart"]["hold"]), "holder.yaml's --hold != [restart] hold"
    assert float(args["--hold"]) >= 300, "a rolling update's window (old pod gone, new image pulled) needs minutes"
    assert holder["spec"]["updateStrategy"] == {"type": "OnDelete"}, "an upgrade must not restart the holder"
    dspec, hspec = daemon["spec"]["template"]["spec"], holder["spec"]["template"]["spec"]
    for key in ("runAsUser", "runAsGroup"):
        assert hspec["securityContext"][key] == dspec["securityContext"][key], key
    sockets = [v["hostPath"] for spec in (dspec, hspec) for v in spec["volumes"] if "hostPath" in v]
    assert sockets == [{"path": SOCKET_DIR, "type": "DirectoryOrCreate"}] * 2
    for key in ("nodeSelector", "tolerations", "affinity"):
        assert hspec.get(key) == dspec.get(key), f"the holder runs on other nodes than the daemon ({key})"
    # it may start first on a new node: it gives the hostPath to the daemon's uid just the same
    init = {c["name"]: c for c in dspec["initContainers"]}
    assert [c["name"] for c in hspec["initContainers"]] == [ROOT_INIT]
    assert hspec["initContainers"][0] == init[ROOT_INIT]
    resources = hspec["containers"][0]["resources"]
    assert parse_quantity(resources["limits"]["memory"]) <= 256 << 20, "the pool is not charged to the holder"
    assert parse_quantity(resources["requests"]["memory"]) <= parse_quantity(resources["limits"]["memory"])
    # the daemon's selectors (the DaemonSet's own, the PodMonitor's) do not pick holder pods
    holder_labels = holder["spec"]["template"]["metadata"]["labels"]
    assert not daemon["spec"]["selector"]["matchLabels"].items() <= holder_labels.items()
    assert not holder["spec"]["selector"]["matchLabels"].items() <= daemon["spec"]["template"]["metadata"]["labels"].items()
    monitor = one(docs, "PodMonitor")
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= holder_labels.items()


@needs_kubectl
def test_the_peer_plane_holder_uses_the_name_the_daemon_renders(tmp_path):
    """With the peer plane each node's daemon is named after its Kubernetes node: the holder's
    script, run for real, must come to the same name as render-config's."""
    docs = render("peer-plane overlay")
    effective_template = node_toml(docs)
    assert 'keeper = "holder"' in effective_template
    init = next(c for c in daemonset(docs)["spec"]["template"]["spec"]["initContainers"]
                if c["name"] == "render-config")
    holder = daemonset(docs, "ecd-holder")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in holder["env"]
    (tmp_path / "template").mkdir()
    (tmp_path / "template" / "node.toml").write_text(effective_template)
    (tmp_path / "node").mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ecd").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')  # says what it was asked to run
    (bin_dir / "ecd").chmod(0o755)
    for node_name in ("ip-10-0-0-6.ec2.internal", "gpu-node-" + "x" * 80, "node_7"):
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "NODE_NAME": node_name, "NODE_IP": "10.0.0.6",
               "PEER_IPS": "10.0.0.5 10.0.0.6"}
        script = init["command"][-1].replace("/etc/ecd-template", str(tmp_path / "template")) \
            .replace("/etc/ecd-node", str(tmp_path / "node"))
        rendered = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
        assert rendered.returncode == 0, rendered.stderr
        daemon_name = re.search(r'^name = "([^"]*)"', (tmp_path / "node" / "node.toml").read_text(), re.M).group(1)
        ran = subprocess.run(holder["command"], env=env, capture_output=True, text=True, timeout=30)
        assert ran.returncode == 0, ran.stderr
        args = holder_args(["ecd", *ran.stdout.split("\n")[:-1]])
        assert args["--node"] == daemon_name, (node_name, args, daemon_name)
        assert args["--runtime-dir"] == SOCKET_DIR and float(args["--hold"]) == 600


def holder_available() -> str | None:
    """None when this tree's ecd has `ecd hold` (issue 27's keeper), else why not."""
    out = subprocess.run([sys.executable, "-m", "ecd", "hold", "--help"], capture_output=True, text=True, timeout=60)
    return None if out.returncode == 0 else "`ecd hold` (issue 27's pool keeper) is not in this tree's ecd yet"


class HostNode:
    """The ConfigMap's node.toml and the holder DaemonSet's command, with only what must differ
    on a test machine (paths, a small pool, loopback and a free port), run as real processes."""

    def __init__(self, docs: list[dict], tag: int) -> None:
        self.runtime = Path(tempfile.mkdtemp(prefix="ecd-k8s-", dir="/tmp"))  # a socket path must be short
        self.node = f"k8s{tag % 100000}"
        self.endpoint = f"ipc://{self.runtime}/ecd.sock"
        text = node_toml(docs)
        replaced = {'name = "k8s"': f'name = "{self.node}"',
                    f'runtime_dir = "{SOCKET_DIR}"': f'runtime_dir = "{self.runtime}"',
                    f'endpoint = "ipc://{SOCKET_DIR}/ecd.sock"': f'endpoint = "{self.endpoint}"',
                    'size = "4GiB"': 'size = "64MiB"', 'segment_size = "1GiB"': 'segment_size = "64MiB"',
                    'size = "1GiB"': 'size = "16MiB"',  # the tenants' (after segment_size's)
                    'listen = "0.0.0.0:9464"': 'listen = "127.0.0.1:0"'}
        for old, new in replaced.items():
            assert old in text, f"the test expects {old!r} in deploy/k8s/node.toml"
            text = text.replace(old, new)
        self.config = self.runtime / "node.toml"
        self.config.write_text(text)
        args = holder_args(holder_command(docs))
        self.holder_argv = [sys.executable, "-m", "ecd", "hold", "--node", self.node,
                            "--runtime-dir", str(self.runtime), "--hold", args["--hold"]]
        self.procs: list[subprocess.Popen] = []
        self.runs = 0

    def start_holder(self) -> subprocess.Popen:
        with open(self.runtime / "holder.log", "ab") as out:
            proc = subprocess.Popen(self.holder_argv, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        deadline = time.monotonic() + 30
        while not Path(socket_path(str(self.runtime), self.node)).exists():
            assert proc.poll() is None and time.monotonic() < deadline, self.log("holder.log")
            time.sleep(0.02)
        return proc

    def start_daemon(self) -> tuple[subprocess.Popen, int]:
        """The daemon, serving: (its process, its metrics port)."""
        self.runs += 1
        log = self.runtime / f"daemon{self.runs}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "ecd", "serve", "--config", str(self.config)],
                                    stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        deadline, port = time.monotonic() + 60, None
        while port is None and time.monotonic() < deadline and proc.poll() is None:
            match = re.search(r"metrics on http://[^:]+:(\d+)/metrics", log.read_text(errors="replace"))
            port = int(match.group(1)) if match else None
            time.sleep(0.05)
        assert port, f"the daemon did not start: {self.log(log.name)}"
        return proc, port

    def log(self, name: str) -> str:
        path = self.runtime / name
        return path.read_text(errors="replace")[-4000:] if path.exists() else f"(no {name})"

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for name in Path("/dev/shm").glob(f"ecd.{self.node}.*"):
            name.unlink()
        shutil.rmtree(self.runtime, ignore_errors=True)


def healthz(port: int) -> tuple[int, bytes]:
    deadline, answer = time.monotonic() + 30, (0, b"")
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:  # 503 "starting" until it serves
            answer = (exc.code, exc.read())
            time.sleep(0.05)
    return answer


@needs_kubectl
def test_a_daemon_started_from_the_config_map_answers_the_probe_path(tmp_path):
    """The ConfigMap's node.toml starts the real daemon, whose /healthz answers 200 "ok" (beside
    the holder its [restart] section asks for, where this tree has one)."""
    node = HostNode(render("deploy/k8s"), id(tmp_path))
    try:
        if holder_available() is None:
            node.start_holder()
        _, port = node.start_daemon()
        assert healthz(port) == (200, b"ok\n")
    finally:
        node.close()


@needs_kubectl
def test_a_killed_daemon_adopts_the_pool_the_holder_kept(tmp_path):
    """The manifests' command lines for real: the holder DaemonSet's `ecd hold` and a daemon from
    the ConfigMap; the daemon is SIGKILLed (an OOM kill, a crash) and a new one adopts every entry,
    bit-identical; then the daemon's SIGTERM and the holder's (its pod deleted) leave nothing."""
    reason = holder_available()
    if reason:
        pytest.skip(reason)
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO))
    import ecd
    node = HostNode(render("deploy/k8s"), id(tmp_path))
    try:
        holder = node.start_holder()
        daemon, _ = node.start_daemon()
        sizes = [4096, 65536, 1 << 20, 3 * 4096 + 17]  # inline and pool puts
        want = {f"k8s-{i}": (torch.arange(sizes[i % 4], dtype=torch.int64) * 7 + i).to(torch.uint8)
                for i in range(40)}
        with ecd.Client(node.endpoint, timeout=10) as client:
            for key, value in want.items():
                client.put(key, value)
            assert client.stats()["restart"]["keeper"] == "holder", client.stats()["restart"]
        daemon.kill()
        daemon.wait(10)
        daemon, _ = node.start_daemon()
        with ecd.Client(node.endpoint, timeout=10) as client:
            restart = client.stats()["restart"]
            assert restart["adopted"] and restart["entries"] == len(want), (restart, node.log("daemon2.log"))
            for key, value in want.items():
                assert torch.equal(client.get(key), value), key
        daemon.terminate()
        assert daemon.wait(30) == 0
        # the holder's pod deleted: SIGTERM lets go at once, and nothing of the node stays
        holder.terminate()
        assert holder.wait(10) == 0, node.log("holder.log")
        assert not list(Path("/dev/shm").glob(f"ecd.{node.node}.*"))
        assert not Path(socket_path(str(node.runtime), node.node)).exists()
    finally:
        node.close()
