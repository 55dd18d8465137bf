"""The control plane at scale, emulated: N thin agents on this machine against one real TCPStore.

    python bench/control_plane_emulator.py [--sizes 64,256,1024,4096] [--procs 4] [--torch]

Each thin agent runs ft_launcher's own round protocol, round watcher (bells, liveness
connections, store pings), store failover and restart policy (agent.rounds.*,
agent.recovery.restart_policy), with no ranks, no monitors and no torch import per agent: many
agents are threads of a few processes, their watchers share one event loop per process. The
store is torch's TCPStore (libuv backend), hosted by agent 0 in a process of its own (so it can
be killed); agents 1..HEAD-1, the store's successors, live in a second process, the rest in
--procs worker processes. Per N it measures, at the store host (every agent's client counts what
it sent and received; the host's CPU from /proc):
  round 0           last join -> every agent knows its ranks; calls and bytes of the round
  idle              calls per agent per second while every agent waits (watchers only)
  node lost         one agent dies (its sockets close, as a killed process's do) -> every
                    survivor knows its ranks in the next round (its watchers see the death,
                    one reports it, the policy decides, the bell wakes everybody, all rejoin)
  store host lost   the store's process is SIGKILLed -> every survivor knows its ranks on the
                    successor store (failover, a new store, a new round)
and for each phase the CPU every process of the emulation used (the store's and the agents'),
per agent and as a share of this machine's cores over the phase: near 100 % the phase's time is
this machine's CPU, not the protocol (a cluster runs each agent on its own node).
With --torch it runs the same round with torch's c10d rendezvous (DynamicRendezvousHandler on
C10dRendezvousBackend, one handler and one TCPStore client per agent, threads of the same
processes): round 0 (last join -> every agent's next_rendezvous returned; its store calls and
bytes, counted by wrapping the TCPStore methods it calls), and one node lost (a dead agent's
keep-alive stops; the survivors re-rendezvous). torch has no store failover.

What it leaves out: network latency and bandwidth (all on loopback: a real round adds a few
round trips of the network to each figure), one NIC and one kernel per node (here a few
processes share two cores with the store), and the agents' own start-up (imports, monitors).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HEAD = 5


def _quiet(line: str) -> None:
    pass


def _cfg(port: int, n: int, host: bool = False, run_id: str = "emu"):
    from ft_launcher.agent.launch_config import LaunchConfig

    cfg = LaunchConfig(min_nodes=n - 2 if n > 4 else n, max_nodes=n, nproc_per_node=8, entrypoint=["x"],
                       is_host=host, rdzv_host="127.0.0.1", rdzv_port=port, rdzv_id=run_id, max_restarts=10)
    cfg.rdzv_conf.update(last_call_timeout=2.0, join_timeout=300.0)
    return cfg


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- ours: a thin agent ---------------------------------------------------------------------------
class ThinAgent:
    """NodeAgent's loop over rounds (agent.agent.NodeAgent._cycles), without ranks."""

    def __init__(self, cfg, order: int, loop, marks: dict, store=None):
        from ft_launcher.agent.rounds.keepalive import AliveListener
        from ft_launcher.agent.rounds.job_store import JobStore
        from ft_launcher.agent.rounds.rendezvous import RoundProtocol
        from ft_launcher.agent.rounds.round_types import NodeInfo
        from ft_launcher.agent.rounds.store_failover import StoreFailover
        from ft_launcher.agent.recovery.round_end import RoundEnd

        self.cfg, self.order, self.loop, self.marks = cfg, order, loop, marks
        self.alive = AliveListener("127.0.0.1")
        self.store = store or JobStore(cfg, _quiet)
        self.me = NodeInfo(node_id=f"emu{order}", host="127.0.0.1", order_key=order, nproc=cfg.nproc_per_node,
                           alive_port=self.alive.port, hosts_store=self.store.is_host)
        self.proto = RoundProtocol(self.store, cfg, self.me)
        self.failover = StoreFailover(cfg, self.store, self.proto, self.me, _quiet)
        self.round_end = self.failover.round_end = RoundEnd(self.proto, cfg)
        self.woken = threading.Event()
        self.dead = False
        self.error = None
        self.watcher = None
        self._new_watcher()

    def _new_watcher(self):
        from ft_launcher.agent.rounds.round_watcher import RoundWatcher

        if self.watcher is not None:
            self.watcher.stop()
        self.watcher = RoundWatcher(self.store, self.cfg, self.me, self.woken.set, self.failover.find_successor,
                                    None, self.alive, self.loop)
        self.watcher.late_joiners = self.failover.memory.late

    def run(self, go: threading.Event) -> None:
        from ft_launcher.agent.recovery import failure_cause
        from ft_launcher.agent.rounds.round_types import RendezvousError, StoreLost

        go.wait()
        number, target = None, None
        while not self.dead:
            try:
                number = self.proto.current_round() if number is None else number
                joined = time.time()
                rnd = self.proto.join(number, target)
                self.marks.setdefault(number, []).append((joined, time.time()))
                self.failover.remember(rnd)
                self.woken.clear()
                self.watcher.watch(rnd)
                while not self.woken.wait(1.0):
                    if self.dead:
                        return
                if self.dead:
                    return
                self.marks.setdefault(("woken", number), []).append(time.time())
                if self.watcher.store_lost:
                    raise StoreLost(self.watcher.store_lost)
                if self.watcher.interrupted_round == rnd.number:
                    verdict = self.proto.verdict(rnd.number)
                else:
                    report = dict(failure_cause.peers_lost(self.watcher.dead_peers).report, node_id=self.me.node_id)
                    verdict = self.round_end.interrupt(rnd.number, report)
                self.marks.setdefault(("verdict", number), []).append(time.time())
                self.watcher.watch(None)
                if not verdict.restart:
                    return
                number, target = verdict.next_round, None
            except StoreLost as exc:
                if self.dead:
                    return
                try:
                    number, target = self.failover.take_over(exc)
                    self._new_watcher()
                except RendezvousError as err:
                    self.error = str(err)
                    return
            except Exception as exc:  # noqa: BLE001 - reported by the process
                if not self.dead:
                    self.error = f"{type(exc).__name__}: {exc}"
                return

    def die(self) -> None:
        """As a killed process: every socket closes."""
        self.dead = True
        self.woken.set()

        def close():
            self.watcher.stop()
            self.alive.close()
        self.loop.call(close)
        self.store.client.close()


def _agents_process(kind: str, port: int, n: int, orders: list, conn, host: bool = False) -> None:
    """A process of thin agents: builds them, runs them on 'go', reports the rounds each knows."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
        sys.setswitchinterval(0.0005)   # hundreds of agent threads a process: hand the GIL on sooner
        if not host:   # the agents' thousands of threads must not starve the store's one (CFS is fair per thread)
            os.nice(10)
        from ft_launcher.agent.rounds import store_client as client_module

        client_module.SLICE = 2.0   # these agents get no signals: look for one less often than 4 times a second
        threading.stack_size(256 * 1024)
        from ft_launcher.agent.rounds import store_client

        store_client.counting(True)
        marks: dict = {}
        if kind == "torch":
            return _torch_process(port, n, orders, conn, marks)
        from ft_launcher.agent.rounds.round_watcher import WatchLoop

        loop = WatchLoop()
        loop.start()
        agents = []
        store = None
        if host:
            from ft_launcher.agent.rounds.job_store import JobStore

            store = JobStore(_cfg(port, n, host=True), _quiet)
            conn.send(("port", port))
        for order in orders:
            agents.append(ThinAgent(_cfg(port, n), order, loop, marks, store if order == 0 else None))
        go = threading.Event()
        threads = [threading.Thread(target=a.run, args=(go,), daemon=True) for a in agents]
        for t in threads:
            t.start()
        conn.send(("ready", len(agents)))
        _serve(conn, agents, marks, go)
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))


def _serve(conn, agents, marks, go) -> None:
    from ft_launcher.agent.rounds import store_client

    while True:
        cmd, arg = conn.recv()
        if cmd == "go":
            go.set()
        elif cmd == "stats":
            with store_client._STATS_LOCK:
                conn.send(("stats", json.loads(json.dumps(store_client.STATS))))
        elif cmd == "marks":   # (joined, known) of round `arg` for every agent alive that knows it
            alive = sum(1 for a in agents if not getattr(a, "dead", False))
            rows = list(marks.get(arg, []))
            errors = [a.error for a in agents if getattr(a, "error", None)]
            steps = {k[0]: (min(v), max(v)) for k, v in list(marks.items())
                     if isinstance(k, tuple) and k[1] == arg - 1 and v}
            conn.send(("marks", {"rows": rows, "alive": alive, "errors": errors[:3], "steps": steps}))
        elif cmd == "kill":
            for a in agents:
                if a.order == arg:
                    a.die()
            conn.send(("killed", time.time()))
        elif cmd == "exit":
            conn.send(("bye", None))
            os._exit(0)


# ---- torch's c10d rendezvous, the same way -------------------------------------------------------
_TORCH_STATS = {}


def _count_torch_store() -> None:
    import datetime

    import torch.distributed as dist

    def wrap(cls, name):
        inner = getattr(cls, name)

        def call(self, *args, **kwargs):
            size = sum(len(a) if isinstance(a, (bytes, str)) else sum(len(x) for x in a) if isinstance(a, list)
                       else 8 for a in args if not isinstance(a, datetime.timedelta))
            result = inner(self, *args, **kwargs)
            size += len(result) if isinstance(result, (bytes, str)) else 8
            row = _TORCH_STATS.setdefault(name, [0, 0])
            row[0] += 1
            row[1] += size
            return result
        setattr(cls, name, call)
    for name in ("set", "get", "add", "compare_set", "multi_get", "multi_set", "check", "wait", "delete_key"):
        wrap(dist.TCPStore, name)


class TorchAgent:
    def __init__(self, port: int, n: int, order: int, marks: dict):
        import datetime

        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        self.order, self.marks = order, marks
        self.store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300))
        backend = C10dRendezvousBackend(self.store, "emu")
        params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "emu", n - 2 if n > 4 else n, n,
                                      join_timeout=300, last_call_timeout=2, close_timeout=30,
                                      keep_alive_interval=1, keep_alive_max_attempt=3, local_addr="127.0.0.1")
        self.handler = create_handler(self.store, backend, params)
        self.dead = False
        self.error = None
        self.again = threading.Event()

    def run(self, go: threading.Event) -> None:
        go.wait()
        number = 0
        while not self.dead:
            try:
                joined = time.time()
                self.handler.next_rendezvous()
                if self.dead:
                    return
                self.marks.setdefault(number, []).append((joined, time.time()))
                number += 1
                self.again.wait()
                self.again.clear()
            except Exception as exc:  # noqa: BLE001
                if not self.dead:
                    self.error = f"{type(exc).__name__}: {str(exc)[:200]}"
                return

    def die(self) -> None:
        self.dead = True
        try:   # its keep-alive stops: the handler's heartbeat thread
            self.handler._keep_alive_timer.cancel()
        except Exception:  # noqa: BLE001
            pass


def _torch_process(port: int, n: int, orders: list, conn, marks: dict) -> None:
    import warnings

    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)
    _count_torch_store()
    agents = [TorchAgent(port, n, order, marks) for order in orders]
    go = threading.Event()
    for a in agents:
        threading.Thread(target=a.run, args=(go,), daemon=True).start()
    conn.send(("ready", len(agents)))
    while True:
        cmd, arg = conn.recv()
        if cmd == "go":
            go.set()
        elif cmd == "stats":
            conn.send(("stats", {"torch": json.loads(json.dumps(_TORCH_STATS))}))
        elif cmd == "marks":
            errors = [a.error for a in agents if a.error]
            conn.send(("marks", {"rows": list(marks.get(arg, [])), "alive": sum(not a.dead for a in agents),
                                 "errors": errors[:3]}))
        elif cmd == "kill":
            for a in agents:
                if a.order == arg:
                    a.die()
            conn.send(("killed", time.time()))
        elif cmd == "again":   # the survivors' ranks failed: every handler rendezvouses again
            for a in agents:
                if not a.dead:
                    a.again.set()
            conn.send(("ok", None))
        elif cmd == "exit":
            conn.send(("bye", None))
            os._exit(0)


def _torch_store_process(conn) -> None:
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300))
    conn.send(("port", store.port))
    while True:
        cmd, _ = conn.recv()
        if cmd == "exit":
            os._exit(0)


# ---- the run ------------------------------------------------------------------------------------------
def _free_port() -> int:
    """A port P with P+1..P+HEAD free too (the successors' stores: rdzv port + generation)."""
    import socket

    import random

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    while True:   # below the ephemeral range: thousands of client connections take ports there
        port = random.randint(max(1024, low - 8000), low - HEAD - 1)
        try:
            for k in range(0, HEAD + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + k))
            return port
        except OSError:
            continue

class Run:
    def __init__(self, kind: str, n: int, procs: int, limit: float):
        self.kind, self.n, self.limit = kind, n, limit
        ctx = mp.get_context("fork")
        self.children = []   # (process, conn)
        if kind == "ours":
            host_conn, child = ctx.Pipe()
            self.host = ctx.Process(target=_agents_process, args=(kind, _free_port(), n, [0], child, True),
                                    daemon=True)
            self.host.start()
            self.port = self._expect(host_conn, "port")
            self.children.append((self.host, host_conn))
            groups = [list(range(1, min(HEAD, n)))]
            rest = list(range(min(HEAD, n), n))
        else:
            host_conn, child = ctx.Pipe()
            self.host = ctx.Process(target=_torch_store_process, args=(child,), daemon=True)
            self.host.start()
            self.port = self._expect(host_conn, "port")
            self.store_conn = host_conn
            groups = []
            rest = list(range(n))
        groups += [rest[i::procs] for i in range(procs) if rest[i::procs]]
        for orders in groups:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_agents_process, args=(kind, self.port, n, orders, child), daemon=True)
            p.start()
            self.children.append((p, parent))
        for p, c in self.children:
            self._expect(c, "ready", 600)

    def _expect(self, conn, what: str, within: float = 120):
        if not conn.poll(within):
            raise RuntimeError(f"no {what!r} from a child within {within:g}s")
        got, arg = conn.recv()
        if got == "error":
            raise RuntimeError(arg)
        if got != what:
            raise RuntimeError(f"expected {what}, got {got}: {arg}")
        return arg

    def ask(self, cmd: str, arg=None, skip_host=False):
        out = []
        for p, c in self.children:
            if skip_host and p is self.host:
                continue
            c.send((cmd, arg))
        for p, c in self.children:
            if skip_host and p is self.host:
                continue
            out.append(self._expect(c, {"go": None}.get(cmd, {"stats": "stats", "marks": "marks", "kill": "killed",
                                                               "again": "ok", "exit": "bye"}[cmd])))
        return out

    def cpu(self) -> float:
        """CPU seconds used so far by every process of the run (the store host's and the agents')."""
        total = 0.0
        for p, _ in self.children + ([(self.host, None)] if self.kind == "torch" else []):
            try:
                total += _cpu(p.pid)
            except (OSError, ValueError):
                pass
        return total

    def go(self):
        for p, c in self.children:
            c.send(("go", None))

    def stats(self, skip_host=False) -> dict:
        total: dict = {}
        for part in self.ask("stats", skip_host=skip_host):
            for label, methods in part.items():
                for method, (calls, nbytes) in methods.items():
                    row = total.setdefault(method, [0, 0])
                    row[0] += calls
                    row[1] += nbytes
        return total

    def wait_round(self, number: int, expect: int, skip_host=False, within=None):
        deadline = time.monotonic() + (within or self.limit)
        while time.monotonic() < deadline:
            parts = self.ask("marks", number, skip_host=skip_host)
            rows = [r for p in parts for r in p["rows"]]
            errors = [e for p in parts for e in p["errors"]]
            if errors:
                return rows, errors
            if len(rows) >= expect:
                return rows, []
            time.sleep(0.2)
        return rows, [f"round {number}: only {len(rows)} of {expect} agents knew their ranks within the limit"]

    def close(self):
        for p, c in self.children:
            try:
                c.send(("exit", None))
            except (OSError, BrokenPipeError):
                pass
        if self.kind == "torch":
            try:
                self.store_conn.send(("exit", None))
            except (OSError, BrokenPipeError):
                pass
        time.sleep(0.3)
        for p, _ in self.children + [(self.host, None)]:
            if p.is_alive():
                p.kill()
            p.join(5)


def _diff(after: dict, before: dict) -> tuple:
    calls = sum(v[0] for v in after.values()) - sum(v[0] for v in before.values())
    nbytes = sum(v[1] for v in after.values()) - sum(v[1] for v in before.values())
    return calls, nbytes


class _PhaseFailed(Exception):
    pass


def _busy(run: Run, res: dict, name: str, cpu0: float, t0: float, n: int) -> None:
    """The CPU all the run's processes used from t0 (wall) to now (a phase and the fraction of a
    second its end took to be seen): per agent, and as a share of the machine's cores."""
    used, now = run.cpu() - cpu0, time.time()
    res[name + "_cpu_per_agent_ms"] = 1000 * used / n
    res[name + "_cores_busy"] = used / max(1e-6, (now - t0) * (os.cpu_count() or 1))


def _round0(run: Run, res: dict, n: int) -> None:
    cpu0, before = _cpu(run.host.pid), run.stats()
    all0, t0 = run.cpu(), time.time()
    run.go()
    rows, errors = run.wait_round(0, n)
    if errors:
        raise _PhaseFailed(errors[0])
    res["join_to_known"] = max(k for _, k in rows) - max(j for j, _ in rows)
    _busy(run, res, "round0", all0, t0, n)
    time.sleep(0.5)
    res["round_calls"], res["round_bytes"] = _diff(run.stats(), before)
    res["round_host_cpu"] = _cpu(run.host.pid) - cpu0


def _idle(run: Run, res: dict, n: int, seconds: float) -> None:
    cpu0, before = _cpu(run.host.pid), run.stats()
    time.sleep(seconds)
    calls, nbytes = _diff(run.stats(), before)
    res["idle_calls_per_agent_s"] = calls / n / seconds
    res["idle_bytes_s"] = nbytes / seconds
    res["idle_host_cpu"] = (_cpu(run.host.pid) - cpu0) / seconds


def _node_lost(run: Run, res: dict, n: int, again: bool) -> None:
    """The last agent in order dies (a worker process's); the survivors' next round."""
    before, cpu0 = run.stats(), _cpu(run.host.pid)
    all0 = run.cpu()
    t_kill = min(t for t in run.ask("kill", n - 1) if t)
    if again:   # torch: the survivors' ranks failed with it: every handler rendezvouses again
        run.ask("again")
    rows, errors = run.wait_round(1, n - 1, within=min(run.limit, 120))
    if errors:
        raise _PhaseFailed(errors[0])
    res["node_lost_to_round"] = max(k for _, k in rows) - t_kill
    _busy(run, res, "node_lost", all0, t_kill, n)
    steps = {}
    for part in run.ask("marks", 1):
        for name, (lo, hi) in part.get("steps", {}).items():
            a, b = steps.get(name, (lo, hi))
            steps[name] = (min(a, lo), max(b, hi))
    res["node_lost_steps"] = {k: [round(lo - t_kill, 3), round(hi - t_kill, 3)] for k, (lo, hi) in steps.items()}
    res["node_lost_joins"] = [round(min(j for j, _ in rows) - t_kill, 3), round(max(j for j, _ in rows) - t_kill, 3)]
    res["node_round_calls"], res["node_round_bytes"] = _diff(run.stats(), before)
    res["node_round_host_cpu"] = _cpu(run.host.pid) - cpu0


def _store_lost(run: Run, res: dict, n: int) -> None:
    before = run.stats(skip_host=True)
    all0 = run.cpu()
    t_kill = time.time()
    os.kill(run.host.pid, signal.SIGKILL)
    rows, errors = run.wait_round(2, n - 2, skip_host=True)
    if errors:
        raise _PhaseFailed(errors[0])
    res["store_lost_to_round"] = max(k for _, k in rows) - t_kill
    _busy(run, res, "store_lost", all0, t_kill, n)
    res["failover_calls"], res["failover_bytes"] = _diff(run.stats(skip_host=True), before)


def run_kind(kind: str, n: int, procs: int, limit: float, idle: float) -> dict:
    res = {"kind": kind, "n": n}
    run = Run(kind, n, procs, limit)
    try:
        _round0(run, res, n)
        _idle(run, res, n, idle)
        _node_lost(run, res, n, again=kind == "torch")
        if kind == "ours":
            _store_lost(run, res, n)
    except _PhaseFailed as exc:
        res["error"] = str(exc)
    finally:
        run.close()
    return res


def line(r: dict) -> str:
    def f(key, fmt="{:.2f}"):
        return fmt.format(r[key]) if key in r else "n/a"
    mb = lambda key: f"{r[key] / 1e6:.2f} MB" if key in r else "n/a"  # noqa: E731
    text = (f"{r['kind']:5s} N={r['n']:5d}  round0: last join->known {f('join_to_known')}s, {f('round_calls', '{:d}')} calls,"
            f" {mb('round_bytes')}, host cpu {f('round_host_cpu')}s | idle: {f('idle_calls_per_agent_s', '{:.3f}')}"
            f" calls/agent/s, host cpu {f('idle_host_cpu', '{:.3f}')} | node lost->next round {f('node_lost_to_round')}s,"
            f" {f('node_round_calls', '{:d}')} calls, {mb('node_round_bytes')}, host cpu {f('node_round_host_cpu')}s")
    if r["kind"] == "ours":
        text += f" | store lost->successor round {f('store_lost_to_round')}s, {mb('failover_bytes')}"
    busy = [f"{phase} {r[phase + '_cores_busy']:.0%} ({r[phase + '_cpu_per_agent_ms']:.2f} ms/agent)"
            for phase in ("round0", "node_lost", "store_lost") if phase + "_cores_busy" in r]
    if busy:
        text += " | cores busy: " + ", ".join(busy)
    if "error" in r:
        text += f"  ERROR: {r['error'][:300]}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024,4096")
    parser.add_argument("--procs", type=int, default=4, help="worker processes")
    parser.add_argument("--limit", type=float, default=180.0, help="seconds one phase may take")
    parser.add_argument("--idle", type=float, default=6.0, help="seconds of the idle phase")
    parser.add_argument("--torch", action="store_true", help="also torch's c10d rendezvous")
    parser.add_argument("--only-torch", action="store_true")
    parser.add_argument("--json", help="append results as JSON lines to this file")
    args = parser.parse_args()
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for n in [int(x) for x in args.sizes.split(",")]:
        kinds = (["torch"] if args.only_torch else ["ours"] + (["torch"] if args.torch else []))
        for kind in kinds:
            need = (2 if kind == "ours" else 1) * n + 64   # the store host's connections: main + watcher per agent
            if hard != resource.RLIM_INFINITY and need > hard:
                print(f"{kind:5s} N={n:5d}  cannot be held here: the store host needs about {need} open files "
                      f"({'two connections' if kind == 'ours' else 'one connection'} per agent) and this machine's "
                      f"hard limit is {hard}", flush=True)
                continue
            procs = max(args.procs, -(-7 * n // (hard - 512)))   # an agent holds ~7 sockets in its process
            try:
                r = run_kind(kind, n, procs, args.limit, args.idle)
            except Exception as exc:  # noqa: BLE001
                r = {"kind": kind, "n": n, "error": f"{type(exc).__name__}: {exc}"}
            print(line(r), flush=True)
            if args.json:
                with open(args.json, "a") as fh:
                    fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
