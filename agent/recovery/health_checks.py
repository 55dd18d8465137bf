"""Node health checks, run by the agent before it joins each rendezvous round.

- GPUs, through NVML (`pynvml` from the nvidia-ml-py package) when a driver is present: every
  device answers (handle, memory info), none has retired pages pending or uncorrectable volatile
  ECC errors. Without NVML (no driver, no package: a CPU node) the check is skipped, and the agent
  says so once.
- The checkpoint directory (`checkpoint_dir`) takes a new file and has `min_free_disk_gb` GB free
  (a checkpoint is large). The log directory is not the job: it never fails the check. Below
  `min_free_disk_gb` one warning line says how much room is left; below LOG_ROOM_MB (the logs no
  longer fit: a full disk) or unwritable, one warning line says that what cannot be written there
  is lost and the node trains on (agent.observation.events: what a failed write costs). Each is
  said when the directory's state changes (fine, low, no room, unwritable), not at every check.
  Each path of `storage_healthcheck_path` (NVRx 0.7's key, comma-separated) exists and is readable.

- NIC link state (NVRx 0.7's enable_nic_healthcheck, on by default as in NVRx): when the agent
  starts it reads the state of each RDMA NIC's port, `link_state_path_template` with `{nic}` for
  each NIC in the template's parent folder (default /sys/class/infiniband/{nic}/ports/1/state,
  read as `4: ACTIVE` or `ACTIVE`); a port that was ACTIVE then and is not now fails the check.
  No such folder (no RDMA NIC): nothing to check.
- Distributed storage (NVRx 0.7's enable_dist_storage_healthcheck, off by default): Lustre's
  /sys/fs/lustre/health_check, where it exists, reads `healthy`, and every lustre, nfs and nfs4
  mount of this node (/proc/self/mounts) answers a listing within 15 s (in a child process, so a
  hung mount cannot hang the agent).

- Before the ranks start again after a cycle (cold or warm), the previous cycle's rank processes
  are gone from every GPU (agent.ranks.gpu_memory, bounded): a GPU that still holds one fails the check
  (with the checks off, a warning line and the ranks start anyway). Without NVML: nothing to wait.

A failing node leaves the job as a rank's ExcludeThisNode request would (agent.recovery.no_restart), with one
line saying which check failed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import List, Optional, Tuple

from ft_launcher.agent.ranks import gpu_memory

LOG_ROOM_MB = 8.0   # free MB below which a cycle's logs would not fit in the log directory (a warning)


def check_gpus() -> Tuple[Optional[str], Optional[str]]:
    """-> (failure, skipped): a one-line reason each, or None."""
    try:
        import pynvml
    except ImportError:
        return None, "GPU health check skipped: pynvml (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"GPU health check skipped: NVML is not available on this node ({exc})"
    try:
        count = pynvml.nvmlDeviceGetCount()
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                pynvml.nvmlDeviceGetMemoryInfo(handle)
            except pynvml.NVMLError as exc:
                return f"GPU {index} does not answer NVML ({exc})", None
            try:
                pending = pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)
            except pynvml.NVMLError:   # not supported on this GPU: nothing to say
                pending = 0
            if pending:
                return f"GPU {index} has retired memory pages pending (needs a reset)", None
            try:
                ecc = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                         pynvml.NVML_VOLATILE_ECC)
            except pynvml.NVMLError:
                ecc = 0
            if ecc:
                return f"GPU {index} has {ecc} uncorrectable ECC error(s) since the last reset", None
        if count == 0:
            return None, "GPU health check skipped: NVML sees no GPU on this node"
        return None, None
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _room(free_bytes: float) -> str:
    """Free space in words: GB from 1 GB up, else MB."""
    return f"{free_bytes / 1e9:.1f} GB" if free_bytes >= 1e9 else f"{free_bytes / 1e6:.1f} MB"


def check_directory(what: str, path: str, min_free_gb: float) -> Optional[str]:
    """One line when `path` cannot take a file or has less than `min_free_gb` GB free."""
    failure, free = _writable_room(what, path)
    if failure:
        return failure
    if free < min_free_gb * 1e9:
        return f"{what} {path} has {_room(free)} free, less than min_free_disk_gb={min_free_gb:g}"
    return None


def check_log_directory(path: str, min_free_gb: float) -> Tuple[str, Optional[str]]:
    """(state, warning) of the log directory, never a failure: logs are not the job. The state is
    "fine", "low" (less than `min_free_gb` GB free, the logs fit), "no room" (less than LOG_ROOM_MB:
    a full disk) or "unwritable"; the warning says what it costs (nothing while "fine")."""
    failure, free = _writable_room("log directory", path)
    lost = "output and events that cannot be written there are lost; this node trains on"
    if failure:
        return "unwritable", f"{failure}: {lost}"
    if free < LOG_ROOM_MB * 1e6:
        return "no room", (f"log directory {path} has {_room(free)} free, too little for the job's logs (they need "
                           f"{LOG_ROOM_MB:g} MB): {lost}")
    if free < min_free_gb * 1e9:
        return "low", (f"log directory {path} has {_room(free)} free, less than min_free_disk_gb={min_free_gb:g}: "
                       f"the job goes on")
    return "fine", None


def _writable_room(what: str, path: str) -> Tuple[Optional[str], float]:
    """(a line when `path` cannot take a file or its free space cannot be read, its free bytes)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return f"{what} {path} is not writable ({exc.strerror or exc})", 0.0
    try:
        return None, float(shutil.disk_usage(path).free)
    except OSError as exc:
        return f"cannot read the free disk space of {what} {path} ({exc.strerror or exc})", 0.0


class HealthChecks:
    def __init__(self, ft, log_dir: Optional[str], say):
        self.ft = ft
        self.log_dir = log_dir
        self.say = say
        self._told: set = set()
        self._log_state = "fine"   # the log directory's, as last said (check_log_directory)
        self.dead_pids: List[int] = []    # the last cycle's rank processes (set by the agent)
        self.release_wait = ft.gpu_memory_reclaim_timeout   # NVRx 0.7's keys (agent.ranks.gpu_memory)
        self.nvml_query = gpu_memory.nvml_query   # NVML's process lists (None without NVML)
        self.nic_baseline = nic_states(ft.link_state_path_template) if ft.enable_nic_healthcheck else {}

    def gpu_release(self) -> Optional[str]:
        """Wait (bounded) until NVML no longer lists the last cycle's ranks; one line if a GPU does."""
        pids, self.dead_pids = self.dead_pids, []
        if not pids:
            return None
        query = self.nvml_query()
        if query is None:
            return None
        try:
            held = gpu_memory.wait_released(pids, query, self.release_wait, self.ft.gpu_memory_poll_interval,
                                            self.ft.gpu_memory_tolerance_mb)
        finally:
            try:
                import pynvml
                pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
        return gpu_memory.describe(held, self.release_wait) if held else None

    def run(self) -> Optional[str]:
        """The first failure as one line, or None; each skipped check is said once per agent."""
        ft = self.ft
        released = self.gpu_release()
        if not ft.health_checks:
            if released:
                self.say(f"warning: {released}")
            return None
        if released:
            return released
        failure, skipped = check_gpus()
        if skipped and skipped not in self._told:
            self._told.add(skipped)
            self.say(skipped)
        if failure:
            return failure
        if self.log_dir:
            state, warning = check_log_directory(self.log_dir, ft.min_free_disk_gb)
            if state != self._log_state and warning:
                self.say(f"warning: {warning}")
            self._log_state = state
        if ft.checkpoint_dir:
            failure = check_directory("checkpoint directory", ft.checkpoint_dir, ft.min_free_disk_gb)
            if failure:
                return failure
        failure = check_storage_paths(ft.storage_healthcheck_path)
        if failure is None and self.nic_baseline:
            failure = check_nic_states(self.nic_baseline, ft.link_state_path_template)
        if failure is None and ft.enable_dist_storage_healthcheck:
            failure = check_dist_storage()
        return failure


DEFAULT_LINK_STATE = "/sys/class/infiniband/{nic}/ports/1/state"


def nic_folder(template: Optional[str]) -> str:
    """The folder whose entries are the NICs: the template's part before `{nic}`."""
    head = (template or DEFAULT_LINK_STATE).split("{nic}")[0]
    return head.rstrip("/") or "/"


def nic_states(template: Optional[str]) -> dict:
    """NIC -> its port state now (`ACTIVE`, `DOWN`, ...), for the NICs whose state file exists."""
    template = template or DEFAULT_LINK_STATE
    states = {}
    try:
        nics = sorted(os.listdir(nic_folder(template)))
    except OSError:
        return {}
    for nic in nics:
        try:
            with open(template.format(nic=nic)) as fh:
                states[nic] = fh.read().strip().split(":", 1)[-1].strip()
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return states


def check_nic_states(baseline: dict, template: Optional[str]) -> Optional[str]:
    """One line when a port that was ACTIVE when the agent started is not ACTIVE now."""
    now = nic_states(template)
    for nic, before in baseline.items():
        if before == "ACTIVE" and nic in now and now[nic] != "ACTIVE":
            return f"NIC {nic}: port state went from ACTIVE to {now[nic]} (enable_nic_healthcheck)"
    return None


def check_dist_storage(lustre_health: str = "/sys/fs/lustre/health_check",
                       mounts: str = "/proc/self/mounts", timeout: float = 15.0) -> Optional[str]:
    """NVRx's distributed storage check: Lustre says healthy, every Lustre/NFS mount answers."""
    if os.path.exists(lustre_health):
        try:
            with open(lustre_health) as fh:
                status = fh.read().strip()
        except OSError as exc:
            return f"enable_dist_storage_healthcheck: cannot read {lustre_health} ({exc.strerror or exc})"
        if status != "healthy":
            return f"enable_dist_storage_healthcheck: Lustre reports {status!r} in {lustre_health}"
    try:
        with open(mounts) as fh:
            targets = [line.split()[1].replace("\\040", " ") for line in fh
                       if len(line.split()) > 2 and line.split()[2] in ("lustre", "nfs", "nfs4")]
    except OSError as exc:
        return f"enable_dist_storage_healthcheck: cannot read {mounts} ({exc.strerror or exc})"
    for target in targets:
        try:   # a hung mount blocks stat() itself: ask a child process, bounded
            done = subprocess.run(["ls", "-1", "--", target], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"enable_dist_storage_healthcheck: mount {target} did not answer within {timeout:g}s"
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace").strip().splitlines()
            return f"enable_dist_storage_healthcheck: mount {target} cannot be listed ({why[-1] if why else 'error'})"
    return None


def check_storage_paths(paths: Optional[str]) -> Optional[str]:
    """NVRx 0.7's storage_healthcheck_path: each comma-separated path exists and is readable."""
    for path in filter(None, (p.strip() for p in (paths or "").split(","))):
        if not os.path.exists(path):
            return f"storage_healthcheck_path: {path} does not exist"
        if not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
            return f"storage_healthcheck_path: {path} is not readable"
    return None
