"""The Kubernetes examples (examples/k8s) are valid objects, their pods run the job docs/kubernetes.md
describes, and that job, configured by PET_* variables alone, survives what Kubernetes does to it:
a killed rank, a deleted pod (SIGTERM), a lost pod (replaced by the hot spare).

Validity is checked by libraries made for it, not by hand: every document is deserialized by
generated API models and must come back unchanged (an unknown or misplaced field is dropped by
the models and so shows up as a difference; a missing required field or a wrong type fails):
- core objects, and the pod and job templates embedded in the CRDs: the `kubernetes` client's
  models (V1PodTemplateSpec, V1JobTemplateSpec, V1PersistentVolumeClaim);
- PyTorchJob: the training operator's SDK (`kubeflow-training`), whose models embed the same
  V1PodTemplateSpec;
- JobSet: the Kubeflow Trainer API models (`kubeflow-trainer-api`, pydantic), which include
  JobSet v1alpha2 and their own core models.
Enumerations (restartPolicy values) are not checked by these models.
"""
import copy
import json
import os
import signal

import kubernetes.client
import pytest
import yaml
from kubeflow.training import ApiClient as TrainingApiClient
from kubeflow_trainer_api.models import JobsetV1alpha2JobSet

from conftest import ROOT, read_events, wait_for
from ft_launcher.cli import launch_config
from harness import (DELAY, HANG_TIMEOUTS, HOLD, HOLD_STEP, STEPS, Job, check_one_restart, fault_rank,
                     first_agent_line, progress)

K8S = os.path.join(ROOT, "examples", "k8s")


def load(name):
    with open(os.path.join(K8S, name)) as fh:
        return yaml.safe_load(fh)


class _Response:  # what ApiClient.deserialize reads: the body of an API server's answer
    def __init__(self, obj):
        self.data = json.dumps(obj)


def via_models(client, obj, type_name):
    """`obj` through the client's models and back to a plain dict."""
    return client.sanitize_for_serialization(client.deserialize(_Response(obj), type_name))


def core(obj, type_name):
    return via_models(kubernetes.client.ApiClient(), obj, type_name)


def pytorchjob(obj):
    return via_models(TrainingApiClient(), obj, "KubeflowOrgV1PyTorchJob")


def jobset(obj):
    return JobsetV1alpha2JobSet.from_dict(obj).to_dict()


def pod_spec(doc):
    if doc["kind"] == "PyTorchJob":
        return doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


# ---- validity ----------------------------------------------------------------------------------
def test_shared_volume_claim_is_a_valid_core_object():
    pvc = load("shared-pvc.yaml")
    assert (pvc["apiVersion"], pvc["kind"]) == ("v1", "PersistentVolumeClaim")
    assert core(pvc, "V1PersistentVolumeClaim") == pvc
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod, on any node, mounts it


def check_pytorchjob(doc):
    assert (doc["apiVersion"], doc["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert pytorchjob(doc) == doc
    template = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    assert core(template, "V1PodTemplateSpec") == template


def check_jobset(doc):
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert jobset(doc) == doc
    template = doc["spec"]["replicatedJobs"][0]["template"]
    assert core(template, "V1JobTemplateSpec") == template


def test_pytorchjob_is_valid_for_the_training_operator_and_its_pod_template_for_kubernetes():
    check_pytorchjob(load("pytorchjob.yaml"))


def test_jobset_is_valid_for_jobset_and_its_job_template_for_kubernetes():
    check_jobset(load("jobset.yaml"))


def _mutated(doc, change):
    bad = copy.deepcopy(doc)
    change(bad)
    return bad


def _misspelt(d):
    pod_spec(d)["containers"][0]["volumeMount"] = pod_spec(d)["containers"][0].pop("volumeMounts")


def _nameless(d):
    del pod_spec(d)["containers"][0]["name"]


def _wordy_replicas(d):
    if d["kind"] == "PyTorchJob":
        d["spec"]["elasticPolicy"]["minReplicas"] = "two"
    else:
        d["spec"]["replicatedJobs"][0]["replicas"] = "one"


@pytest.mark.parametrize("change", [_misspelt, _nameless, _wordy_replicas], ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("name,check", [("pytorchjob.yaml", check_pytorchjob), ("jobset.yaml", check_jobset)],
                         ids=["pytorchjob", "jobset"])
def test_the_validation_catches_a_misspelt_field_a_missing_one_and_a_wrong_type(name, check, change):
    with pytest.raises((AssertionError, ValueError)):  # pydantic's ValidationError is a ValueError
        check(_mutated(load(name), change))


# ---- what the pods run -------------------------------------------------------------------------
def operator_env(doc):
    """The PET_* variables the training operator puts in each pod for an elasticPolicy
    (kubeflow/training-operator, pkg/controller.v1/pytorch/elastic.go)."""
    policy, name = doc["spec"]["elasticPolicy"], doc["metadata"]["name"]
    container = pod_spec(doc)["containers"][0]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port")
    assert container["name"] == "pytorch", "the operator looks the port up in the container named pytorch"
    return {"PET_RDZV_ENDPOINT": f"{name}-worker-0:{port}", "PET_RDZV_BACKEND": policy["rdzvBackend"],
            "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
            "PET_MAX_RESTARTS": str(policy["maxRestarts"]), "PET_NPROC_PER_NODE": str(policy["nProcPerNode"]),
            "PET_RDZV_ID": policy["rdzvId"]}


def manifest_env(doc):
    """The pod's own env; the node rank (from the pod's completion index) as pod 1's."""
    env = {}
    for item in pod_spec(doc)["containers"][0].get("env", []):
        if "valueFrom" in item:
            assert "job-completion-index" in item["valueFrom"]["fieldRef"]["fieldPath"]
            env[item["name"]] = "1"
        else:
            env[item["name"]] = item["value"]
    return env


@pytest.mark.parametrize("name,env_of,host", [
    ("pytorchjob.yaml", operator_env, "ft-ddp-worker-0"),
    ("jobset.yaml", manifest_env, "ft-ddp-workers-0-0.ft-ddp"),
])
def test_pods_run_the_fault_tolerant_job_from_pet_variables(monkeypatch, name, env_of, host):
    doc = load(name)
    spec = pod_spec(doc)
    container = spec["containers"][0]
    for var in [v for v in os.environ if v.startswith(("PET_", "SLURM_"))]:
        monkeypatch.delenv(var)
    env = env_of(doc)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert container["command"] == ["ft_launcher"], "the launcher must be the container's process, for SIGTERM"
    argv = [a.replace("/workspace/", ROOT + "/") for a in container["args"]]
    assert not [a for a in argv if a.startswith(("--nnodes", "--rdzv", "--nproc", "--max-restarts"))]
    cfg = launch_config(argv)
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (2, 3, 2)   # a hot spare
    assert (cfg.rdzv_backend, cfg.rdzv_host, cfg.rdzv_port, cfg.rdzv_id) == ("c10d", host, 29400, "ft-ddp")
    assert cfg.max_restarts == 10 and cfg.origins == {"nnodes": "PET_NNODES", "endpoint": "PET_RDZV_ENDPOINT"}
    if "PET_NODE_RANK" in env:
        assert cfg.order_key == 1
    # the ranks finish saving before Kubernetes' SIGKILL follows its SIGTERM
    assert cfg.term_timeout < spec["terminationGracePeriodSeconds"]
    # checkpoints, computed timeouts and logs on the volume every pod shares
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]}
    assert claims == {"shared": load("shared-pvc.yaml")["metadata"]["name"]}
    shared = mounts["shared"] + "/"
    assert cfg.ft.ft_state_path.startswith(shared) and cfg.log_dir.startswith(shared)
    assert argv[argv.index("--ckpt-dir") + 1].startswith(shared)
    assert cfg.ft.calc_ft_timeouts and cfg.ft.rank_section_timeouts == {
        "setup": 600.0, "step": 180.0, "checkpointing": 420.0}
    # the launcher, not Kubernetes, restarts failed ranks; Kubernetes restarts a launcher that gave up
    policy = (doc["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] if doc["kind"] == "PyTorchJob"
              else spec["restartPolicy"])
    assert policy == "OnFailure"


# ---- what Kubernetes does to the pods, with ft_launcher in them ----------------------------------
# Two or three agents on this machine stand for the pods, configured by PET_* variables alone as
# the training operator configures them (tests/harness.py's Job with pet=True).
def _in_held_step(job, rank):
    return any(s == HOLD_STEP - 1 for _, s, _ in progress(job.prog, rank))


@pytest.mark.slow   # the pods starting from PET_* variables alone run by default (above); the kill path everywhere
def test_job_from_pet_variables_alone_trains_survives_a_killed_rank_and_ends_exactly(launcher, tmp_path, reference):
    """Two agents started as the training operator starts two pods: no rendezvous flag, no
    GROUP_RANK, only PET_NNODES=2, PET_NPROC_PER_NODE=2, PET_RDZV_ENDPOINT, PET_RDZV_BACKEND=c10d,
    PET_RDZV_ID (and PET_MAX_RESTARTS, PET_RDZV_CONF, PET_LOG_DIR). A simulated fault SIGKILLs rank 3
    in step; the job restarts once and ends with the fault-free run's model."""
    expected = reference.checksum("2x2")
    rank = fault_rank("2x2")
    ft = HANG_TIMEOUTS["step"] + ["--ft-simulate-fault", "true", "--ft-simulated-fault-type", "rank_killed",
                                  "--ft-simulated-fault-rank", rank, "--ft-simulated-fault-base-delay", DELAY]
    job = Job(launcher, tmp_path, "2x2", ft, ["--hold", f"step:{HOLD}"], pet=True)
    assert {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_RDZV_ID"} <= set(job.pet)
    assert not [a for a in job.args if str(a).startswith(("--nnodes", "--nproc", "--rdzv", "--max-restarts"))]
    results = job.launch().wait()[0]
    errors = "\n".join(r[2][-4000:] for r in results)
    assert [code for code, _, _ in results] == [0, 0], errors
    for _, _, err in results:
        line = first_agent_line(err)
        assert "nnodes 2 (from PET_NNODES), 2 ranks per node" in line, line
        assert f"c10d rendezvous at 127.0.0.1:{job.port} (from PET_RDZV_ENDPOINT)" in line, line
    final = job.final()
    assert final["step"] == STEPS and final["world_size"] == 4
    assert final["checksum"] == expected, "resumed run differs from the fault-free run"
    evs = job.events()
    check_one_restart(evs, job)
    injected = [e for e in evs if e["kind"] == "fault_injected"]
    assert [(e["rank"], e["detail"]["fault"]) for e in injected] == [(rank, "rank_killed")]
    first = next(e for e in evs if e["kind"] == "failure")
    assert first["rank"] == rank and "killed by SIGKILL" in first["detail"]["what"], first


@pytest.mark.slow
def test_pod_deletion_sigterm_stops_every_pod_with_143(launcher, tmp_path):
    """Deleting a pod (or evicting, or preempting it) sends its launcher SIGTERM: the launcher
    forwards it to its ranks and stops the job on every node, and every launcher exits 143."""
    job = Job(launcher, tmp_path, "2x2", HANG_TIMEOUTS["step"], ["--hold", f"step:{HOLD}"], pet=True).launch()
    wait_for(lambda: _in_held_step(job, 0) and _in_held_step(job, 3), 60, "both pods to train")
    job.agents[1].send_signal(signal.SIGTERM)
    results, _ = job.wait()
    assert [code for code, _, _ in results] == [143, 143], "\n".join(r[2][-3000:] for r in results)
    assert "received SIGTERM: forwarding to the ranks" in results[1][2]
    assert "another node is shutting down the job (SIGTERM)" in results[0][2]


@pytest.mark.slow
def test_lost_pod_is_replaced_by_the_spare_and_the_job_ends_exactly(launcher, tmp_path, reference):
    """PET_NNODES=2:3 and three pods: two train, the third waits. A training pod lost without a
    signal (its node died: SIGKILL here) is noticed by keep-alives; the survivor and the spare
    form the next round and the job ends with the fault-free run's model."""
    expected = reference.checksum("2x2")
    job = Job(launcher, tmp_path, "2x2", HANG_TIMEOUTS["step"], ["--hold", f"step:{HOLD}"], pet=True)
    job.pet["PET_NNODES"] = "2:3"
    job.launch()
    wait_for(lambda: _in_held_step(job, 0) and _in_held_step(job, 3), 60, "two pods to train")
    job.launch_agent(2)
    wait_for(lambda: read_events(job.logs, "spare_waiting"), 30, "the third pod to wait as a spare")
    job.agents[1].kill()   # not the first pod: that one hosts the store
    results, _ = job.wait()
    codes = [code for code, _, _ in results]
    assert codes[0] == 0 and codes[2] == 0, "\n".join(r[2][-3000:] for r in results)
    assert "stopped answering" in results[0][2]
    final = job.final()
    assert final["step"] == STEPS and final["world_size"] == 4 and final["cycle"] == 1
    assert final["checksum"] == expected, "resumed run differs from the fault-free run"
    starts = [e for e in job.events() if e["kind"] == "cycle_start" and e["cycle"] == 1]
    assert len(starts) == 2, starts   # the survivor and the former spare
