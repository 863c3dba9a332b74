"""``xdplb host steer``: host_sk_lookup in a fresh namespace sends a prefix, on every
port or on some, to one TCP listener and one UDP socket of another process, bound at
127.0.0.1:8080; real bytes come back from the address the client asked for.

198.51.100.0/23 is delivered locally (``ip route add local``); only its lower /24 is
steered, so the upper one shows what happens without steering: nothing listens there,
and the kernel refuses.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import typer
from typer.testing import CliRunner, Result

from xdplb.cli.args import EXIT_CONFIG, EXIT_NOT_RUNNING, EXIT_RUNTIME
from xdplb.cli.host_sockets import register
from xdplb.core import paths
from xdplb.core.btf import Kind
from xdplb.datapath import sk_lookup
from xdplb.datapath.layout import object_btf
from xdplb.datapath.links import Link
from xdplb.lab import netns as netns_mod
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

runner = CliRunner()
host_app = typer.Typer()
register(host_app)

PREFIX = "198.51.100.0/24"
#: Local but not steered: the kernel's own lookup finds nothing there.
OUTSIDE = "198.51.101.7"

#: The server: a TCP listener and a UDP socket on 127.0.0.1:8080, a TCP listener on
#: [::1]:8080. Each answers with the
#: address the client asked for (what the accepted socket's name, or IP_PKTINFO, says)
#: and the bytes it got. UDP replies leave from that address (IP_PKTINFO's spec_dst) but
#: from the socket's own port: one socket cannot answer from every port it is sent.
SERVER = r"""
import socket, struct, threading
IP_PKTINFO = 8
tcp = socket.socket()
tcp.bind(("127.0.0.1", 8080))
tcp.listen(64)
tcp6 = socket.socket(socket.AF_INET6)
tcp6.bind(("::1", 8080))
tcp6.listen(64)
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
udp.bind(("127.0.0.1", 8080))

def serve_tcp(listener):
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            host, port = conn.getsockname()[:2]
            conn.sendall(f"{host}:{port} ".encode() + data)

def serve_udp():
    while True:
        data, anc, _, peer = udp.recvmsg(4096, 64)
        info = next(d for level, kind, d in anc if kind == IP_PKTINFO)
        _ifindex, _spec_dst, dst = struct.unpack("=i4s4s", info)
        reply = f"{socket.inet_ntoa(dst)}:? ".encode() + data
        pktinfo = struct.pack("=i4s4s", 0, dst, b"\0" * 4)
        udp.sendmsg([reply], [(socket.IPPROTO_IP, IP_PKTINFO, pktinfo)], 0, peer)

threading.Thread(target=serve_udp, daemon=True).start()
threading.Thread(target=serve_tcp, args=(tcp6,), daemon=True).start()
print("ready", flush=True)
serve_tcp(tcp)
"""


@pytest.fixture
def server(netns: str) -> Iterator[subprocess.Popen[str]]:
    """The server, running in ``netns`` with 198.51.100.0/23 and 2001:db8::/32 local;
    killed after the test, and the steering detached."""
    netns_mod.run(netns, ["ip", "route", "add", "local", "198.51.100.0/23", "dev", "lo"])
    netns_mod.run(netns, ["ip", "-6", "route", "add", "local", "2001:db8::/32", "dev", "lo"])
    proc = netns_mod.popen(netns, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        sk_lookup.detach(netns)


def steer(ns: str, *args: str) -> Result:
    """``xdplb host steer ARGS -i NS``, in this thread inside ``ns``."""
    with netns_mod.enter(ns):
        return runner.invoke(host_app, ["steer", *args, "-i", ns])


def add(ns: str, *args: str) -> None:
    result = steer(ns, "add", "--prefix", PREFIX, "--to", "127.0.0.1:8080", *args)
    assert result.exit_code == 0, result.output


def tcp_ask(ns: str, addr: str, port: int) -> bytes:
    """Connect, send ``hello``, read the answer to the end."""
    payload = f"hello-{port}".encode()
    with netns_mod.enter(ns):
        conn = socket.create_connection((addr, port), timeout=5)
    with conn:
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := conn.recv(4096):
            out += chunk
    return out


def udp_ask(ns: str, addr: str, port: int) -> tuple[bytes, tuple[str, int]]:
    """One datagram, its answer and who sent it. The client is bound to 127.0.0.1, outside
    the steered prefix (a reply to an address of the prefix would be steered too), and
    unconnected: the reply comes from the server socket's port, not the one asked for."""
    with netns_mod.enter(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with s:
        s.bind(("127.0.0.1", 0))
        s.settimeout(5)
        s.sendto(f"hello-{port}".encode(), (addr, port))
        data, sender = s.recvfrom(4096)
    return data, sender


def udp_refused(ns: str, addr: str, port: int) -> None:
    """A datagram to ``addr``:``port`` is answered by a port unreachable (a connected
    socket reports it as ECONNREFUSED)."""
    with netns_mod.enter(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with s:
        s.settimeout(5)
        s.connect((addr, port))
        s.send(b"anyone?")
        with pytest.raises(ConnectionRefusedError):
            s.recv(4096)


def listing(ns: str) -> dict[str, object]:
    result = steer(ns, "list", "--json")
    assert result.exit_code == 0, result.output
    doc: dict[str, object] = json.loads(result.stdout)
    return doc


def test_every_port_of_a_prefix(netns: str, server: subprocess.Popen[str]) -> None:
    add(netns, "--proto", "tcp")
    add(netns, "--proto", "udp", "--ports", "all")
    for addr, port in [("198.51.100.7", 22), ("198.51.100.200", 443)]:
        assert tcp_ask(netns, addr, port) == f"{addr}:{port} hello-{port}".encode()
        assert udp_ask(netns, addr, port) == (f"{addr}:? hello-{port}".encode(), (addr, 8080))
    with pytest.raises(ConnectionRefusedError):
        tcp_ask(netns, OUTSIDE, 22)
    udp_refused(netns, OUTSIDE, 53)
    doc = listing(netns)
    assert doc["rules"] == [
        {"proto": "tcp", "prefix": PREFIX, "port": "all", "to": "127.0.0.1:8080/tcp"},
        {"proto": "udp", "prefix": PREFIX, "port": "all", "to": "127.0.0.1:8080/udp"},
    ]
    events = doc["events"]
    assert isinstance(events, dict)
    assert events["steered"] == 4
    assert events["no_rule"] >= 2  # the two refused, and whatever else looked up
    assert events["no_socket"] == events["assign_failed"] == 0


def test_ipv6_and_a_family_mismatch(netns: str, server: subprocess.Popen[str]) -> None:
    """An IPv6 prefix to an IPv6 listener is steered; to an IPv4 socket the kernel refuses
    the assignment, which is counted, and its own lookup finds nothing."""
    steered = ["--prefix", "2001:db8::/64", "--to", "[::1]:8080"]
    assert steer(netns, "add", *steered).exit_code == 0
    mismatch = ["--prefix", "2001:db8:1::/64", "--to", "127.0.0.1:8080"]
    assert steer(netns, "add", *mismatch).exit_code == 0
    assert tcp_ask(netns, "2001:db8::7", 22) == b"2001:db8::7:22 hello-22"
    with pytest.raises(ConnectionRefusedError):
        tcp_ask(netns, "2001:db8:1::7", 22)
    events = listing(netns)["events"]
    assert isinstance(events, dict)
    assert (events["steered"], events["assign_failed"]) == (1, 1)


def test_a_port_list_and_deleting_rules(netns: str, server: subprocess.Popen[str]) -> None:
    add(netns, "--proto", "tcp", "--ports", "80,443")
    add(netns, "--proto", "udp", "--ports", "53")
    assert tcp_ask(netns, "198.51.100.7", 80) == b"198.51.100.7:80 hello-80"
    assert udp_ask(netns, "198.51.100.7", 53)[0] == b"198.51.100.7:? hello-53"
    with pytest.raises(ConnectionRefusedError):
        tcp_ask(netns, "198.51.100.7", 22)  # not a steered port

    result = steer(netns, "del", "--prefix", PREFIX, "--ports", "80", "--proto", "tcp")
    assert result.exit_code == 0, result.output
    with pytest.raises(ConnectionRefusedError):
        tcp_ask(netns, "198.51.100.7", 80)
    assert tcp_ask(netns, "198.51.100.7", 443) == b"198.51.100.7:443 hello-443"

    result = steer(netns, "del", "--prefix", PREFIX, "--ports", "53", "--proto", "udp")
    assert result.exit_code == 0, result.output
    udp_refused(netns, "198.51.100.7", 53)

    result = steer(netns, "del", "--prefix", PREFIX, "--ports", "80", "--proto", "tcp")
    assert result.exit_code == EXIT_CONFIG
    assert "no tcp rule for 198.51.100.0/24 on ports 80" in result.output
    assert listing(netns)["rules"] == [
        {"proto": "tcp", "prefix": PREFIX, "port": 443, "to": "127.0.0.1:8080/tcp"}
    ]


def test_detach_removes_pins_and_link(netns: str, server: subprocess.Popen[str]) -> None:
    add(netns)
    pins = sk_lookup.pin_dir(netns)
    with Link.from_pinned(pins / sk_lookup.LINK_PIN) as link:
        link_id = link.id
    assert tcp_ask(netns, "198.51.100.7", 22) == b"198.51.100.7:22 hello-22"

    result = steer(netns, "detach")
    assert result.exit_code == 0, result.output
    assert not pins.exists()
    wait_for(
        lambda: (
            subprocess.run(
                ["bpftool", "link", "show", "id", str(link_id)], capture_output=True, check=False
            ).returncode
        ),
        f"link {link_id} gone",
        until=lambda rc: rc != 0,
    )
    with pytest.raises(ConnectionRefusedError):
        tcp_ask(netns, "198.51.100.7", 22)
    assert steer(netns, "detach").exit_code == EXIT_NOT_RUNNING
    assert steer(netns, "list").exit_code == EXIT_NOT_RUNNING


def test_a_closed_target_stops_steering(netns: str, server: subprocess.Popen[str]) -> None:
    """The kernel takes a closed socket out of the sockmap: the kernel's own lookup runs
    again, and the miss is counted."""
    add(netns)
    assert tcp_ask(netns, "198.51.100.7", 22) == b"198.51.100.7:22 hello-22"
    server.kill()
    server.wait()

    def refused() -> bool:
        try:
            tcp_ask(netns, "198.51.100.7", 22)
        except ConnectionRefusedError:
            return True
        return False

    wait_for(refused, "198.51.100.7:22 refused once the server is gone")
    events = listing(netns)["events"]
    assert isinstance(events, dict) and events["no_socket"] >= 1


def test_the_agent_follows_a_restarted_server(netns: str) -> None:
    """With ``--steer-instance``, the host agent puts a restarted server's new socket
    under the rules its old one had (the kernel emptied the slot when the old closed):
    steering resumes by itself, answered by the new process."""
    netns_mod.run(netns, ["ip", "route", "add", "local", "198.51.100.0/23", "dev", "lo"])

    def start() -> subprocess.Popen[str]:
        proc = netns_mod.popen(
            netns, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    first = start()
    agent = None
    second = None
    try:
        add(netns)
        assert tcp_ask(netns, "198.51.100.7", 22) == b"198.51.100.7:22 hello-22"
        agent = netns_mod.popen(
            netns,
            [
                sys.executable,
                "-m",
                "xdplb.agent",
                "--name",
                "b1",
                "--to",
                "127.0.0.1:9",
                "--interval",
                "0.2",
                "--steer-instance",
                netns,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        first.kill()
        first.wait()
        second = start()  # binds 127.0.0.1:8080 again: a new socket, not in the sockmap

        def answered() -> bytes | None:
            try:
                return tcp_ask(netns, "198.51.100.7", 22)
            except ConnectionRefusedError:
                return None

        assert wait_for(answered, "steering back on the new server") == (
            b"198.51.100.7:22 hello-22"
        )
        assert agent.poll() is None
    finally:
        for proc in (agent, first, second):
            if proc is not None:
                proc.kill()
                proc.wait()
        sk_lookup.detach(netns)
    assert agent.stderr is not None
    assert "127.0.0.1:8080/tcp is back" in agent.stderr.read()


def test_usage_errors(netns: str, server: subprocess.Popen[str]) -> None:
    for args, message in [
        (["--prefix", "198.51.100.7/24"], "invalid --prefix"),
        (["--prefix", PREFIX, "--ports", "http"], "invalid --ports"),
        (["--prefix", PREFIX, "--proto", "sctp"], "invalid --proto"),
    ]:
        result = steer(netns, "add", *args, "--to", "127.0.0.1:8080")
        assert result.exit_code == EXIT_CONFIG, result.output
        assert message in result.output
    result = steer(netns, "add", "--prefix", PREFIX, "--to", "127.0.0.1:9/tcp")
    assert result.exit_code == EXIT_RUNTIME
    assert "no tcp socket is bound at 127.0.0.1:9/tcp" in result.output
    assert not sk_lookup.pin_dir(netns).exists()


def test_the_python_mirror_matches_the_object() -> None:
    """Keys, values and counter names as sk_lookup.py packs them are the object's own
    (read from its BTF), so a change on one side cannot pass unnoticed."""
    btf = object_btf(paths.bpf_object(sk_lookup.OBJECT))
    events = btf.enum_values("skl_event")
    assert {n.removeprefix("SKL_"): v for n, v in events.items() if n != "SKL_EV__MAX"} == {
        e.name: e.value for e in sk_lookup.SkLookupEvent
    }
    for name, layout in [
        ("skl_key", sk_lookup.KEY_LAYOUT),
        ("skl_target", sk_lookup.TARGET_LAYOUT),
    ]:
        t = btf.find(name, Kind.STRUCT)
        assert t.size == layout.size
        offsets = {f.name: (f.offset, f.size) for f in btf.fields(t.id)}
        first = "prefixlen" if name == "skl_key" else "slot"
        assert offsets[first] == (0, 4)
        assert offsets["protocol"] == (4, 1)
        assert offsets["family"] == (5, 1)
        assert offsets["port"] == (6, 2)
        assert offsets["addr[0]"] == (8, 1)
        assert offsets["addr[15]"] == (23, 1)
