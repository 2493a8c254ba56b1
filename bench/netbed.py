"""A network testbed with real kernel networking: hosts in their own Linux network
namespaces, joined by veth links whose rates the kernel shapes (htb), with partitions
made by taking links down and up.

    reason = netbed.unavailable()          # None, or what the testbed needs and lacks
    with netbed.Netbed({"store": 16.0, "r0": 4.0, "learner": 1.0}) as bed:
        p = bed.popen("r0", [sys.executable, "-m", "rollout_gpu.relay", f"--host={bed.ip('r0')}"])
        bed.partition("r0"); bed.heal("r0")             # the link down, then up
        bed.set_rate("r0", up_mbps=0.4)                 # slow it 10x

Topology: a star. One switch namespace holds a Linux bridge; every host namespace is
joined to it by one veth pair (the host's end is `eth0`, on one /24). Each host's access
link is the only shaped hop: its uplink is htb on the host's `eth0` egress, its downlink
(optional) htb on the switch port's egress. The bridge itself is unshaped, so the core is
free and only the hosts' uplinks limit a broadcast: the Kumar & Ross model (PAPER.md),
where each node has an upload capacity and the network between them does not constrain.
Point-to-point links would shape every pair separately (N^2 links for a mesh) and need
routes for a chain; a star needs N links and puts any topology (chain, tree, one-to-many)
on the same wires, chosen by the relays' sources. The root namespace (where the bench
process runs) is joined unshaped as `.1`, so the bench reaches every host's HTTP.

Rates are MB/s (1e6 bytes), as the benches' flags; htb counts whole frames (Ethernet, IP,
TCP headers), so payload runs a few percent under the rate (1.92 MB/s of payload on a
2 MB/s link, measured): a measured broadcast cannot beat a bound computed from the rates.
Each shaped link is one htb rate split into two classes, small packets (ACKs, requests)
ahead of bulk, with a bulk queue of QUEUE_S of the rate: see `_shape`.

Delay: this kernel has htb, tbf and pfifo but no netem (`tc qdisc add ... netem delay`
answers "Specified qdisc kind is unknown"), so links have no added propagation delay;
the bound is a bandwidth bound and needs none.

Cleanup: leaving the context (normally, on an exception, or on SIGTERM while inside)
kills the processes started with `popen`, deletes every namespace (which deletes their
veth ends and so their peers) and the root namespace's control link. `sweep()` removes
what a killed process left behind (namespaces and links named with this module's prefix
whose owning process is gone).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence

PREFIX = "nb"  # namespaces are nb<tag>-<host>, the root's control link nb<tag>c
QUEUE_S = 0.05  # the bulk queue of a shaped link, in seconds of its rate
SUBNETS = [f"10.250.{k}" for k in range(1, 255)]


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")
    return r


def unavailable() -> str | None:
    """None where a testbed can be made here, else what it needs (a sentence)."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN) to create network namespaces; run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"needs `{tool}` (iproute2) on the PATH"
    probe = f"{PREFIX}probe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` failed here: {r.stderr.strip()}"
    try:
        _run("ip", "-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb")
        _run("ip", "-n", probe, "link", "set", "va", "up")
        r = _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "va", "root",
                 "handle", "1:", "htb", check=False)  # fmt: skip
        if r.returncode != 0:
            return f"the kernel has no htb qdisc: {r.stderr.strip()}"
        r = _run("ip", "-n", probe, "link", "add", "vbr", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"the kernel cannot make a bridge: {r.stderr.strip()}"
    except RuntimeError as e:
        return f"cannot make veth links in a namespace: {e}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def kernel_qdiscs(kinds: Sequence[str] = ("htb", "tbf", "netem", "pfifo")) -> dict[str, bool]:
    """Which qdiscs this kernel will attach to a veth (a probe namespace, then removed)."""
    probe, out = f"{PREFIX}q{os.getpid()}", {}
    _run("ip", "netns", "add", probe)
    try:
        _run("ip", "-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb")
        args = {"htb": ["htb"], "tbf": ["tbf", "rate", "8mbit", "burst", "32kb", "latency",
                "50ms"], "netem": ["netem", "delay", "10ms"], "pfifo": ["pfifo"]}  # fmt: skip
        for kind in kinds:
            r = _run("ip", "netns", "exec", probe, "tc", "qdisc", "replace", "dev", "va", "root",
                     *args.get(kind, [kind]), check=False)  # fmt: skip
            out[kind] = r.returncode == 0
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return out


def sweep() -> list[str]:
    """Delete namespaces and control links of testbeds whose process is gone; their names."""
    gone = []
    names = [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines() if line]
    for ns in names:
        pid = ns[len(PREFIX) :].split("x")[0]
        if (
            ns.startswith(PREFIX)
            and "-" in ns
            and pid.isdigit()
            and not os.path.exists(f"/proc/{pid}")
        ):  # deleting a namespace deletes its veth ends, and so their peers
            _run("ip", "netns", "del", ns, check=False)
            gone.append(ns)
    return gone


class Netbed:
    """Hosts in namespaces on a shaped star (module docstring); a context manager.

    `hosts`: name -> uplink MB/s (0 = unshaped). `down`: name -> downlink MB/s for the
    hosts whose downlink is shaped too (the rest are unshaped: the Kumar & Ross model
    limits uploads only)."""

    def __init__(self, hosts: Mapping[str, float], down: Mapping[str, float] | None = None):
        reason = unavailable()
        if reason:
            raise RuntimeError(f"netbed: {reason}")
        self.up = dict(hosts)
        self.down = dict(down or {})
        # pid first: sweep() finds what a killed owner left; the hex keeps two beds apart
        self.tag = f"{os.getpid()}x{uuid.uuid4().hex[:3]}"
        self.switch = f"{PREFIX}{self.tag}-sw"
        self.ctl = f"{PREFIX}{self.tag[-6:]}c"[:15]
        self.ns = {h: f"{PREFIX}{self.tag}-{h}" for h in self.up}
        self.port = {h: f"p{i}" for i, h in enumerate(self.up)}
        self.procs: list[subprocess.Popen] = []
        self.made: list[str] = []
        self.subnet = ""
        self._old_term = None

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Netbed:
        try:
            self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        except ValueError:  # not the main thread: the caller's finally must close it
            self._old_term = None
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_term(self, signum, frame) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def _free_subnet(self) -> str:
        used = _run("ip", "-4", "addr").stdout + _run("ip", "-4", "route").stdout
        for net in SUBNETS:
            if f"{net}." not in used:
                return net
        raise RuntimeError("netbed: no free 10.250.x.0/24 subnet in the root namespace")

    def _build(self) -> None:
        self._netns_add(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge", "forward_delay", "0")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        self.subnet = self._free_subnet()
        _run("ip", "link", "add", self.ctl, "type", "veth", "peer", "name", "ctl", "netns",
             self.switch)  # fmt: skip
        self.made.append(self.ctl)
        _run("ip", "-n", self.switch, "link", "set", "ctl", "master", "br0", "up")
        _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.ctl)
        _run("ip", "link", "set", self.ctl, "up")
        for i, (host, ns) in enumerate(self.ns.items()):
            self._netns_add(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                 self.port[host], "netns", self.switch)  # fmt: skip
            _run("ip", "-n", self.switch, "link", "set", self.port[host], "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.subnet}.{10 + i}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            self.set_rate(host, self.up[host], self.down.get(host, 0.0))
        for host in self.ns:  # the bridge learns ports and STP is off: ready at once
            self._wait_reachable(host)

    def _netns_add(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self.made.append(ns)

    def _wait_reachable(self, host: str, timeout: float = 10.0) -> None:
        if shutil.which("ping") is None:
            return  # no ping here: the first HTTP call will say if it is not reachable
        deadline = time.time() + timeout
        while _run("ping", "-c1", "-W1", self.ip(host), check=False).returncode != 0:
            if time.time() > deadline:
                raise RuntimeError(f"netbed: {host} ({self.ip(host)}) is not reachable")
            time.sleep(0.1)

    def close(self) -> None:
        """Kill what `popen` started, delete the namespaces and links (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs = []
        for name in reversed(self.made):
            if name == self.ctl:
                _run("ip", "link", "del", name, check=False)
            else:
                _run("ip", "netns", "del", name, check=False)
        self.made = []
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    # -- hosts --------------------------------------------------------------------------
    def ip(self, host: str) -> str:
        return f"{self.subnet}.{10 + list(self.ns).index(host)}"

    @property
    def root_ip(self) -> str:
        """The root namespace's address on the bridge (unshaped): a server the bench runs
        in its own process listens here to be reachable from every host."""
        return f"{self.subnet}.1"

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the host's namespace (`ip netns exec NS ...`)."""
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` in the host's namespace; killed when the testbed closes."""
        p = subprocess.Popen(self.exec_argv(host, argv), **kwargs)
        self.procs.append(p)
        return p

    # -- links --------------------------------------------------------------------------
    def _shape(self, ns: str, dev: str, mbps: float) -> None:
        tc = ["ip", "netns", "exec", ns, "tc"]
        if mbps <= 0:
            _run(*tc, "qdisc", "del", "dev", dev, "root", check=False)
            return
        rate = f"{int(mbps * 8e6)}bit"
        half = f"{int(mbps * 4e6)}bit"
        # Two classes under one rate: small packets (TCP ACKs, HTTP requests) first, bulk
        # after, each free to use the whole rate when the other is idle. One FIFO would
        # queue a host's ACKs and chunk requests behind its own uploads, and a relay that
        # both uploads and downloads (a chain's middle) would starve its download.
        # add, not replace: htb cannot change in place; on a shaped link the classes change
        _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20",
             check=False)  # fmt: skip
        for cls, r, prio in (("1:1", rate, None), ("1:10", half, "0"), ("1:20", half, "1")):
            parent = "1:" if cls == "1:1" else "1:1"
            _run(*tc, "class", "replace", "dev", dev, "parent", parent, "classid", cls, "htb",
                 "rate", r, "ceil", rate, *(["prio", prio] if prio else []))  # fmt: skip
        # The bulk queue holds about QUEUE_S of the rate (at least two 64 KiB GSO packets):
        # a deep FIFO adds its drain time to every round trip (bufferbloat).
        limit = max(2 * 65536 + 3000, int(mbps * 1e6 * QUEUE_S))
        _run(*tc, "qdisc", "replace", "dev", dev, "parent", "1:20", "handle", "20:", "bfifo",
             "limit", str(limit))  # fmt: skip
        # IPv4 total length < 256: pure ACKs and small requests
        small = ["u32", "match", "u16", "0x0000", "0xff00", "at", "2", "flowid", "1:10"]
        _run(*tc, "filter", "replace", "dev", dev, "parent", "1:", "protocol", "ip", "prio",
             "1", *small)  # fmt: skip

    def set_rate(self, host: str, up_mbps: float, down_mbps: float | None = None) -> None:
        """Shape the host's uplink (and downlink, if given) at these MB/s; 0 = unshaped."""
        self._shape(self.ns[host], "eth0", up_mbps)
        self.up[host] = up_mbps
        if down_mbps is not None:
            self._shape(self.switch, self.port[host], down_mbps)
            self.down[host] = down_mbps

    def qdisc(self, host: str) -> str:
        """What the kernel reports for the host's uplink (`tc -s class show`)."""
        return _run("ip", "netns", "exec", self.ns[host], "tc", "-s", "class", "show", "dev",
                    "eth0").stdout  # fmt: skip

    def partition(self, host: str) -> None:
        """Cut the host off: its link down (both directions; its sockets see no peer)."""
        _run("ip", "-n", self.ns[host], "link", "set", "eth0", "down")

    def heal(self, host: str) -> None:
        """Its link up again (shaping stays: the qdisc belongs to the device)."""
        _run("ip", "-n", self.ns[host], "link", "set", "eth0", "up")


# -- network faults (for the benches' chaos: each returns what it did, for the event log) --
def partition_for(bed: Netbed, host: str, seconds: float) -> dict:
    """Cut `host` off for `seconds`, then heal it."""
    t0 = time.time()
    bed.partition(host)
    try:
        time.sleep(seconds)
    finally:
        bed.heal(host)
    return {"fault": "partition", "host": host, "at": t0, "seconds": time.time() - t0}


def partition_when(bed: Netbed, host: str, ready, seconds: float, timeout: float = 60.0) -> dict:
    """Partition `host` for `seconds` as soon as `ready()` is true (polled every 20 ms), e.g.
    while a relay holds part of a version and is serving the rest: a partition mid-chunk."""
    deadline = time.time() + timeout
    while not ready():
        if time.time() > deadline:
            return {"fault": "partition", "host": host, "skipped": "never ready"}
        time.sleep(0.02)
    return partition_for(bed, host, seconds)


def flap(bed: Netbed, host: str, times: int = 3, down_s: float = 1.0, up_s: float = 1.0) -> dict:
    """Take the host's link down and up `times` times (a flapping uplink)."""
    t0 = time.time()
    for i in range(times):
        partition_for(bed, host, down_s)
        if i + 1 < times:
            time.sleep(up_s)
    return {"fault": "flap", "host": host, "at": t0, "times": times, "down_s": down_s}


def slow(bed: Netbed, host: str, factor: float = 10.0) -> dict:
    """Shape the host's uplink `factor` times slower than now (it must be shaped);
    `restore(bed, fault)` puts the rate back."""
    rate = bed.up[host]
    if rate <= 0:
        raise ValueError(f"netbed: {host}'s uplink is unshaped; give it a rate to slow")
    bed.set_rate(host, rate / factor)
    return {"fault": "slow", "host": host, "at": time.time(), "from_mbps": rate,
            "to_mbps": rate / factor}  # fmt: skip


def restore(bed: Netbed, fault: dict) -> None:
    """Undo a `slow`."""
    bed.set_rate(fault["host"], fault["from_mbps"])
