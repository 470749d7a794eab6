"""The deployment examples (`examples/deploy/`): the Kubernetes manifests are valid against the
Kubernetes API schemas (kubernetes-validate, strict), the docker-compose file wires two
memproxy replicas to one Redis, and memproxy itself accepts the config each of them gives it
(`memproxy check-config`, the real binary, with the environment the manifests set).
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "examples" / "deploy"
TARGET_DIR = Path(os.environ.get("CARGO_TARGET_DIR", REPO_ROOT / "target"))
if not TARGET_DIR.is_absolute():
    TARGET_DIR = REPO_ROOT / TARGET_DIR
MEMPROXY_BIN = TARGET_DIR / "debug" / "memproxy"
KUBERNETES_VERSION = "1.37.0"


def _manifests() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path, doc))
    return out


def _by_kind(kind: str) -> list[dict]:
    return [doc for _, doc in _manifests() if doc["kind"] == kind]


def _check_config(config: Path | None, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MEMPROXY_")}
    args = [str(MEMPROXY_BIN)]
    if config is not None:
        args += ["--config", str(config)]
    return subprocess.run(
        args + ["check-config"], env={**base, **env}, capture_output=True, text=True, timeout=60
    )


def _mib(size: str) -> int:
    number, unit = re.fullmatch(r"(\d+)\s*(MiB|Mi|GiB|Gi)", size).groups()
    return int(number) * (1024 if unit.startswith("G") else 1)


def test_every_manifest_is_valid_against_the_kubernetes_schemas() -> None:
    manifests = _manifests()
    assert {doc["kind"] for _, doc in manifests} >= {
        "Deployment",
        "StatefulSet",
        "Service",
        "Secret",
        "ConfigMap",
    }
    for path, doc in manifests:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_sidecar_config_is_accepted_by_memproxy(tmp_path: Path) -> None:
    (config_map,) = _by_kind("ConfigMap")
    config = tmp_path / "memproxy.toml"
    config.write_text(config_map["data"]["memproxy.toml"])
    (deployment,) = _by_kind("Deployment")
    sidecar = next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "memproxy"
    )
    # Every variable the config names is set by the sidecar's env, from the Secret.
    env = {e["name"]: "from-the-secret" for e in sidecar["env"] if "valueFrom" in e}
    parsed = tomllib.loads(config.read_text())
    for section, key in [
        ("upstream", "api_key_env"),
        ("storage", "redis_password_env"),
        ("admin", "token_env"),
    ]:
        assert parsed[section][key] in env, (section, key)
    (secret,) = _by_kind("Secret")
    for e in sidecar["env"]:
        if "valueFrom" in e:
            assert e["valueFrom"]["secretKeyRef"]["key"] in secret["stringData"], e
    checked = _check_config(config, {**env, "MEMPROXY_DATA_DIR": str(tmp_path / "data")})
    assert checked.returncode == 0, checked.stderr + checked.stdout
    assert "redis" in checked.stdout, checked.stdout

    # The pod's memory limit for the sidecar is the budget plus 64 MiB, as the README says.
    budget = _mib(parsed["server"]["memory_budget"])
    assert _mib(sidecar["resources"]["limits"]["memory"]) == budget + 64
    # The config is mounted where the args say.
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "memproxy-config")
    assert sidecar["args"] == ["--config", f"{mount['mountPath']}/memproxy.toml"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert sidecar[probe]["httpGet"]["path"] in ("/healthz", "/readyz")


def test_compose_runs_two_replicas_on_one_redis(tmp_path: Path) -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    replicas = {name: s for name, s in services.items() if name.startswith("memproxy")}
    assert len(replicas) == 2
    ports = set()
    for name, service in replicas.items():
        url = service["environment"]["MEMPROXY_REDIS_URL"]
        assert re.fullmatch(r"redis://:\$\{REDIS_PASSWORD:-[^}]+\}@redis:6379/0", url), url
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        ports.update(service["ports"])
        # memproxy accepts what compose hands it (the password as compose would fill it in).
        env = {k: str(v) for k, v in service["environment"].items()}
        env["MEMPROXY_REDIS_URL"] = url.replace("${REDIS_PASSWORD:-change-me}", "change-me")
        env["MEMPROXY_DATA_DIR"] = str(tmp_path / name)
        checked = _check_config(None, env)
        assert checked.returncode == 0, checked.stderr + checked.stdout
        assert "redis" in checked.stdout, checked.stdout
    assert len(ports) == 2
    redis = services["redis"]
    assert "--appendonly" in redis["command"]
    assert "healthcheck" in redis
