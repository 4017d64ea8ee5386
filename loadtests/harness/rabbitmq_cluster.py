"""A RabbitMQ cluster of several nodes on this machine, as production runs it (three nodes, so that
quorum queues keep a majority when one goes), for the fail-over tests and figures.

Each node has its own name, AMQP and distribution ports and data folder; all share the Erlang cookie
of the machine's RabbitMQ (they run as its user, with its home), and join the first node with
``rabbitmqctl join_cluster``. The gateway's policies are applied with ``rabbitmqctl set_policy``,
as ``gateway queues policies`` prints them. Nodes are started from Debian's ``rabbitmq-server``
(the one ``scripts/test-deps`` installs); the machine's own broker on 5672 is left alone.

    with RabbitCluster(size=3) as cluster:
        cluster.urls          # "amqp://guest:guest@127.0.0.1:5681/,amqp://...:5682/,..."
        cluster.kill(node)    # SIGKILL, as a crashed host; cluster.start_node(node) brings it back
        cluster.partition(node)  # cut it off from the others (iptables); cluster.heal() undoes it

Nodes run with ``cluster_partition_handling = pause_minority``, as the RabbitMQ Cluster Operator
configures them: a node that cannot see a majority stops serving until it can. ``net_ticktime`` is
10 s instead of Erlang's 60, so that a partition is noticed in 7-13 s and the test stays short.

A partition is made with iptables on the loopback interface, where all the nodes' traffic flows:
each node runs with a supplementary group of its own; connections its processes open are marked
with that group (``CONNMARK``, from the first packet); a partition drops every packet of the
Erlang distribution connections between the node and the others, both ways (stream replication,
on ports 6000-6500 that cannot be told apart per node, is not cut: no partition test uses a
stream). Its AMQP port and the other nodes' links are untouched, so clients see what a client of a
partitioned host sees: a node that is up, then (pause_minority) one that closes its connections
and refuses new ones. The chains and groups have fixed names, like the ports: one cluster per
machine at a time.

Every RabbitMQ command (the server, ``rabbitmqctl``) is started through util-linux's ``setpriv``,
which takes the node's user and groups, and not with ``subprocess``'s ``user``/``group``/
``extra_groups``: those make Python ``fork()`` (it can only ``vfork()`` without them), and a fork
runs the ``pthread_atfork`` handlers of every library in the calling process. In a test process
that has used gRPC (the suite's gRPC and Triton tests), gRPC's handlers restart its event engine's
threads in the child, which abort it (SIGABRT, SIGSEGV) before it execs: ``rabbitmqctl wait``
"failed" with only gRPC's "epoll_wait error: Bad file descriptor" as output, never having run (in
about 1 fork of 60 there). ``vfork()`` runs no such handler.

``ensure_healthy`` checks that every node is up, serves AMQP and is clustered, waits for one still
booting and restarts one that is not, or says why it cannot: the tests call it before each test, so
a failed restart in one test does not break the next.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
SETPRIV = "setpriv"
"""util-linux's: runs a command as another user, with the groups given (see the module's doc)."""
CTL = Path("/usr/lib/rabbitmq/bin/rabbitmqctl")
USER = "rabbitmq"
NET_TICKTIME = 10
"""Seconds; a peer silent for about this long is declared down (Erlang's default is 60)."""
PARTITION_GROUP = 64_600
"""Node i runs with supplementary group PARTITION_GROUP + i: iptables tells its connections apart."""
MARK_CHAIN = "GATEWAY-CLUSTER-MARK"
CUT_CHAIN = "GATEWAY-CLUSTER-CUT"


class ClusterUnavailable(RuntimeError):
    """This machine cannot run the cluster (no RabbitMQ install, not root)."""


class ClusterUnhealthy(RuntimeError):
    """A node is down, not serving or not clustered, and restarting it did not bring it back."""


def exit_status(code: int) -> str:
    """A subprocess's return code in words: a negative one is the signal that killed it."""
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


@dataclass(frozen=True)
class Node:
    name: str
    """Erlang node name, ``<short>@<host>``."""
    amqp_port: int
    dist_port: int
    base: Path
    group: int
    """Supplementary group of its processes (marks its connections, see ``partition``)."""

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"  # guest may connect over loopback

    @property
    def pid_file(self) -> Path:
        return self.base / "pid"


def _process_state(pid: int) -> str | None:
    """A process's state letter (R, S, D, Z...: ``/proc/<pid>/stat``), None once its pid is free."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def check() -> str | None:
    """Why a cluster cannot run here, or None."""
    if not SERVER.exists() or not CTL.exists():
        return f"no RabbitMQ install ({SERVER})"
    if shutil.which(SETPRIV) is None:
        return f"no {SETPRIV} (util-linux) to run the nodes as {USER}"
    if os.geteuid() != 0:
        return "starting RabbitMQ nodes as its user needs root"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"no {USER!r} user"
    return None


class RabbitCluster:
    def __init__(self, *, size: int = 3, first_port: int = 5681, prefix: str = "gwc") -> None:
        why = check()
        if why is not None:
            raise ClusterUnavailable(why)
        host = socket.gethostname().split(".")[0]
        # Its own folder, which the nodes' user can reach (a test's tmp_path sits under a 0700 folder).
        self.base = Path(tempfile.mkdtemp(prefix="gateway-rabbit-cluster-"))
        self.base.chmod(0o755)
        self.nodes = [
            Node(
                f"{prefix}{i}@{host}",
                first_port + i,
                first_port + 20000 + i,
                self.base / f"{prefix}{i}",
                PARTITION_GROUP + i,
            )
            for i in range(size)
        ]
        self._account = pwd.getpwnam(USER)
        self._setpriv = shutil.which(SETPRIV) or SETPRIV
        self._no_partitions: str | None = None
        """Why ``partition`` cannot work here (None: it can)."""

    @property
    def urls(self) -> str:
        """Every node's address, as ``GATEWAY_BROKER_URL`` takes them (comma-separated)."""
        return ",".join(node.url for node in self.nodes)

    def _env(self, node: Node) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self._account.pw_dir,  # the machine's Erlang cookie: one for every node and the CLI
            "RABBITMQ_NODENAME": node.name,
            "RABBITMQ_NODE_PORT": str(node.amqp_port),
            "RABBITMQ_DIST_PORT": str(node.dist_port),
            "RABBITMQ_MNESIA_BASE": str(node.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(node.base / "log"),
            "RABBITMQ_PID_FILE": str(node.pid_file),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(node.base / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(node.base / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(node.base / "advanced.config"),
            # the CLI too: a node drops a peer (the CLI is one) silent for NET_TICKTIME
            "RABBITMQ_CTL_ERL_ARGS": f"-kernel net_ticktime {NET_TICKTIME}",
        }

    def _as_rabbitmq(
        self, node: Node, *argv: str, timeout: float = 120, groups: tuple[int, ...] = ()
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` as the RabbitMQ user, with ``groups`` as its only supplementary groups. The
        switch is ``setpriv``'s, after the exec: no ``user``/``group`` here, so that Python vforks
        (see the module's doc: a fork from a process with gRPC threads may die before its exec)."""
        account = self._account
        as_user = [
            self._setpriv,
            f"--reuid={account.pw_uid}",
            f"--regid={account.pw_gid}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
            "--",
        ]
        return subprocess.run(
            [*as_user, *argv],
            env=self._env(node),
            cwd=account.pw_dir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def ctl(self, node: Node, *args: str, timeout: float = 120) -> str:
        """``rabbitmqctl -n <node> ...``; raises with its exit status and output when it fails."""
        done = self._as_rabbitmq(node, str(CTL), "-n", node.name, *args, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"rabbitmqctl -n {node.name} {' '.join(args)}: {exit_status(done.returncode)}: "
                f"{done.stdout}{done.stderr}".strip()
            )
        return done.stdout

    def _prepare(self, node: Node) -> None:
        (node.base / "log").mkdir(parents=True, exist_ok=True)
        (node.base / "enabled_plugins").write_text("[].\n")
        # Nothing but AMQP and distribution: no listener may collide with the machine's own broker.
        (node.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{node.amqp_port}\ncluster_partition_handling = pause_minority\n"
        )
        (node.base / "advanced.config").write_text(f"[{{kernel, [{{net_ticktime, {NET_TICKTIME}}}]}}].\n")
        for path in [node.base, *node.base.rglob("*")]:
            os.chown(path, self._account.pw_uid, self._account.pw_gid)

    def _is_node_process(self, proc: Path, node: Node) -> bool:
        """Whether ``/proc/<pid>`` is a live process of ``node``: the RabbitMQ user's, with the
        node's ``RABBITMQ_NODENAME`` in its environment (the name is not on its command line). A
        dying process's or a zombie's environment cannot be read: a killed VM is not running."""
        try:
            if proc.stat().st_uid != self._account.pw_uid:
                return False
            return f"RABBITMQ_NODENAME={node.name}".encode() in (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            return False

    def _kill_leftover(self, node: Node) -> None:
        """A node of this name left by a run that was killed (its VM still up, known to epmd): its
        data folder is gone, so it is stopped hard before the name is used again."""
        for proc in Path("/proc").glob("[0-9]*"):
            if self._is_node_process(proc, node):
                with suppress(OSError, ValueError):
                    os.kill(int(proc.name), signal.SIGKILL)

    def start_node(self, node: Node, timeout: float = 120) -> None:
        """Start one node (its data kept: a restarted node rejoins its cluster) and wait until its
        ``rabbit`` app has booted; a node already running is only waited for."""
        if not self.running(node):
            self._kill_leftover(node)
            # A SIGKILLed VM leaves its pid file: ``rabbitmqctl wait`` would read that pid (dead, or
            # by now another process's) until the new VM writes its own.
            node.pid_file.unlink(missing_ok=True)
            self._prepare(node)
            done = self._as_rabbitmq(node, str(SERVER), "-detached", timeout=30, groups=(node.group,))
            if done.returncode != 0:
                raise RuntimeError(
                    f"{node.name} did not start: {exit_status(done.returncode)}: {done.stdout}{done.stderr}".strip()
                )
            self.ctl(node, "wait", str(node.pid_file), "--timeout", str(int(timeout)), timeout=timeout + 10)
        self.ctl(node, "await_startup", "--timeout", str(int(timeout)), timeout=timeout + 10)

    def start(self, policies: list[list[str]] | None = None) -> None:
        """Start every node, cluster them on the first, apply ``policies`` (rabbitmqctl argument
        lists, as ``service.jobs.policies.rabbitmqctl_commands`` gives them)."""
        self._mark_connections()  # before any node connects: marks are set on a connection's first packet
        first, *others = self.nodes
        self.start_node(first)
        for node in others:
            self.start_node(node)
            self.ctl(node, "stop_app")
            self.ctl(node, "join_cluster", first.name)
            self.ctl(node, "start_app")
        for command in policies or []:
            self.ctl(first, *command[1:])  # each starts with "rabbitmqctl"

    def members(self, via: Node | None = None) -> list[str]:
        """The running nodes, as one node sees them."""
        node = via or next(n for n in self.nodes if self.running(n))
        status = json.loads(self.ctl(node, "cluster_status", "--formatter", "json", timeout=30))
        return sorted(status["running_nodes"])

    def diagnose(self, node: Node, lines: int = 40) -> str:
        """What a node says of itself (cluster status, or why it cannot say), and its log's tail:
        for a test's failure message."""
        done = self._as_rabbitmq(node, str(CTL), "-n", node.name, "cluster_status", timeout=60)
        logs = sorted((node.base / "log").glob("*.log"))
        tail = logs[-1].read_text(errors="replace").splitlines()[-lines:] if logs else ["(no log)"]
        return f"{node.name} cluster_status:\n{done.stdout}{done.stderr}\nlog tail:\n" + "\n".join(tail)

    def pid(self, node: Node) -> int | None:
        """The pid of the node's running Erlang VM, from its pid file; None when the file is
        missing or names a process that is gone or is not this node's (a pid used again)."""
        try:
            pid = int(node.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if self._is_node_process(Path(f"/proc/{pid}"), node) else None

    def running(self, node: Node) -> bool:
        return self.pid(node) is not None

    def kill(self, node: Node) -> None:
        """SIGKILL the node's Erlang VM, as a crashed host: no goodbye to its peers or clients.
        Returns once the VM is gone, its pid file removed."""
        pid = self.pid(node)
        if pid is not None:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            # Wait for its pid to be released, not for pid() to lose it: a dying process's
            # environment goes before it has closed its sockets, and callers expect the clients to
            # have lost their connections by the return. Its parent is init, which reaps orphans
            # every 1-2 s here; one still a zombie after 30 s is dead all the same.
            deadline = time.monotonic() + 30
            while (state := _process_state(pid)) is not None:
                if time.monotonic() > deadline:
                    if state in "ZX":
                        break
                    raise RuntimeError(f"{node.name} (pid {pid}) still runs 30 s after its SIGKILL")
                time.sleep(0.05)
        node.pid_file.unlink(missing_ok=True)

    def serves_amqp(self, node: Node, timeout: float = 5) -> bool:
        """Whether the node answers an AMQP 0-9-1 protocol header with ``connection.start``: its
        ``rabbit`` app runs (a node without it, booting or paused, has no listener)."""
        try:
            with socket.create_connection(("127.0.0.1", node.amqp_port), timeout=timeout) as sock:
                sock.sendall(b"AMQP\x00\x00\x09\x01")
                answer = b""
                while len(answer) < 11 and (chunk := sock.recv(11 - len(answer))):
                    answer += chunk
        except OSError:
            return False
        # a method frame (type 1) on channel 0, its size, then class 10 method 10: connection.start
        return answer[:3] == b"\x01\x00\x00" and answer[7:11] == b"\x00\x0a\x00\x0a"

    def problems(self) -> dict[str, str]:
        """Why each node that is not serving in the cluster is not, by node name; empty when every
        node runs, answers AMQP and is among the running nodes as the first of them sees it."""
        wrong: dict[str, str] = {}
        for node in self.nodes:
            if not self.running(node):
                wrong[node.name] = "its VM is not running"
            elif not self.serves_amqp(node):
                wrong[node.name] = f"its VM runs, but nothing answers AMQP on {node.amqp_port} (no 'rabbit' app)"
        serving = [node for node in self.nodes if node.name not in wrong]
        if serving:
            try:
                members = self.members(serving[0])
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                wrong[serving[0].name] = f"cluster_status failed: {exc}"
            else:
                for node in serving:
                    if node.name not in members:
                        wrong[node.name] = f"it serves, but {serving[0].name} lists it not among {members}"
        return wrong

    def _booted(self, node: Node, timeout: float) -> bool:
        done = self._as_rabbitmq(
            node, str(CTL), "-n", node.name, "await_startup", "--timeout", str(int(timeout)), timeout=timeout + 10
        )
        return done.returncode == 0

    def ensure_healthy(self, timeout: float = 120, boot_wait: float = 60) -> list[str]:
        """Make the cluster whole, as an operator would: heal any partition; wait up to
        ``boot_wait`` for a node whose VM runs without its app (still booting after a restart, or
        stopped: a paused node); restart (SIGKILL, then start, its data kept, ``timeout`` for it)
        one that is down, still without its app, or not clustered. Returns what was wrong and what
        was done, one line per node (empty: nothing was); raises ClusterUnhealthy, with the nodes'
        own account, when the cluster is not whole after that."""
        if self._no_partitions is None:
            self.heal()
        wrong = self.problems()
        if not wrong:
            return []
        found = dict(wrong)
        booting = [n for n in self.nodes if n.name in wrong and self.running(n)]
        for node in booting:
            self._booted(node, boot_wait)
        if booting:
            wrong = self.problems()
        done = [f"{name}: {why}; waited for its boot" for name, why in found.items() if name not in wrong]
        for node in [n for n in self.nodes if n.name in wrong]:
            try:
                self.kill(node)
                self.start_node(node, timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                raise ClusterUnhealthy(
                    f"{node.name}: {wrong[node.name]}; restarting it failed: {exc}\n{self.diagnose(node)}"
                ) from exc
            done.append(f"{node.name}: {wrong[node.name]}; restarted")
        deadline = time.monotonic() + 30  # a restarted node's peers list it once they have seen it
        while (wrong := self.problems()) and time.monotonic() < deadline:
            time.sleep(1)
        if wrong:
            accounts = "\n".join(self.diagnose(n) for n in self.nodes if n.name in wrong)
            raise ClusterUnhealthy(f"after {done}, still: {wrong}\n{accounts}")
        return done

    def stop_node(self, node: Node) -> None:
        """A clean stop, as in maintenance (a rolling restart stops and starts one node at a time)."""
        if self.running(node):
            self.ctl(node, "stop", str(node.pid_file), timeout=120)

    def _iptables(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, timeout=30)
        if check and done.returncode != 0:
            raise ClusterUnavailable(f"iptables {' '.join(args)}: {done.stderr.strip()}")
        return done

    def _remove_chain(self, table: str, chain: str) -> None:
        while self._iptables("-t", table, "-D", "OUTPUT", "-o", "lo", "-j", chain, check=False).returncode == 0:
            pass
        self._iptables("-t", table, "-F", chain, check=False)
        self._iptables("-t", table, "-X", chain, check=False)

    def _mark_connections(self) -> None:
        """Mark each connection a node opens with its group (mangle table, first packet). Where
        iptables is missing or refused (no CAP_NET_ADMIN), only partitions are unavailable:
        ``partition`` raises with the reason."""
        if shutil.which("iptables") is None:
            self._no_partitions = "partitions need iptables"
            return
        try:
            self._remove_chain("mangle", MARK_CHAIN)  # left by a killed run
            self._remove_chain("filter", CUT_CHAIN)
            self._add_marks()
        except (ClusterUnavailable, subprocess.TimeoutExpired) as exc:
            self._no_partitions = f"partitions need iptables to work here: {exc}"

    def _add_marks(self) -> None:
        self._iptables("-t", "mangle", "-N", MARK_CHAIN)
        self._iptables("-t", "mangle", "-A", "OUTPUT", "-o", "lo", "-j", MARK_CHAIN)
        for node in self.nodes:
            self._iptables(
                "-t", "mangle", "-A", MARK_CHAIN, "-p", "tcp", "-m", "conntrack", "--ctstate", "NEW",
                "-m", "owner", "--gid-owner", str(node.group), "--suppl-groups",
                "-j", "CONNMARK", "--set-mark", str(node.group),
            )  # fmt: skip

    def partition(self, node: Node) -> None:
        """Cut ``node`` off from the other nodes: every packet of the distribution connections
        between it and them is dropped, both ways (as a switch failing), until ``heal``."""
        if self._no_partitions is not None:
            raise ClusterUnavailable(self._no_partitions)
        self._iptables("-N", CUT_CHAIN, check=False)
        if self._iptables("-C", "OUTPUT", "-o", "lo", "-j", CUT_CHAIN, check=False).returncode != 0:
            self._iptables("-I", "OUTPUT", "-o", "lo", "-j", CUT_CHAIN)
        for other in self.nodes:
            if other is node:
                continue
            # the other node's connections to this node's port, and this node's to the other's
            for opener, target in ((other, node), (node, other)):
                self._iptables(
                    "-A", CUT_CHAIN, "-p", "tcp", "-m", "connmark", "--mark", str(opener.group),
                    "-m", "conntrack", "--ctorigdstport", str(target.dist_port), "-j", "DROP",
                )  # fmt: skip

    def heal(self) -> None:
        """Undo every partition: the nodes find each other again (pause_minority: the paused node
        starts serving once it sees a majority)."""
        self._remove_chain("filter", CUT_CHAIN)

    def stop(self) -> None:
        for node in self.nodes:
            with suppress(RuntimeError, subprocess.TimeoutExpired):
                self.stop_node(node)
            with suppress(RuntimeError):  # one VM that outlives its SIGKILL must not keep the others up
                self.kill(node)
        if self._no_partitions is None:  # after the nodes: a stuck iptables must not leave them running
            with suppress(ClusterUnavailable, subprocess.TimeoutExpired):
                self._remove_chain("filter", CUT_CHAIN)
                self._remove_chain("mangle", MARK_CHAIN)
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> RabbitCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
