"""Our rank monitor answers NVRx's own RankMonitorClient (nvidia-resiliency-ext 0.4.1, the real
package) on the socket FT_RANK_MONITOR_IPC_SOCKET names, writing the same shared-memory record
as our client; and nothing a peer sends runs code: a pickle naming any class that is not one of
NVRx's messages is answered ErrorMsg and one line, whatever it hides in. One real monitor process
per test (MonitorHandle, as the agent starts it); the client runs in this process.

NVRx 0.7 does not install here (manylinux_2_39): its client is played by raw messages shaped as
0.7's (InitMsg with `iteration` and `num_warmup_iters`, SectionMsg with `iteration`, read from
the 0.7.0 wheel's fault_tolerance/data.py and rank_monitor_client.py); they pickle as 0.7's do,
the classes being plain `__dict__` classes of the same module and name in both versions.
"""
import logging
import os
import pickle
import select
import signal
import socket
import threading
import time

import pytest

from conftest import wait_for
from ft_launcher.rank_monitor import nvrx_wire
from ft_launcher.rank_monitor import shm_layout as L
from ft_launcher.rank_monitor.agent_side.monitor_handle import MonitorHandle
from ft_launcher.rank_monitor.config import FaultToleranceConfig

nvrx_ft = pytest.importorskip("nvidia_resiliency_ext.fault_tolerance", reason="pip install -e '.[test]' installs it")
from multiprocessing.reduction import ForkingPickler  # noqa: E402  (NVRx's own pickler)

from nvidia_resiliency_ext.fault_tolerance import data as D  # noqa: E402


def make_monitor(tmp_path, **cfg):
    """A monitor as the agent starts it; its log (stderr) goes to tmp_path/monitor.log."""
    base = dict(rank_section_timeouts={"setup": 60.0, "step": 30.0, "checkpointing": 60.0},
                rank_out_of_section_timeout=60.0, calc_timeout_floor=0.5, log_level=logging.DEBUG)
    base.update(cfg)
    saved = os.dup(2)
    with open(tmp_path / "monitor.log", "ab") as log:
        os.dup2(log.fileno(), 2)   # the monitor inherits this process's stderr
        try:
            return MonitorHandle.start(0, FaultToleranceConfig(**base), str(tmp_path / "run"))
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def monitor_log(tmp_path):
    return (tmp_path / "monitor.log").read_text()


@pytest.fixture
def monitor(tmp_path):
    handle = make_monitor(tmp_path)
    yield handle
    handle.stop()
    assert not os.path.exists(handle.nvrx_socket)


@pytest.fixture
def rank_env(monkeypatch):
    """This process as the rank: NVRx's client finds the monitor through the rank's variables."""
    def apply(handle):
        env = handle.rank_env()
        assert env["FT_RANK_MONITOR_IPC_SOCKET"] == env["FT_LAUNCHER_IPC_SOCKET"] == handle.nvrx_socket
        for name in ("FT_RANK_MONITOR_IPC_SOCKET", "FT_LAUNCHER_IPC_SOCKET"):
            monkeypatch.setenv(name, env[name])
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        handle.rank_started(os.getpid(), 0, 0, time.monotonic_ns())
    return apply


def words(handle):
    return handle.record()[1]


def slot_timeout(handle, name):
    mm, w = handle.record()
    for i in range(w[L.H_NSLOTS]):
        if L.read_name(mm, w, i) == name:
            return L.decode_timeout(w[L.slot_base(i) + L.S_TIMEOUT], "unset")
    return "no slot"


def test_nvrx_client_writes_our_record_and_gets_nvrx_answers(monitor, rank_env):
    rank_env(monitor)
    client = nvrx_ft.RankMonitorClient()
    client.init_workload_monitoring()
    cfg = client.cfg   # NVRx's own FaultToleranceConfig, built by its unpickler from our reply
    assert type(cfg) is nvrx_ft.FaultToleranceConfig
    assert cfg.rank_section_timeouts == {"setup": 60.0, "step": 30.0, "checkpointing": 60.0}
    assert cfg.rank_out_of_section_timeout == 60.0 and cfg.rank_termination_signal is signal.SIGKILL
    assert cfg.skip_section_response is False   # a 0.4.1-shaped InitMsg: every message is answered
    w = words(monitor)
    assert (w[L.H_CLIENT_KIND], w[L.H_CLIENT_PID], w[L.H_CLIENT_STATE]) == (L.CLIENT_NVRX, os.getpid(), 1)

    client.start_section("setup")
    assert [name for name, _ in monitor.live()["open"]] == ["setup"]
    time.sleep(0.05)
    client.end_section("setup")
    for _ in range(3):
        client.start_section("step")
        client.end_section("step")
        client.send_heartbeat()
    client.start_section("checkpointing")
    client.end_section("checkpointing")
    stats = monitor.section_stats()   # what computed timeouts, the report and status read
    assert stats["sections"]["setup"]["count"] == 1 and stats["sections"]["setup"]["max"] >= 0.05
    assert stats["sections"]["step"]["count"] == 3 and stats["heartbeat"]["subsequent"]["count"] == 2
    assert monitor.live()["sections"]["checkpointing"]["at_close"]["steps"] == 3   # goodput words too
    with pytest.raises(nvrx_ft.RankMonitorClientError, match="Section 'setup' is not open"):
        client.end_section("setup")
    client.start_section("step")
    with pytest.raises(nvrx_ft.RankMonitorClientError, match="Section 'step' is already open"):
        client.start_section("step")
    client.end_all_sections()
    assert monitor.live()["open"] == []

    # timeouts sent back: only calculated values are enforced, never below calc_timeout_floor (0.5 s)
    client.load_state_dict({"current_timeouts": {
        "section": {"section": {"setup": 60.0, "step": 0.01, "checkpointing": 7.0}, "out_of_section": 3.0,
                    "calculated_sections": ["step", "checkpointing"], "is_out_of_section_calculated": True},
        "heartbeat": {"initial": 9.0, "subsequent": 2.0, "were_calculated": True}}})
    assert (slot_timeout(monitor, "step"), slot_timeout(monitor, "checkpointing")) == (0.5, 7.0)
    assert slot_timeout(monitor, "setup") == "unset"   # configured, not calculated: the job's value
    w = words(monitor)
    assert [L.decode_timeout(w[i], None) for i in (L.H_TO_OOS, L.H_TO_HB_INIT, L.H_TO_HB_SUB)] == [3.0, 9.0, 2.0]

    client.shutdown_workload_monitoring()   # monitoring off for this incarnation, as with our client
    wait_for(lambda: words(monitor)[L.H_CLIENT_STATE] == 2, 5, "the session's end")

    # the next incarnation gets the timeouts back in its configuration, as from NVRx's server
    monitor.rank_started(os.getpid(), 0, 1, time.monotonic_ns())
    again = nvrx_ft.RankMonitorClient()
    again.init_workload_monitoring()
    assert again.cfg.rank_section_timeouts == {"setup": 60.0, "step": 0.01, "checkpointing": 7.0}
    assert (again.cfg.rank_out_of_section_timeout, again.cfg.rank_heartbeat_timeout) == (3.0, 2.0)
    assert words(monitor)[L.H_TO_OOS] == L.encode_timeout(3.0)
    again.start_section("step")
    assert slot_timeout(monitor, "step") == 0.5
    again.shutdown_workload_monitoring()
    monitor.rank_stopped()


def test_a_workload_control_request_reaches_the_agents_path(monitor, rank_env):
    rank_env(monitor)
    client = nvrx_ft.RankMonitorClient()
    client.init_workload_monitoring()
    client.send_workload_control_request(D.WorkloadControlRequest(D.WorkloadAction.ExcludeThisNode, "bad NIC"))
    request = wait_for(monitor.control_request, 5, "the request in the record")
    assert request == {"action": D.WorkloadAction.ExcludeThisNode.value, "description": "bad NIC"}
    client.shutdown_workload_monitoring()
    monitor.rank_stopped()


# ---- peers that are not NVRx's client ----------------------------------------------------------
def frame(obj_or_bytes):
    payload = obj_or_bytes if isinstance(obj_or_bytes, bytes) else bytes(ForkingPickler.dumps(obj_or_bytes))
    return len(payload).to_bytes(4, "big") + payload


def read_reply(sock, timeout=5.0):
    sock.settimeout(timeout)
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        assert chunk, "the monitor closed the connection without a reply"
        head += chunk
    size, body = int.from_bytes(head, "big"), b""
    while len(body) < size:
        body += sock.recv(size - len(body))
    return pickle.loads(body)


def connect(handle):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(handle.nvrx_socket)
    return sock


class MakesAFile:
    def __init__(self, how, path):
        self.how, self.path = how, path

    def __reduce__(self):
        if self.how == "open":
            return open, (self.path, "w")
        if self.how == "os.system":
            return os.system, (f"touch {self.path}",)
        return eval, (f"open({self.path!r}, 'w')",)


def nested_in_a_section_msg(evil):
    return D.SectionMsg(0, evil, D.SectionAction.OPEN)


def as_a_workload_request(evil):
    return 0, D.WorkloadControlRequest(evil, "x")


@pytest.mark.parametrize("how", ["open", "os.system", "eval"])
@pytest.mark.parametrize("wrap", [lambda e: e, nested_in_a_section_msg, as_a_workload_request],
                         ids=["bare", "inside_SectionMsg", "inside_a_workload_request"])
def test_a_pickle_naming_another_class_gets_an_error_and_one_line_and_nothing_runs(monitor, tmp_path, how, wrap):
    marker = tmp_path / "ran"
    with connect(monitor) as sock:
        sock.sendall(frame(pickle.dumps(wrap(MakesAFile(how, marker)))))
        reply = read_reply(sock)
    assert type(reply) is D.ErrorMsg and "which is not admitted" in reply.cause, reply
    assert {"open": "io.open", "os.system": "posix.system", "eval": "builtins.eval"}[how] in reply.cause
    assert not marker.exists()
    lines = wait_for(lambda: [l for l in monitor_log(tmp_path).splitlines() if "not admitted" in l], 5,
                     "the monitor's line")
    assert len(lines) == 1 and f"NVRx socket: pid {os.getpid()}: message refused: it names" in lines[0], lines
    with connect(monitor) as sock:   # the monitor goes on serving
        sock.sendall(frame(D.AuthkeyMsg(b"k")))
        assert type(read_reply(sock)) is D.OkMsg
    assert monitor.alive()


def test_a_message_with_a_bad_field_or_an_absurd_length_is_refused(monitor):
    with connect(monitor) as sock:
        sock.sendall(frame(D.SectionMsg(0, "step", D.SectionAction.OPEN)))   # before InitMsg
        assert "before InitMsg" in read_reply(sock).cause
        init = D.InitMsg()
        init.rank_info = D.RankInfo(0, 0, "h", os.getpid())
        sock.sendall(frame(init))
        assert type(read_reply(sock)) is D.OkMsg
        bad = D.UpdateConfigMsg(D.HeartbeatTimeouts(-1.0, 2.0, True), None)
        sock.sendall(frame(bad))
        assert "hb_timeouts.initial is not a positive number of seconds" in read_reply(sock).cause
        sock.sendall(frame(D.SectionMsg(0, "step", D.SectionAction.OPEN)))   # the session goes on
        assert type(read_reply(sock)) is D.OkMsg
        sock.sendall((1 << 30).to_bytes(4, "big"))
        assert "1073741824 bytes announced" in read_reply(sock).cause
        sock.settimeout(5)
        assert sock.recv(1) == b""   # and that connection is closed


def test_a_peer_that_never_reads_its_replies_neither_stalls_nor_fills_the_monitor(monitor):
    sock = connect(monitor)
    init = D.InitMsg()
    init.rank_info = D.RankInfo(0, 0, "h", os.getpid())
    blob = frame(init) + frame(D.HeartbeatMsg(0, {})) * 40000   # ~3 MB of replies it never reads
    errors = []

    def push():
        try:
            sock.sendall(blob)
        except OSError as exc:   # the monitor dropped it
            errors.append(exc)

    sender = threading.Thread(target=push, daemon=True)
    sender.start()
    ticks = []
    while sender.is_alive() and len(ticks) < 400:
        ticks.append(monitor.stalled_for())
        time.sleep(0.01)
    sender.join(30)
    assert not sender.is_alive() and max(ticks) < 1.2, max(ticks)   # its loop ticked throughout
    sock.settimeout(5)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    sock.close()
    with connect(monitor) as other:
        other.sendall(frame(D.AuthkeyMsg(b"k")))
        assert type(read_reply(other)) is D.OkMsg


def test_the_monitor_serves_nvrx_clients_without_nvidia_resiliency_ext_importable(tmp_path, monkeypatch, rank_env):
    blocker = tmp_path / "blocker" / "nvidia_resiliency_ext"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not importable in the monitor')\n")
    monkeypatch.setenv("PYTHONPATH", str(blocker.parent))
    handle = make_monitor(tmp_path)
    try:
        rank_env(handle)
        client = nvrx_ft.RankMonitorClient()
        client.init_workload_monitoring()
        assert client.cfg.rank_section_timeouts["step"] == 30.0
        client.start_section("step")
        client.end_section("step")
        assert handle.section_stats()["sections"]["step"]["count"] == 1
        client.shutdown_workload_monitoring()
        handle.rank_stopped()
    finally:
        handle.stop()


# ---- NVRx 0.7's client, played with 0.7-shaped messages ------------------------------------------
def init_07(pid):
    msg = D.InitMsg()   # 0.7: InitMsg(rank_info=..., iteration=..., num_warmup_iters=...)
    msg.rank_info, msg.iteration, msg.num_warmup_iters = D.RankInfo(0, 0, "h", pid), None, 3
    return msg


def section_07(name, action, iteration):
    msg = D.SectionMsg(0, name, action)
    msg.iteration = iteration   # 0.7's SectionMsg carries the framework's iteration
    return msg


def nothing_to_read(sock, wait=0.3):
    return not select.select([sock], [], [], wait)[0]


@pytest.mark.parametrize("skip", [True, False])
def test_nvrx07_client_gets_the_skip_flag_it_reads_and_only_the_replies_it_waits_for(tmp_path, skip):
    handle = make_monitor(tmp_path, skip_section_response=skip)
    try:
        handle.rank_started(os.getpid(), 0, 0, time.monotonic_ns())
        with connect(handle) as sock:
            sock.sendall(frame(D.AuthkeyMsg(b"k")))
            assert type(read_reply(sock)) is D.OkMsg
            sock.sendall(frame(init_07(os.getpid())))
            cfg = read_reply(sock).cfg
            assert cfg.skip_section_response is skip and cfg.num_warmup_iterations == 5
            assert cfg.install_exception_hook is False and cfg.rank_section_timeouts["step"] == 30.0
            for i in range(3):
                sock.sendall(frame(section_07("step", D.SectionAction.OPEN, i)) +
                             frame(section_07("step", D.SectionAction.CLOSE, i)) + frame(D.HeartbeatMsg(0, {})))
            if skip:
                assert nothing_to_read(sock)   # 0.7 waits for no reply: none is sent
            else:
                assert [type(read_reply(sock)) for _ in range(9)] == [D.OkMsg] * 9
            # a config update is always answered, and its reply is the next thing on the wire
            upd = D.UpdateConfigMsg(None, D.SectionTimeouts({"step": 4.0}, None, {"step"}, False))
            upd.current_cycle = None   # 0.7's UpdateConfigMsg field
            sock.sendall(frame(upd))
            assert type(read_reply(sock)) is D.OkMsg and nothing_to_read(sock, 0.05)
            stats = handle.section_stats()
            assert stats["sections"]["step"]["count"] == 3 and stats["heartbeat"]["subsequent"]["count"] == 2
            assert slot_timeout(handle, "step") == 4.0
        handle.rank_stopped()
    finally:
        handle.stop()


def test_an_nvrx05_or_041_shaped_init_is_told_to_wait_for_replies(tmp_path):
    """0.5 reads skip_section_response but sends 0.4.1's bare InitMsg: such a client is told
    false, so it waits for the replies it gets (0.4.1 ignores the key)."""
    handle = make_monitor(tmp_path, skip_section_response=True)
    try:
        with connect(handle) as sock:
            init = D.InitMsg()
            init.rank_info = D.RankInfo("0", 0, "h", os.getpid())   # 0.4.1 may send RANK as a string
            sock.sendall(frame(init))
            assert read_reply(sock).cfg.skip_section_response is False
            sock.sendall(frame(D.HeartbeatMsg(0, {})))
            assert type(read_reply(sock)) is D.OkMsg
    finally:
        handle.stop()


def test_reply_bytes_name_nvrx_classes_only_by_module_and_name():
    """The replies never import NVRx here: GLOBAL opcodes naming NVRx's module and class."""
    import pickletools

    payload = nvrx_wire.ok(cfg=nvrx_wire.config(FaultToleranceConfig(), {}, False))[4:]
    globals_named = [arg for op, arg, _ in pickletools.genops(payload) if op.name == "GLOBAL"]
    assert globals_named == ["nvidia_resiliency_ext.fault_tolerance.data OkMsg",
                             "nvidia_resiliency_ext.fault_tolerance.config FaultToleranceConfig",
                             "signal Signals"]


BOTH_CLIENTS = """
import sys, time
import ft_launcher as ft
from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
first = sys.argv[1]
if first == "ours":
    ft.heartbeat()                      # our client attaches the record
nvrx = RankMonitorClient()
nvrx.init_workload_monitoring()
nvrx.start_section("step"); nvrx.end_section("step")
with ft.section("mine"):
    pass
nvrx.shutdown_workload_monitoring()
"""


@pytest.mark.parametrize("first", ["nvrx", "ours"])
def test_one_rank_one_client_the_other_is_a_no_op_with_one_line(tmp_path, first):
    import subprocess
    import sys

    from conftest import ROOT

    handle = make_monitor(tmp_path)
    try:
        env = dict(os.environ, **handle.rank_env(), RANK="0", LOCAL_RANK="0", PYTHONPATH=ROOT)
        proc = subprocess.Popen([sys.executable, "-c", BOTH_CLIENTS, first], env=env, stderr=subprocess.PIPE,
                                text=True)
        handle.rank_started(proc.pid, 0, 0, time.monotonic_ns())
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        mm, w = handle.record()
        names = {L.read_name(mm, w, i) for i in range(w[L.H_NSLOTS])}
        if first == "nvrx":
            assert names == {"step"} and w[L.H_CLIENT_KIND] == L.CLIENT_NVRX
            assert "NVRx's RankMonitorClient (pid" in err and "ft_launcher's own sections" in err
        else:
            assert names == {"mine"} and w[L.H_CLIENT_KIND] == L.CLIENT_OWN
            assert "connected while ft_launcher's own client" in monitor_log(tmp_path)
        handle.rank_stopped()
    finally:
        handle.stop()
