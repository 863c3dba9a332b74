"""The load agent: /proc parsing on fake files, the rate maths, the wire format against
untrusted input, and a real UDP round trip on loopback."""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from xdplb.agent import run as agent_run
from xdplb.agent.__main__ import main, parse_target
from xdplb.agent.receiver import ReportReceiver
from xdplb.agent.run import largest, read_chain, run_agent
from xdplb.agent.sampling import (
    CpuTimes,
    Sample,
    Sampler,
    rates,
    read_cpu_times,
    read_passive_opens,
)
from xdplb.agent.serverconns import ServerConns
from xdplb.agent.wire import (
    MAX_CHAIN,
    MAX_CONN_COUNT,
    MAX_CONNS,
    MAX_COUNTER,
    MAX_DATAGRAM,
    MAX_NAME,
    MAX_SEQ,
    WireReport,
    decode_report,
    encode_report,
)
from xdplb.core import paths
from xdplb.core.reports import ConnKey, LoadReport
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.unit

PROC_STAT = """\
cpu  100 20 30 800 50 5 10 5 7 0
cpu0 50 10 15 400 25 2 5 3 7 0
cpu1 50 10 15 400 25 3 5 2 0 0
intr 12345 0 0
ctxt 99
"""

PROC_SNMP = """\
Ip: Forwarding DefaultTTL InReceives
Ip: 2 64 8217
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets
Tcp: 1 200 120000 -1 36 {opens} 0 0
Udp: InDatagrams NoPorts
Udp: 10 0
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_read_cpu_times(tmp_path: Path) -> None:
    # busy = user 100 + nice 20 + system 30 + irq 5 + softirq 10 + steal 5 (guest 7 is
    # already in user); idle = idle 800 + iowait 50.
    assert read_cpu_times(write(tmp_path, "stat", PROC_STAT)) == CpuTimes(busy=170, total=1020)


def test_read_cpu_times_of_an_old_kernel(tmp_path: Path) -> None:
    assert read_cpu_times(write(tmp_path, "stat", "cpu 1 2 3 4\n")) == CpuTimes(6, 10)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cpu0 1 2 3 4\nintr 0\n", "no 'cpu' line"),
        ("cpu 1 2 x 4\n", "'cpu' line is not numbers"),
        ("cpu 1 2 3\n", "'cpu' line has 3 fields, expected at least 4"),
    ],
)
def test_read_cpu_times_refuses(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_cpu_times(write(tmp_path, "stat", text))


def test_read_passive_opens(tmp_path: Path) -> None:
    assert read_passive_opens(write(tmp_path, "snmp", PROC_SNMP.format(opens=4242))) == 4242


def test_read_passive_opens_of_this_machine() -> None:
    assert read_passive_opens() >= 0
    t = read_cpu_times()
    assert 0 <= t.busy <= t.total


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Ip: Forwarding\nIp: 1\n", "no 'Tcp:' header and value lines"),
        ("Tcp: ActiveOpens\nTcp: 3\n", "no 'PassiveOpens'"),
        ("Tcp: ActiveOpens PassiveOpens\nTcp: 3\n", "no 'PassiveOpens'"),
        ("Tcp: ActiveOpens PassiveOpens\nTcp: 3 x\n", "'PassiveOpens' is not a number"),
    ],
)
def test_read_passive_opens_refuses(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_passive_opens(write(tmp_path, "snmp", text))


def sample(at: float, busy: int, total: int, opens: int) -> Sample:
    return Sample(at, CpuTimes(busy, total), opens)


@pytest.mark.parametrize(
    ("desc", "prev", "cur", "expected"),
    [
        ("a quarter busy, 50 opens in 2 s", (0, 100, 400, 10), (2, 200, 800, 110), (0.25, 50.0)),
        ("idle", (0, 100, 400, 10), (1, 100, 500, 10), (0.0, 0.0)),
        ("saturated", (0, 100, 400, 10), (1, 300, 600, 10), (1.0, 0.0)),
        ("no jiffies elapsed", (0, 100, 400, 10), (0.001, 100, 400, 10), (0.0, 0.0)),
        ("counter reset: no activity", (0, 100, 400, 900), (1, 150, 500, 3), (0.5, 0.0)),
    ],
)
def test_rates(
    desc: str,
    prev: tuple[float, int, int, int],
    cur: tuple[float, int, int, int],
    expected: tuple[float, float],
) -> None:
    assert rates(sample(*prev), sample(*cur)) == pytest.approx(expected), desc


def test_rates_refuse_samples_out_of_order() -> None:
    with pytest.raises(ValueError, match="not in time order"):
        rates(sample(2, 0, 0, 0), sample(2, 0, 0, 0))


def test_sampler_gives_rates_from_the_second_sample_on() -> None:
    s = Sampler()
    assert s.feed(sample(0, 0, 100, 0)) is None
    assert s.feed(sample(1, 50, 200, 10)) == pytest.approx((0.5, 10.0))
    assert s.feed(sample(2, 50, 300, 30)) == pytest.approx((0.0, 20.0))


def test_sampler_on_fake_proc_files(tmp_path: Path) -> None:
    stat = write(tmp_path, "stat", "cpu 100 0 0 900 0 0 0 0\n")
    snmp = write(tmp_path, "snmp", PROC_SNMP.format(opens=100))
    s = Sampler()
    assert s.feed(Sample(0.0, read_cpu_times(stat), read_passive_opens(snmp))) is None
    stat.write_text("cpu 400 0 0 1600 0 0 0 0\n")
    snmp.write_text(PROC_SNMP.format(opens=400))
    now = Sample(2.0, read_cpu_times(stat), read_passive_opens(snmp))
    assert s.feed(now) == pytest.approx((0.3, 150.0))


def test_encode_decode_round_trip() -> None:
    r = WireReport("b1.example", 0.123456789, 812.5, 1718000000123)
    data = encode_report(r)
    assert json.loads(data) == {
        "backend": "b1.example",
        "cpu": 0.123456789,
        "rps": 812.5,
        "seq": 1718000000123,
    }
    assert decode_report(data) == r
    assert decode_report(data).received(7.0) == LoadReport("b1.example", 0.123456789, 812.5, 7.0)


def test_decode_accepts_integers_for_numbers() -> None:
    assert decode_report(b'{"backend":"b","cpu":1,"rps":0,"seq":0}') == WireReport("b", 1, 0, 0)


GOOD: dict[str, Any] = {"backend": "b1", "cpu": 0.5, "rps": 10.0, "seq": 1}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe", "datagram: not UTF-8"),
        (b"{", "datagram: not JSON (Expecting property name enclosed in double quotes at 1)"),
        (b"[1, 2]", "datagram: must be a JSON object, got list"),
        (b"x" * (MAX_DATAGRAM + 1), f"datagram: {MAX_DATAGRAM + 1} bytes, more than 8192"),
        (b'{"backend":"b","cpu":NaN,"rps":0,"seq":0}', "datagram: NaN is not a number JSON allows"),
        (json.dumps({**GOOD, "mem": 1}).encode(), "mem: unknown field"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "rps"}).encode(), "rps: missing"),
        (json.dumps({**GOOD, "backend": ""}).encode(), "backend: must be a non-empty string"),
        (json.dumps({**GOOD, "backend": 7}).encode(), "backend: must be a non-empty string"),
        (json.dumps({**GOOD, "backend": "a\nb"}).encode(), "backend: must be at most 253"),
        (json.dumps({**GOOD, "backend": "a" * 254}).encode(), "backend: must be at most 253"),
        (json.dumps({**GOOD, "cpu": 1.5}).encode(), "cpu: must be a finite number in 0.0..1.0"),
        (json.dumps({**GOOD, "cpu": "0.5"}).encode(), "cpu: must be a number, got '0.5'"),
        (json.dumps({**GOOD, "cpu": True}).encode(), "cpu: must be a number, got True"),
        (b'{"backend":"b","cpu":0.5,"rps":1e999,"seq":0}', "rps: must be a finite number"),
        (json.dumps({**GOOD, "rps": -1}).encode(), "rps: must be a finite number in 0.0..inf"),
        (json.dumps({**GOOD, "seq": 1.0}).encode(), "seq: must be an integer"),
        (json.dumps({**GOOD, "seq": -1}).encode(), "seq: must be an integer"),
        (json.dumps({**GOOD, "seq": 2**64}).encode(), "seq: must be an integer"),
    ],
)
def test_decode_refuses_malformed_datagrams(data: bytes, message: str) -> None:
    with pytest.raises(ValueError) as e:
        decode_report(data)
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("198.18.0.2:19700", ("198.18.0.2", 19700)),
        ("198.18.0.2", ("198.18.0.2", 19700)),
        ("lb.example:1", ("lb.example", 1)),
        ("[fd78:6470:6c62::2]:19701", ("fd78:6470:6c62::2", 19701)),
        ("[fd78:6470:6c62::2]", ("fd78:6470:6c62::2", 19700)),
        ("fd78:6470:6c62::2", ("fd78:6470:6c62::2", 19700)),
    ],
)
def test_parse_target(text: str, expected: tuple[str, int]) -> None:
    assert parse_target(text) == expected


@pytest.mark.parametrize("text", ["", ":1", "h:0", "h:65536", "h:x", "[::1", "[::1]x"])
def test_parse_target_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=r"^--to: expected"):
        parse_target(text)


def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--name", "b1", "--to", "h:x"])
    assert e.value.code == 2
    assert main(["--name", "", "--to", "127.0.0.1:9"]) == 2
    assert "backend: must be a non-empty string" in capsys.readouterr().err


@pytest.fixture
def receiver() -> Any:
    with ReportReceiver(("127.0.0.1", 0)) as r:
        yield r


def send(receiver: ReportReceiver, *datagrams: bytes) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for d in datagrams:
            s.sendto(d, receiver.address)


def poll_until(receiver: ReportReceiver, count: int, timeout: float = 5.0) -> list[LoadReport]:
    """Everything received once ``count`` reports are in (fails after ``timeout``)."""
    out: list[LoadReport] = []

    def received() -> list[LoadReport]:
        out.extend(receiver.poll())
        return out

    return wait_for(
        received, f"{count} reports", until=lambda got: len(got) >= count, timeout=timeout
    )


def test_receiver_poll_does_not_block(receiver: ReportReceiver) -> None:
    # Nothing is waiting: a blocking poll would never return.
    done = threading.Thread(target=receiver.poll, daemon=True)
    done.start()
    done.join(timeout=10)
    assert not done.is_alive(), "poll() blocked on an empty socket"
    assert receiver.poll() == []


def test_receiver_counts_and_drops_malformed_and_reordered(receiver: ReportReceiver) -> None:
    def report(seq: int, backend: str = "b1") -> bytes:
        return encode_report(WireReport(backend, 0.5, 1.0, seq))

    send(
        receiver,
        b"garbage",
        report(100),
        report(100),  # duplicate
        report(99),  # late
        report(101),
        report(12, "b2"),
        report(0),  # far behind (more than REORDER_WINDOW): b1's agent started over
        b'{"backend":"b1"}',
    )
    got = poll_until(receiver, 4)
    assert [r.backend for r in got] == ["b1", "b1", "b2", "b1"]
    # Until all eight datagrams are accounted for; none of the rest is a report.
    more: list[LoadReport] = []

    def counts() -> tuple[int, int, int]:
        more.extend(receiver.poll())
        st = receiver.stats
        return st.received, st.malformed, st.reordered

    taken = wait_for(
        counts,
        "all eight datagrams taken in (received, malformed, reordered)",
        until=lambda c: sum(c) >= 8,
    )
    assert taken == (4, 2, 2)
    assert more == []


def test_receiver_stamps_reports_with_its_clock() -> None:
    with ReportReceiver(("127.0.0.1", 0), clock=lambda: 42.0) as r:
        send(r, encode_report(WireReport("b1", 0.25, 3.0, 1)))
        assert poll_until(r, 1) == [LoadReport("b1", 0.25, 3.0, 42.0)]


def test_agent_to_receiver_over_loopback(receiver: ReportReceiver, tmp_path: Path) -> None:
    stat = write(tmp_path, "stat", "cpu 100 0 0 900 0 0 0 0\n")
    snmp = write(tmp_path, "snmp", PROC_SNMP.format(opens=0))
    stop = threading.Event()
    sent: list[int] = []
    agent = threading.Thread(
        target=lambda: sent.append(
            run_agent(
                "b1", receiver.address, 0.05, stop, proc_stat=stat, proc_snmp=snmp, seq_start=7
            )
        )
    )
    agent.start()
    try:
        got = poll_until(receiver, 3)
    finally:
        stop.set()
        agent.join(timeout=1.0)
    assert not agent.is_alive()
    assert len(got) >= 3
    assert all(r.backend == "b1" and r.cpu == 0.0 and r.rps == 0.0 for r in got)
    assert receiver.stats.malformed == 0
    assert sent and sent[0] >= len(got)


def test_agent_reports_what_it_measured(receiver: ReportReceiver, tmp_path: Path) -> None:
    # The fake counters advance by a fixed step at each read: 30% busy, 20 opens per read.
    stat = tmp_path / "stat"
    snmp = tmp_path / "snmp"
    reads = {"n": 0}

    def replace(path: Path, text: str) -> None:
        # Atomically, as /proc reads are: the agent never sees a half-written file.
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def advance() -> None:
        n = reads["n"] = reads["n"] + 1
        replace(stat, f"cpu {30 * n} 0 0 {70 * n} 0 0 0 0\n")
        replace(snmp, PROC_SNMP.format(opens=20 * n))

    advance()
    stop = threading.Event()

    def ticker() -> None:  # moves the counters between the agent's samples
        while not stop.wait(0.02):
            advance()

    agent = threading.Thread(
        target=run_agent,
        args=("b7", receiver.address, 0.2, stop),
        kwargs={"proc_stat": stat, "proc_snmp": snmp},
    )
    ticking = threading.Thread(target=ticker)
    ticking.start()
    agent.start()
    try:
        got = poll_until(receiver, 2)
    finally:
        stop.set()
        agent.join(timeout=1.0)
        ticking.join(timeout=1.0)
    assert len(got) >= 2
    for r in got:
        assert r.backend == "b7"
        assert r.cpu == pytest.approx(0.3)
        assert r.rps == pytest.approx(1000.0, rel=0.5)  # 20 opens per ~20 ms tick


# -- connection counts and host_tc counters ------------------------------------------------

V4 = ipaddress.IPv4Address("198.18.100.1")
V6 = ipaddress.IPv6Address("fd78:6470:6c62:100::1")


def test_encode_decode_conns_and_chain() -> None:
    r = WireReport(
        "198.18.0.11",
        0.5,
        10.0,
        3,
        {(V6, 443): 1, (V4, 80): 3, (V4, 7): 2},
        chain={"pass": 1200, "forward": 12},
    )
    data = encode_report(r)
    # Entries sorted: IPv4 before IPv6, then by address and port.
    assert json.loads(data) == {
        "backend": "198.18.0.11",
        "cpu": 0.5,
        "rps": 10.0,
        "seq": 3,
        "conns": [
            ["198.18.100.1", 7, 2],
            ["198.18.100.1", 80, 3],
            ["fd78:6470:6c62:100::1", 443, 1],
        ],
        "chain": {"pass": 1200, "forward": 12},
    }
    back = decode_report(data)
    assert back == r
    got = back.received(9.0)
    assert got.conns == {(V4, 80): 3, (V4, 7): 2, (V6, 443): 1}
    assert got.chain == {"pass": 1200, "forward": 12}
    assert not got.conns_truncated and got.at == 9.0


def test_an_agent_that_counts_nothing_sends_an_empty_list() -> None:
    # Empty is "no connection open"; absent is "not counted" (an older agent).
    empty = WireReport("b1", 0.5, 1.0, 1, {})
    assert json.loads(encode_report(empty))["conns"] == []
    assert decode_report(encode_report(empty)).received(0.0).conns == {}
    old = decode_report(b'{"backend":"b1","cpu":0.5,"rps":1,"seq":1}')
    assert old.conns is None and old.chain is None and not old.conns_truncated
    assert old.received(0.0) == LoadReport("b1", 0.5, 1, 0.0)


def test_decode_reads_ipv4_mapped_addresses_as_ipv4() -> None:
    doc = {**GOOD, "conns": [["::ffff:198.18.100.1", 80, 4]]}
    assert decode_report(json.dumps(doc).encode()).conns == {(V4, 80): 4}
    mapped = ipaddress.IPv6Address("::ffff:198.18.100.1")
    assert WireReport("b", 0.0, 0.0, 0, {(mapped, 80): 4}).conns == {(V4, 80): 4}


def test_decode_keeps_the_truncation_mark() -> None:
    doc = {**GOOD, "conns": [["198.18.100.1", 80, 4]], "conns_truncated": True}
    r = decode_report(json.dumps(doc).encode())
    assert r.conns_truncated and r.received(1.0).conns_truncated
    assert json.loads(encode_report(r))["conns_truncated"] is True


def with_(**fields: Any) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (with_(conns={"198.18.100.1": 1}), "conns: must be a list, got dict"),
        (with_(conns=[["198.18.100.1", 80]]), "conns[0]: must be [address, port, count]"),
        (with_(conns=[[1, 80, 1]]), "conns[0]: address must be an IP address, got '1'"),
        (with_(conns=[["b1", 80, 1]]), "conns[0]: address must be an IP address, got 'b1'"),
        (with_(conns=[["198.18.100.256", 80, 1]]), "conns[0]: address must be an IP address"),
        (with_(conns=[["fe80::1%eth0", 80, 1]]), "conns[0]: address must be an IP address"),
        (with_(conns=[["198.18.100.1", 0, 1]]), "conns[0] port: must be an integer in 1..65535"),
        (with_(conns=[["198.18.100.1", 65536, 1]]), "conns[0] port: must be an integer in 1.."),
        (with_(conns=[["198.18.100.1", "80", 1]]), "conns[0] port: must be an integer in 1.."),
        (with_(conns=[["198.18.100.1", True, 1]]), "conns[0] port: must be an integer in 1.."),
        (
            with_(conns=[["198.18.100.1", 80, 0]]),
            "conns[0] count: must be an integer in 1..4294967295",
        ),
        (with_(conns=[["198.18.100.1", 80, 2**32]]), "conns[0] count: must be an integer in 1.."),
        (with_(conns=[["198.18.100.1", 80, 1.0]]), "conns[0] count: must be an integer in 1.."),
        (
            with_(
                conns=[["198.18.100.1", 80, 1], ["198.18.100.2", 80, 1], ["198.18.100.1", 80, 2]]
            ),
            "conns[2]: 198.18.100.1 port 80 given twice",
        ),
        (
            with_(conns=[["198.18.100.1", 80, 1], ["::ffff:198.18.100.1", 80, 2]]),
            "conns[1]: 198.18.100.1 port 80 given twice",
        ),
        (
            with_(conns=[["198.18.100.1", p, 1] for p in range(1, MAX_CONNS + 2)]),
            "conns: 65 entries, more than 64",
        ),
        (with_(conns=[], conns_truncated="yes"), "conns_truncated: must be true or false"),
        (with_(conns_truncated=True), "conns_truncated: set without conns"),
        (with_(chain=[1, 2]), "chain: must be an object, got [1, 2]"),
        (with_(chain=None), "chain: must be an object, got null"),
        (with_(chain={"Forward": 1}), "chain: 'Forward' is not a counter name"),
        (with_(chain={"": 1}), "chain: '' is not a counter name"),
        (
            with_(chain={"forward": -1}),
            "chain.forward: must be an integer in 0..18446744073709551615",
        ),
        (with_(chain={"forward": 2**64}), "chain.forward: must be an integer in 0.."),
        (with_(chain={"forward": "1"}), "chain.forward: must be an integer in 0.."),
        (
            with_(chain={f"e{i}": 0 for i in range(MAX_CHAIN + 1)}),
            "chain: 33 counters, more than 32",
        ),
    ],
)
def test_decode_refuses_malformed_conns_and_chain(data: bytes, message: str) -> None:
    with pytest.raises(ValueError) as e:
        decode_report(data)
    assert str(e.value).startswith(message), str(e.value)


def test_the_largest_valid_report_fits_a_datagram() -> None:
    top = ipaddress.IPv6Address("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")
    r = WireReport(
        "\U0001d538" * MAX_NAME,  # printable, 4 bytes in UTF-8
        0.12345678901234568,
        1.2345678901234567e300,
        MAX_SEQ,
        {(top - i, 65535): MAX_CONN_COUNT for i in range(MAX_CONNS)},
        True,
        {f"{chr(ord('a') + i % 26)}{i:031d}": MAX_COUNTER for i in range(MAX_CHAIN)},
    )
    data = encode_report(r)
    assert 6000 < len(data) <= MAX_DATAGRAM
    assert decode_report(data) == r


def key(i: int) -> ConnKey:
    return (ipaddress.IPv4Address("198.18.100.1") + i, 80)


def test_largest_keeps_the_largest_entries_and_says_some_were_left_out() -> None:
    conns = {key(i): i + 1 for i in range(MAX_CONNS)}
    assert largest(conns) == (conns, False)
    conns[key(MAX_CONNS)] = 1000
    kept, truncated = largest(conns)
    assert truncated and len(kept) == MAX_CONNS
    assert kept[key(MAX_CONNS)] == 1000 and key(0) not in kept  # the one with 1 went
    # Ties go by address: the same input always gives the same report.
    ties = {key(i): 5 for i in range(4)}
    assert largest(ties, limit=2) == ({key(0): 5, key(1): 5}, True)


def test_read_chain_without_pins_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "BPFFS_ROOT", tmp_path)
    (tmp_path / "host").mkdir()  # the instance's directory, but no host_events pinned
    assert read_chain("host") is None
    assert read_chain("nothing-here") is None


def run_for_reports(
    receiver: ReportReceiver, tmp_path: Path, count: int, **kw: Any
) -> list[LoadReport]:
    stat = write(tmp_path, "stat", "cpu 100 0 0 900 0 0 0 0\n")
    snmp = write(tmp_path, "snmp", PROC_SNMP.format(opens=0))
    stop = threading.Event()
    agent = threading.Thread(
        target=run_agent,
        args=("198.18.0.11", receiver.address, 0.05, stop),
        kwargs={"proc_stat": stat, "proc_snmp": snmp, **kw},
    )
    agent.start()
    try:
        return poll_until(receiver, count)
    finally:
        stop.set()
        agent.join(timeout=1.0)


def test_agent_reports_the_counts_at_each_report(receiver: ReportReceiver, tmp_path: Path) -> None:
    counts = iter([{(V4, 80): 3}, {(V4, 80): 1, (V6, 7): 2}, {}])
    got = run_for_reports(
        receiver, tmp_path, 3, count_conns=lambda: ServerConns(next(counts, {})), host_instance=None
    )
    assert [r.conns for r in got[:3]] == [{(V4, 80): 3}, {(V4, 80): 1, (V6, 7): 2}, {}]
    assert all(r.chain is None and not r.conns_truncated for r in got)


def test_agent_sends_the_largest_counts_when_there_are_too_many(
    receiver: ReportReceiver, tmp_path: Path
) -> None:
    many = {key(i): i + 1 for i in range(MAX_CONNS + 10)}
    got = run_for_reports(receiver, tmp_path, 1, count_conns=lambda: ServerConns(many))
    assert got and got[0].conns_truncated
    assert got[0].conns is not None and len(got[0].conns) == MAX_CONNS
    assert min(got[0].conns.values()) == 11


def test_agent_reports_host_tc_counters_when_readable(
    receiver: ReportReceiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = iter([{"pass": 5, "forward": 1}, OSError(13, "Permission denied"), None])

    def fake_read_chain(instance: str) -> dict[str, int] | None:
        assert instance == "lab-b1"
        r = next(reads, None)
        if isinstance(r, OSError):
            raise r
        return r

    monkeypatch.setattr(agent_run, "read_chain", fake_read_chain)
    got = run_for_reports(
        receiver, tmp_path, 3, count_conns=lambda: ServerConns({}), host_instance="lab-b1"
    )
    # A failed read is a report without the field, not a dead agent.
    assert [r.chain for r in got[:3]] == [{"pass": 5, "forward": 1}, None, None]


def test_the_largest_valid_v2_report_fits_a_datagram() -> None:
    top = ipaddress.IPv6Address("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff")
    tcp = {(top - i, 65535): MAX_CONN_COUNT for i in range(MAX_CONNS)}  # longer than udp
    r = WireReport(
        "\U0001d538" * MAX_NAME,
        0.12345678901234568,
        1.2345678901234567e300,
        MAX_SEQ,
        tcp,
        True,
        {f"{chr(ord('a') + i % 26)}{i:031d}": MAX_COUNTER for i in range(MAX_CHAIN)},
        {k: MAX_CONN_COUNT - 1 for k in tcp},
        {},
    )
    data = encode_report(r)
    assert r.version == 2 and 7000 < len(data) <= MAX_DATAGRAM
    assert decode_report(data) == r


def test_a_v2_report_carries_inactive_and_udp_counts() -> None:
    vip = ipaddress.ip_address("198.18.100.1")
    r = WireReport(
        "198.18.0.11", 0.5, 10.0, 7, {(vip, 80): 5}, False, None, {(vip, 80): 2}, {(vip, 53): 3}
    )
    data = encode_report(r)
    doc = json.loads(data)
    assert doc["v"] == 2
    assert doc["conns"] == [["198.18.100.1", 80, 5, 2]]
    assert doc["udp"] == [["198.18.100.1", 53, 3]]
    got = decode_report(data).received(1.0)
    assert got.conns == {(vip, 80): 5} and got.conns_inactive == {(vip, 80): 2}
    assert got.udp == {(vip, 53): 3}
    # A version-1 report (an agent from before) still reads, its new counts unknown.
    old = decode_report(b'{"backend":"b","cpu":0,"rps":0,"seq":1,"conns":[["198.18.100.1",80,5]]}')
    assert old.version == 1 and old.conns == {(vip, 80): 5}
    assert old.conns_inactive is None and old.udp is None


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"v": 3, "conns": []}, "v: version 3 is not one this receiver reads (1, 2)"),
        ({"v": True, "conns": []}, "v: version True is not one this receiver reads"),
        ({"udp": []}, "udp: a version-1 report has none (send v: 2)"),
        ({"v": 2}, "conns: missing (a version-2 report counts connections)"),
        (
            {"v": 2, "conns": [["198.18.100.1", 80, 5]]},
            "conns[0]: must be [address, port, count, inactive]",
        ),
        (
            {"v": 2, "conns": [["198.18.100.1", 80, 5, 6]]},
            "conns[0] inactive: must be an integer in 0..5, got 6",
        ),
        (
            {"v": 2, "conns": [], "udp": [["198.18.100.1", 0, 1]]},
            "udp[0] port: must be an integer in 1..65535",
        ),
        (
            {
                "v": 2,
                "conns": [[f"198.18.100.{i}", 80, 1, 0] for i in range(40)],
                "udp": [[f"198.18.101.{i}", 53, 1] for i in range(40)],
            },
            "udp: with conns, more than 64 entries",
        ),
    ],
)
def test_decode_refuses_a_bad_v2_report(doc: dict[str, object], message: str) -> None:
    base = {"backend": "b", "cpu": 0, "rps": 0, "seq": 1}
    with pytest.raises(ValueError) as e:
        decode_report(json.dumps(base | doc).encode())
    assert str(e.value).startswith(message), str(e.value)
