"""A stand-in for NVML (`pynvml`), for tests on machines without a GPU: NVML is not ours, the agent is.

One healthy GPU. Its process list is the pids that rank scripts wrote into $FAKE_NVML_DIR
(tests/scripts/gpu_rank.py): with FAKE_NVML_MODE=release only those still alive (the driver freed
a dead process's memory), with FAKE_NVML_MODE=stuck all of them (it never does). Its NVLink fabric
cluster UUID (the node's NVLink domain) is FAKE_NVML_CLUSTER_UUID."""
import ctypes
import os
import types
import uuid

NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0


class NVMLError(Exception):
    pass


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetCount():
    return 1


def nvmlDeviceGetHandleByIndex(index):
    if index != 0:
        raise NVMLError("Invalid Argument")
    return "gpu0"


def nvmlDeviceGetMemoryInfo(handle):
    return types.SimpleNamespace(total=80 << 30, used=0, free=80 << 30)


def nvmlDeviceGetRetiredPagesPendingStatus(handle):
    return 0


def nvmlDeviceGetTotalEccErrors(handle, kind, counter):
    return 0


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def nvmlDeviceGetComputeRunningProcesses(handle):
    folder = os.environ.get("FAKE_NVML_DIR", "")
    pids = [int(name) for name in os.listdir(folder)] if os.path.isdir(folder) else []
    if os.environ.get("FAKE_NVML_MODE") != "stuck":
        pids = [pid for pid in pids if _alive(pid)]
    return [types.SimpleNamespace(pid=pid, usedGpuMemory=1 << 30) for pid in pids]


def nvmlDeviceGetGraphicsRunningProcesses(handle):
    return []


# NVLink fabric: every GPU of this node reports the cluster UUID FAKE_NVML_CLUSTER_UUID (none when unset)
class c_nvmlGpuFabricInfo_t(ctypes.Structure):
    _fields_ = [("clusterUuid", ctypes.c_char * 80), ("status", ctypes.c_uint), ("cliqueId", ctypes.c_uint),
                ("state", ctypes.c_ubyte)]


def nvmlDeviceGetGpuFabricInfo(handle, info):
    cluster = os.environ.get("FAKE_NVML_CLUSTER_UUID")
    if cluster:
        ctypes.memmove(ctypes.addressof(info), uuid.UUID(cluster).bytes, 16)
        info.state = 3
