"""deploy/ against the code: every file parses, every config key is the code's, every
command line parses with the real parsers, and the example configs start real processes.

Also hixl-master's config layering (defaults < YAML < HIXL_MASTER_* < flags), which the
deploy files rely on. Deadlines only prove "does not hang".
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from hixl.client.agent_client import AgentClient
from hixl.errors import ConfigError
from hixl.processes import DaemonProcess, ProcessNotReady
from hixl.registry_client import RegistryClient
from hixl.server.agent.config import AgentConfig
from hixl.server.config import convert_key, keys_from_parser
from hixl.server.main import build_agent_parser
from hixl.server.master import master as master_module
from hixl.server.master.master import MasterConfig, build_parser, parse_config
from hixl.tools import cli

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"
START_DEADLINE_S = 30.0
TOKEN = "deploy-test-token-0123456789abcdef"

#: where each deployment puts the example configs, and the example it installs there
INSTALLED_CONFIGS = {"/etc/hixl/agent.yaml": DEPLOY / "agent.yaml",
                     "/etc/hixl/master.yaml": DEPLOY / "master.yaml"}
#: values Kubernetes fills in from the downward API, for parsing the env of a pod spec
FIELD_REFS = {"status.hostIP": "10.0.0.11", "status.podIP": "10.1.0.11",
              "spec.nodeName": "node-1"}


def load_docs(path: Path) -> list[Any]:
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def console_scripts() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


# ---------------------------------------------------------------- every file parses

YAML_FILES = sorted(DEPLOY.rglob("*.yaml"))
UNITS = sorted(SYSTEMD.glob("*.service"))


def test_deploy_has_every_piece() -> None:
    names = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*") if p.is_file()}
    assert {"agent.yaml", "master.yaml", "compose.yaml", "README.md", "Dockerfile",
            "systemd/hixl-agent.service", "systemd/hixl-master.service", "systemd/hixl.env",
            "k8s/kustomization.yaml", "k8s/namespace.yaml", "k8s/configmap.yaml",
            "k8s/secret.yaml", "k8s/master.yaml", "k8s/agent-daemonset.yaml"} <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = load_docs(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit: section -> key -> values (keys may repeat; `\\` continues a line)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert current is not None and sep and key.strip(), f"{path.name}:{number}: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def parse_env_file(path: Path) -> dict[str, str]:
    """KEY=value lines of an EnvironmentFile (comments and blank lines skipped)."""
    env: dict[str, str] = {}
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), raw
            env[key] = value.strip().strip('"')
    return env


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_every_unit_parses(path: Path) -> None:
    unit = parse_unit(path)
    assert {"Unit", "Service", "Install"} <= set(unit)
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


# ---------------------------------------------------------------- checking a command line

def config_source(path: str, mounted: Mapping[str, Path]) -> Path:
    """The file of this repository that a deployment installs at `path`."""
    source = mounted.get(path)
    assert source is not None and source.is_file(), f"{path} is not provided by this deployment"
    return source


def check_command(argv: list[str], env: Mapping[str, str],
                  mounted: Mapping[str, Path] = INSTALLED_CONFIGS) -> Any:
    """Parse a deployment's command line with the real parser of the console script it
    runs, and load the resulting configuration with the real loader (its --config file
    replaced by the repository file installed there, `env` as its environment)."""
    scripts = console_scripts()
    binary = os.path.basename(argv[0])
    assert binary in scripts, f"{argv[0]} is not a console script of pyproject.toml"
    args = list(argv[1:])
    if "--config" in args:
        at = args.index("--config") + 1
        args[at] = str(config_source(args[at], mounted))
    if binary == "hixl-agent":
        parsed = build_agent_parser().parse_args(args)
        flags = {k: v for k, v in vars(parsed).items() if k in AgentConfig.KEYS}
        return AgentConfig.load(parsed.config, flags, env)
    if binary == "hixl-master":
        return parse_config(args, env)
    assert binary == "hixl", binary
    return cli.build_parser().parse_args(args)


def expand(text: str, env: Mapping[str, str]) -> str:
    """$VAR and ${VAR} replaced from `env` (as the shell in a probe's `sh -c` would)."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], text)


def shell_command(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """The command a `sh -c "exec hixl ..."` wrapper runs, or `argv` itself."""
    if argv[:2] == ["sh", "-c"]:
        words = shlex.split(argv[2])
        words = words[1:] if words[0] == "exec" else words
        return [expand(word, env) for word in words]
    return argv


def test_check_command_rejects_what_the_real_parsers_reject(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpc_port: many\n")
    with pytest.raises(SystemExit):
        check_command(["hixl-agent", "--no-such-flag"], {})
    with pytest.raises(SystemExit):
        check_command(["hixl-master", "--client_ttl", "0"], {})
    with pytest.raises(ConfigError, match="grpc_port"):
        check_command(["hixl-agent", "--config", "/x.yaml"], {}, {"/x.yaml": bad})
    with pytest.raises(ConfigError, match="HIXL_MASTER_PORTT"):
        check_command(["hixl-master"], {"HIXL_MASTER_PORTT": "1"})
    with pytest.raises(AssertionError, match="not a console script"):
        check_command(["/usr/bin/hixl-agentd"], {})


# ---------------------------------------------------------------- the example configs

HEADER = re.compile(r"^## (?P<key>\w+) \((?P<type>.+?), default (?P<default>.+), "
                    r"env (?P<env>\w+)\)$")
DISABLED = re.compile(r"^#(?P<key>\w+): ")


def agent_schema() -> tuple[Mapping[str, Any], dict[str, dict[str, str]], dict[str, Any]]:
    return AgentConfig.KEYS, AgentConfig.describe(), vars(AgentConfig())


def master_schema() -> tuple[Mapping[str, Any], dict[str, dict[str, str]], dict[str, Any]]:
    return MasterConfig.keys(), MasterConfig.describe(), MasterConfig().values()


EXAMPLES = {"agent.yaml": agent_schema, "master.yaml": master_schema}


def example_blocks(path: Path) -> dict[str, dict[str, Any]]:
    """key -> {header match, explanation lines, active value line or disabled line}."""
    blocks: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        header = HEADER.match(line)
        if header:
            key = header["key"]
            assert key not in blocks, f"{path.name}: key {key} documented twice"
            current = blocks[key] = {"header": header, "doc": [], "active": [], "disabled": []}
        elif current is None:
            continue
        elif DISABLED.match(line):
            current["disabled"].append(DISABLED.match(line)["key"])  # type: ignore[index]
        elif line.startswith("#"):
            if not line.startswith("# ----"):
                current["doc"].append(line)
        elif line and not line.startswith(" "):
            current["active"].append(line.split(":", 1)[0])
    return blocks


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_documents_exactly_the_schema(name: str) -> None:
    keys, described, defaults = EXAMPLES[name]()
    blocks = example_blocks(DEPLOY / name)
    assert set(blocks) == set(described), (
        f"deploy/{name}: undocumented keys {sorted(set(described) - set(blocks))}, "
        f"unknown keys {sorted(set(blocks) - set(described))}")
    active = yaml.safe_load((DEPLOY / name).read_text())
    assert set(active) <= set(described)
    for key, block in blocks.items():
        header, entry = block["header"], described[key]
        where = f"deploy/{name} key {key}"
        assert header["type"] == entry["type"], where
        assert header["env"] == entry["env"], where
        assert block["doc"], f"{where}: no explanation"
        # the key itself follows its own header: set, or shown disabled ("#key: value")
        assert block["active"] + block["disabled"] == [key], where
        assert (key in active) == (block["active"] == [key]), where
        shown = header["default"]
        if not shown.startswith("computed"):  # a default the code computes per host
            value = convert_key(keys, key, yaml.safe_load(shown), False, where)
            assert value == defaults[key], f"{where}: shows default {shown}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_loads_with_the_real_loader(name: str, tmp_path: Path) -> None:
    path = DEPLOY / name
    loader = AgentConfig if name == "agent.yaml" else MasterConfig
    config = loader.load(str(path), {}, {})
    written = yaml.safe_load(path.read_text())
    keys = AgentConfig.KEYS if loader is AgentConfig else MasterConfig.keys()
    values = vars(config) if loader is AgentConfig else config.values()  # type: ignore[union-attr]
    for key, raw in written.items():
        assert values[key] == convert_key(keys, key, raw, False, name), key
    # the disabled examples ("#node_id: ...") are valid values too
    enabled = re.sub(r"(?m)^#(\w+): ", r"\1: ", path.read_text())
    (tmp_path / name).write_text(enabled)
    loader.load(str(tmp_path / name), {}, {})


def test_example_values_that_matter_for_the_deployments() -> None:
    agent = AgentConfig.load(str(DEPLOY / "agent.yaml"), {}, {})
    assert agent.runtime_dir == "/run/hixl" and agent.master == ""
    assert agent.cluster_token_file == ""  # deployments name the file in the environment
    master = MasterConfig.load(str(DEPLOY / "master.yaml"), {}, {})
    assert master.host == "0.0.0.0" and master.store.persist
    assert master.store.data_dir == "/var/lib/hixl/master"


# ---------------------------------------------------------------- systemd

def unit(name: str) -> dict[str, list[str]]:
    return parse_unit(SYSTEMD / name)["Service"]


def one(service: dict[str, list[str]], key: str) -> str:
    values = service.get(key, [])
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


@pytest.mark.parametrize("name", [p.name for p in UNITS])
def test_unit_command_and_hardening(name: str) -> None:
    service = unit(name)
    env_file = one(service, "EnvironmentFile").lstrip("-")
    env = parse_env_file(SYSTEMD / os.path.basename(env_file))
    assert env["HIXL_CLUSTER_TOKEN_FILE"].startswith("/etc/hixl/")
    config = check_command(shlex.split(one(service, "ExecStart")), env)
    assert one(service, "Restart") == "on-failure"
    assert one(service, "RestartSec")
    assert one(service, "RestartPreventExitStatus") == "2"  # a config error is not retried
    assert one(service, "User") == one(service, "Group") == "hixl"
    assert one(service, "NoNewPrivileges") == "yes"
    assert one(service, "ProtectSystem") == "strict"
    assert one(service, "ProtectHome") in ("yes", "read-only", "tmpfs")
    if isinstance(config, AgentConfig):
        # the sockets clients must reach: systemd's runtime dir, never hidden from them
        assert config.runtime_dir == "/run/" + one(service, "RuntimeDirectory")
        # the owner secret outlives restarts, in a directory of the agent's own
        assert config.state_dir == "/var/lib/" + one(service, "StateDirectory")
        assert one(service, "StateDirectoryMode") == "0700"
        assert service.get("PrivateDevices", ["no"]) == ["no"]
        assert one(service, "LimitMEMLOCK") == "infinity"
        if one(service, "PrivateTmp") == "yes":
            assert not config.runtime_dir.startswith(("/tmp/", "/var/tmp/"))
        assert config.host == env["HIXL_AGENT_HOST"] and config.master == env[
            "HIXL_AGENT_MASTER"]
    else:
        assert isinstance(config, MasterConfig)
        assert config.store.data_dir == "/var/lib/" + one(service, "StateDirectory")


def test_units_verify_with_systemd_analyze(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    bindir = os.path.dirname(sys.executable)
    for path in UNITS:  # the console scripts of this venv stand in for /opt/hixl/venv
        text = path.read_text().replace("/opt/hixl/venv/bin", bindir)
        (tmp_path / path.name).write_text(text)
    result = subprocess.run([tool, "verify", *(str(tmp_path / p.name) for p in UNITS)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "hixl" not in result.stderr, result.stderr  # no warning about our units


# ---------------------------------------------------------------- compose

def compose() -> dict[str, Any]:
    [doc] = load_docs(DEPLOY / "compose.yaml")
    return doc


def compose_mounts(service: dict[str, Any], doc: dict[str, Any]) -> dict[str, Path]:
    return {c["target"]: DEPLOY / doc["configs"][c["source"]]["file"]
            for c in service.get("configs", [])}


def test_compose_files_and_names_exist() -> None:
    doc = compose()
    build = doc["x-hixl"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    for config in doc["configs"].values():
        assert (DEPLOY / config["file"]).is_file(), config
    ignored = (DEPLOY / ".gitignore").read_text().split()
    for secret in doc["secrets"].values():  # created by the operator, never committed
        assert "/" + os.path.basename(secret["file"]) in ignored, secret
    for name, service in doc["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in doc["volumes"] or (DEPLOY / source).exists(), (name, volume)
        for secret in service.get("secrets", []):
            assert secret in doc["secrets"]
        for config in service.get("configs", []):
            assert config["source"] in doc["configs"]
        for dependency in service.get("depends_on", {}):
            assert dependency in doc["services"]


def test_image_copies_what_exists_and_what_its_ignore_file_admits() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    admitted = {line[1:].rstrip("/") for line in
                (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
                if line.startswith("!")}
    copied = [word.rstrip("/") for line in dockerfile.splitlines()
              if line.startswith("COPY ") for word in line.split()[1:-1]]
    assert copied and set(copied) == admitted
    for source in copied:
        assert (ROOT / source).exists(), source
    scripts = console_scripts()
    for line in dockerfile.splitlines():
        if line.startswith("CMD "):
            assert json.loads(line[4:])[0] in scripts


def test_compose_is_one_master_and_two_agents() -> None:
    doc = compose()
    master_yaml = MasterConfig.load(str(DEPLOY / "master.yaml"), {}, {})
    roles: dict[str, list[tuple[str, Any]]] = {"hixl-master": [], "hixl-agent": [], "hixl": []}
    for name, service in doc["services"].items():
        env = service.get("environment", {})
        mounts = compose_mounts(service, doc)
        config = check_command(service["command"], env, mounts)
        roles[os.path.basename(service["command"][0])].append((name, config))
        token = env["HIXL_CLUSTER_TOKEN_FILE"]
        assert token == f"/run/secrets/{service['secrets'][0]}"
        health = service.get("healthcheck", {}).get("test")
        if health:
            assert health[0] == "CMD"
            check_command(health[1:], env, mounts)
    [(master_name, master)] = roles["hixl-master"]
    assert master.values() == master_yaml.values()
    assert [v for v in doc["services"][master_name]["volumes"]
            if v.endswith(":" + master.store.data_dir)]
    agents = roles["hixl-agent"]
    assert len(agents) == 2
    assert len({a.host for _, a in agents}) == len({a.node_id for _, a in agents}) == 2
    for name, agent in agents:
        service = doc["services"][name]
        assert agent.master == f"{master_name}:{master.port}"
        [address] = [net["ipv4_address"] for net in service["networks"].values()]
        assert agent.host == address
        runtime = [v for v in service["volumes"] if v.endswith(":" + agent.runtime_dir)]
        assert len(runtime) == 1, name
        state = [v for v in service["volumes"] if v.endswith(":" + agent.state_dir)]
        assert len(state) == 1, name  # a read-only container: its state dir is a volume
        assert service["ulimits"]["memlock"] == -1
    # the client shares node a's runtime volume: its unix sockets
    [(client_name, _)] = roles["hixl"]
    agent_a = doc["services"][agents[0][0]]
    assert set(doc["services"][client_name]["volumes"]) & set(agent_a["volumes"])


# ---------------------------------------------------------------- kubernetes

def k8s_objects() -> list[dict[str, Any]]:
    kustomization = load_docs(K8S / "kustomization.yaml")[0]
    objects = []
    for resource in kustomization["resources"]:
        objects += load_docs(K8S / resource)
    return objects


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def test_k8s_resources_are_listed_and_well_formed() -> None:
    kustomization = load_docs(K8S / "kustomization.yaml")[0]
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    namespace = find(k8s_objects(), "Namespace")["metadata"]["name"]
    assert kustomization["namespace"] == namespace
    for obj in k8s_objects():
        assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"], obj
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]


def test_k8s_configmap_embeds_the_example_configs(tmp_path: Path) -> None:
    data = find(k8s_objects(), "ConfigMap", "hixl-config")["data"]
    assert set(data) == set(EXAMPLES)
    for name in EXAMPLES:
        assert yaml.safe_load(data[name]) == yaml.safe_load((DEPLOY / name).read_text()), name
        (tmp_path / name).write_text(data[name])
    assert AgentConfig.load(str(tmp_path / "agent.yaml"), {}, {}) == AgentConfig.load(
        str(DEPLOY / "agent.yaml"), {}, {})
    assert MasterConfig.load(str(tmp_path / "master.yaml"), {}, {}) == MasterConfig.load(
        str(DEPLOY / "master.yaml"), {}, {})


def pod_env(container: dict[str, Any]) -> dict[str, str]:
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = FIELD_REFS[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def check_pod(spec: dict[str, Any], objects: list[dict[str, Any]],
              tmp_path: Path) -> list[tuple[dict[str, Any], Any]]:
    """Volumes, mounts, probes and commands of a pod template; (container, config) each."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    secret = find(objects, "Secret", "hixl-cluster-token")
    configmap = find(objects, "ConfigMap", "hixl-config")
    for volume in volumes.values():
        if "configMap" in volume:
            assert volume["configMap"]["name"] == configmap["metadata"]["name"]
            assert {i["key"] for i in volume["configMap"]["items"]} <= set(configmap["data"])
        if "secret" in volume:
            assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        if "persistentVolumeClaim" in volume:
            find(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    results = []
    for container in spec.get("initContainers", []) + spec["containers"]:
        mounted: dict[str, Path] = {}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                source = tmp_path / mount["subPath"]
                source.write_text(configmap["data"][mount["subPath"]])
                mounted[mount["mountPath"]] = source
            if "secret" in volume:  # the token as a file, named by the environment
                assert pod_env(container)["HIXL_CLUSTER_TOKEN_FILE"] == (
                    mount["mountPath"] + "/" + next(iter(secret["stringData"])))
        if container in spec.get("initContainers", []):
            continue
        env = pod_env(container)
        config = check_command(container["command"], env, mounted)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("readinessProbe", "livenessProbe"):
            action = container[probe]
            if "exec" in action:
                check_command(shell_command(action["exec"]["command"], env), env, mounted)
            else:
                port = action["tcpSocket"]["port"]
                assert ports.get(port, port) in ports.values(), probe
        assert container["resources"]["requests"]["memory"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        results.append((container, config))
    return results


def test_k8s_master_deployment_and_service(tmp_path: Path) -> None:
    objects = k8s_objects()
    deployment = find(objects, "Deployment", "hixl-master")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # one owner of data_dir
    spec = deployment["spec"]["template"]["spec"]
    [(container, config)] = check_pod(spec, objects, tmp_path)
    assert isinstance(config, MasterConfig)
    data = [m for m in container["volumeMounts"] if m["mountPath"] == config.store.data_dir]
    assert len(data) == 1
    service = find(objects, "Service", "hixl-master")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # clients dial the Service's name at the master's port and at its advertised fast_port
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {config.port, config.fast_port}
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for number, port in ports.items():
        assert named[port["targetPort"]] == number


def test_k8s_agent_daemonset(tmp_path: Path) -> None:
    objects = k8s_objects()
    daemonset = find(objects, "DaemonSet", "hixl-agent")
    spec = daemonset["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    [(container, config)] = check_pod(spec, objects, tmp_path)
    assert isinstance(config, AgentConfig)
    assert config.host == FIELD_REFS["status.hostIP"]
    assert config.node_id == FIELD_REFS["spec.nodeName"]
    service = find(objects, "Service", "hixl-master")
    namespace = service["metadata"]["namespace"]
    assert config.master == (f"{service['metadata']['name']}.{namespace}.svc.cluster.local:"
                             f"{service['spec']['ports'][0]['port']}")
    # the unix sockets, on the node, where other pods (vLLM) mount them too
    [runtime] = [m for m in container["volumeMounts"] if m["mountPath"] == config.runtime_dir]
    volume = {v["name"]: v for v in spec["volumes"]}[runtime["name"]]
    assert volume["hostPath"]["path"] == config.runtime_dir
    # the owner secret, on the node, so a restarted pod takes its engine name back
    [state] = [m for m in container["volumeMounts"] if m["mountPath"] == config.state_dir]
    volume = {v["name"]: v for v in spec["volumes"]}[state["name"]]
    assert volume["hostPath"]["path"] == config.state_dir
    assert {p["containerPort"] for p in container["ports"]} == {
        config.grpc_port, config.data_port, config.metrics_port}
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= daemonset["spec"][
        "template"]["metadata"]["labels"].items()


def test_k8s_kustomize_builds() -> None:
    tool = shutil.which("kubectl")
    if tool is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run([tool, "kustomize", str(K8S)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(result.stdout))
    assert kinds == sorted(o["kind"] for o in k8s_objects())


# ---------------------------------------------------------------- the examples start

class Process(DaemonProcess):
    """A hixl daemon started from a deploy file; waits for its ready line (`line`: what
    follows the prefix), and stop() is SIGTERM, then a kill after START_DEADLINE_S."""

    def __init__(self, argv: list[str], env: Mapping[str, str], ready: str,
                 workdir: Path) -> None:
        super().__init__(argv, name=argv[2], ready=ready, env=env, grace_s=START_DEADLINE_S,
                         log_path=str(workdir / f"{argv[2]}-{len(os.listdir(workdir))}.log"))
        try:
            self.line = self.wait_ready(START_DEADLINE_S)[len(ready):].strip()
        except ProcessNotReady as exc:
            pytest.fail(str(exc))


@pytest.fixture
def deploy_env() -> Iterator[tuple[dict[str, str], Path]]:
    """The environment a deployment gives both daemons: only the token file, no stray
    HIXL_* settings from the machine running the tests. And a short private workdir."""
    workdir = Path(tempfile.mkdtemp(prefix="hxd-"))  # short: unix socket paths <= 107 bytes
    token = workdir / "cluster-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIXL_")}
    env["HIXL_CLUSTER_TOKEN_FILE"] = str(token)
    yield env, workdir
    shutil.rmtree(workdir, ignore_errors=True)


def test_example_master_and_agent_start_and_form_a_cluster(
        deploy_env: tuple[dict[str, str], Path]) -> None:
    env, workdir = deploy_env
    # the deploy files as they are; only what would clash on a test machine is overridden
    master = Process([sys.executable, "-m", "hixl.server.master.master",
                      "--config", str(DEPLOY / "master.yaml"), "--host", "127.0.0.1",
                      "--port", "0", "--metrics-port", "0", "--fast-port", "0",
                      "--data-dir", str(workdir / "master")],
                     env, "hixl-master serving ", workdir)
    agent = None
    try:
        agent_env = {**env, "HIXL_AGENT_MASTER": master.line, "HIXL_AGENT_NODE_ID": "node-t"}
        agent = Process([sys.executable, "-m", "hixl.server.main",
                         "--config", str(DEPLOY / "agent.yaml"), "--grpc-port", "0",
                         "--data-port", "0", "--metrics-port", "0",
                         "--runtime-dir", str(workdir / "run"),
                         "--pool-size", "1MiB"],
                        agent_env, "hixl-agent serving ", workdir)
        engine = dict(f.split("=", 1) for f in agent.line.split())["engine"]
        with AgentClient(engine, timeout=10.0, cluster_token=TOKEN) as client:
            info = client.handshake("test-deploy")
        assert [(s.name, s.length) for s in info.segments] == [("pool", 1 << 20)]
        assert info.node_id == "node-t"
        assert os.path.exists(info.fd_socket) and info.fd_socket.startswith(str(workdir))
        # the agent published its pool to the master, proving the token
        deadline = time.monotonic() + START_DEADLINE_S
        with RegistryClient(master.line, timeout=10.0, cluster_token=TOKEN) as registry:
            while not registry.query(engine) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert registry.query(engine) == info.segments
        # the probes and health checks: `hixl status` on the agent (and its master), and
        # on the master alone, with the token from the environment as in the pods
        for target in (["--agent", engine], ["--master", master.line]):
            status = subprocess.run([sys.executable, "-m", "hixl.tools.cli", "status",
                                     *target, "--timeout", "5"], env=env, capture_output=True,
                                    text=True, timeout=START_DEADLINE_S)
            assert status.returncode == 0, status.stdout + status.stderr
        assert agent.stop() == 0
        assert master.stop() == 0
    finally:
        if agent is not None:
            agent.kill()
        master.kill()


def test_example_agent_without_its_token_file_does_not_start(
        deploy_env: tuple[dict[str, str], Path]) -> None:
    env, workdir = deploy_env
    env["HIXL_CLUSTER_TOKEN_FILE"] = str(workdir / "missing-token")
    for argv in ([sys.executable, "-m", "hixl.server.main", "--config",
                  str(DEPLOY / "agent.yaml"), "--runtime-dir", str(workdir / "run")],
                 [sys.executable, "-m", "hixl.server.master.master", "--config",
                  str(DEPLOY / "master.yaml"), "--host", "127.0.0.1", "--port", "0"]):
        result = subprocess.run(argv, env=env, capture_output=True, text=True,
                                timeout=START_DEADLINE_S)
        assert result.returncode == 2, result.stderr
        assert "missing-token" in result.stderr


# ---------------------------------------------------------------- hixl-master's layering

def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "master.yaml"
    path.write_text(text)
    return str(path)


def test_master_defaults_without_any_source() -> None:
    assert MasterConfig.load(None, {}, {}) == MasterConfig() == parse_config([], {})


def test_master_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, "port: 6000\nclient_ttl_s: 20\neviction_ratio: 0.2\n"
                           "log_level: debug\npersist: false\nhost: 10.0.0.1\n"
                           "max_lease_ttl_ms: 9000\n")
    env = {"HIXL_MASTER_PORT": "7000", "HIXL_MASTER_CLIENT_TTL_S": "30",
           "HIXL_MASTER_MAX_LEASE_TTL_MS": "8000", "HIXL_MASTER_ALLOCATION_STRATEGY":
           "free_ratio_first", "HIXL_AGENT_PORT": "ignored", "UNRELATED": "x"}
    config = parse_config(["--config", path, "-rpc_port=8000", "--max-lease-ttl-ms", "60000"],
                          env)
    assert config.port == 8000                       # flag (mooncake spelling) beats env
    assert config.max_lease_ttl_ms == 60000          # a flag given at its default still wins
    assert config.store.client_ttl_s == 30           # env beats file
    assert config.store.allocation_strategy == "free_ratio_first"
    assert config.store.eviction_ratio == 0.2        # file beats default
    assert (config.log_level, config.host, config.store.persist) == ("DEBUG", "10.0.0.1", False)
    assert config.store.default_kv_lease_ttl_ms == 5000  # nothing set it
    # every flag, in both spellings, still overrides the file
    config = parse_config(["--config", path, "--no-persist", "-client_ttl=40",
                           "--eviction_ratio", "0.3", "--rpc_address", "127.0.0.2"], {})
    assert (config.store.client_ttl_s, config.store.eviction_ratio, config.host,
            config.port) == (40, 0.3, "127.0.0.2", 6000)


def test_master_env_forms(tmp_path: Path) -> None:
    env = {"HIXL_MASTER_PERSIST": "no", "HIXL_MASTER_EVICTION_HIGH_WATERMARK_RATIO": "0.5",
           "HIXL_MASTER_LOG_JSON": "yes", "HIXL_MASTER_DATA_DIR": "/srv/hixl"}
    config = MasterConfig.load(None, {}, env)
    assert config.store.persist is False and config.log_json is True
    assert config.store.eviction_high_watermark_ratio == 0.5
    assert config.store.data_dir == "/srv/hixl"
    # YAML ints are fine for float keys, and a ratio's bounds are the flag's
    assert MasterConfig.load(write(tmp_path, "eviction_ratio: 1\n"), {}, {}).store.eviction_ratio == 1.0


BAD_MASTER_FILE_VALUES = [
    ("bogus_key: 1", "bogus_key"),
    ("port: '6000'", "port"),
    ("port: 70000", "port"),
    ("port: true", "port"),
    ("port: 1.5", "port"),
    ("port: [1]", "port"),
    ("host: 5", "host"),
    ("client_ttl_s: 0", "client_ttl_s"),
    ("client_ttl_s: 2.5", "client_ttl_s"),
    ("eviction_ratio: 1.5", "eviction_ratio"),
    ("eviction_ratio: high", "eviction_ratio"),
    ("eviction_ratio: .nan", "eviction_ratio"),
    ("persist: 1", "persist"),
    ("persist: maybe", "persist"),
    ("allocation_strategy: fastest", "allocation_strategy"),
    ("log_level: chatty", "log_level"),
    ("max_lease_ttl_ms: 0", "max_lease_ttl_ms"),
    ("config: other.yaml", "config"),              # command-only flags are not keys
    ("describe_config: true", "describe_config"),
]


@pytest.mark.parametrize(("text", "key"), BAD_MASTER_FILE_VALUES)
def test_master_bad_file_value_names_key_and_file(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        MasterConfig.load(path, {}, {})
    message = str(info.value)
    assert f"'{key}'" in message and f"config file {path}" in message


@pytest.mark.parametrize(("var", "value", "key"), [
    ("HIXL_MASTER_PORT", "abc", "port"),
    ("HIXL_MASTER_PORT", "-1", "port"),
    ("HIXL_MASTER_PERSIST", "nah", "persist"),
    ("HIXL_MASTER_EVICTION_RATIO", "2", "eviction_ratio"),
    ("HIXL_MASTER_NOPE", "1", "nope"),
])
def test_master_bad_env_value_names_key_and_variable(var: str, value: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        MasterConfig.load(None, {}, {var: value})
    assert f"'{key}'" in str(info.value) and f"environment variable {var}" in str(info.value)


def test_master_unusable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        MasterConfig.load(write(tmp_path, "- port: 1\n"), {}, {})
    with pytest.raises(ConfigError, match="cannot read"):
        MasterConfig.load(str(tmp_path / "absent.yaml"), {}, {})
    with pytest.raises(ConfigError, match="not valid YAML"):
        MasterConfig.load(write(tmp_path, "port: [\n"), {}, {})
    assert MasterConfig.load(write(tmp_path, ""), {}, {}) == MasterConfig()


def test_master_schema_is_every_flag() -> None:
    parser = build_parser()
    dests = {a.dest for a in parser._actions if a.option_strings} - set(
        master_module.COMMAND_ONLY_DESTS)
    described = MasterConfig.describe()
    assert set(described) == dests == set(MasterConfig().values())
    for key, entry in described.items():
        assert entry["doc"] and "%(" not in entry["doc"], key
        assert entry["env"] == "HIXL_MASTER_" + key.upper()
        # "size": bytes or a unit ("256MiB"), as the agent's sizes
        assert entry["type"] in ("int", "float", "str", "bool", "size"), (key, entry["type"])
    assert "--no-persist" in described["persist"]["doc"]


def test_a_flag_added_later_is_a_key_and_a_flag_without_a_field_is_refused() -> None:
    field_types = {key: entry["type"] for key, entry in MasterConfig.describe().items()}
    parser = build_parser()
    parser.add_argument("--new-knob", dest="new_knob", type=int, default=3,
                        help="a knob (default %(default)s)")
    with pytest.raises(AssertionError, match="--new-knob"):
        keys_from_parser(parser, field_types, master_module.COMMAND_ONLY_DESTS)
    keys = keys_from_parser(parser, {**field_types, "new_knob": "int"},
                            master_module.COMMAND_ONLY_DESTS)
    assert keys["new_knob"]["doc"] == "a knob (default 3)"
    assert convert_key(keys, "new_knob", "7", True, "env") == 7
    with pytest.raises(ConfigError, match="'new_knob'"):
        convert_key(keys, "new_knob", "7", False, "file")   # YAML text for an int key


def test_master_describe_config_and_bad_file_as_a_process(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIXL_")}
    result = subprocess.run([sys.executable, "-m", "hixl.server.master.master", "--describe-config"],
                            capture_output=True, text=True, timeout=START_DEADLINE_S, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == MasterConfig.describe()
    path = write(tmp_path, "client_ttl_s: soon\n")
    result = subprocess.run([sys.executable, "-m", "hixl.server.master.master", "--config", path,
                             "--port", "0"], capture_output=True, text=True,
                            timeout=START_DEADLINE_S, env=env)
    assert result.returncode == 2
    assert "'client_ttl_s'" in result.stderr and path in result.stderr
    assert "hixl-master serving" not in result.stdout
    result = subprocess.run([sys.executable, "-m", "hixl.server.master.master", "--port", "0"],
                            capture_output=True, text=True, timeout=START_DEADLINE_S,
                            env={**env, "HIXL_MASTER_CLIENT_TTL_S": "0"})
    assert result.returncode == 2 and "HIXL_MASTER_CLIENT_TTL_S" in result.stderr
