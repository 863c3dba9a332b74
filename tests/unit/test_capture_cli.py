"""The capture vocabulary (xdplb.core.capture), the pcapng writer and `xdplb capture`'s
refusals, without a kernel: pcapng is read back by scapy, records are built as lb_xdp
lays them out (abi.CaptureRec)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether
from scapy.utils import PcapNgReader
from typer.testing import CliRunner

from xdplb.cli.app import app
from xdplb.core import abi, pcapng
from xdplb.core.capture import CaptureSettings, Record, describe_frame, parse_points

pytestmark = pytest.mark.unit

FRAME = bytes(
    Ether(src="02:c1:00:00:00:01", dst="02:1b:00:00:00:02")
    / IP(src="198.18.5.1", dst="198.18.100.1")
    / TCP(sport=40000, dport=80, flags="S")
)


def raw_record(point: int, reason: int, frame: bytes, **kw: object) -> bytes:
    rec = abi.CaptureRec(ts_ns=123, point=point, reason=reason, ifindex=2, pkt_len=len(frame), **kw)
    rec.cap_len = len(frame)
    rec.data[: len(frame)] = frame
    return bytes(rec)


def test_points_parse_and_refuse_unknown_names() -> None:
    assert parse_points("drop,forward") == abi.CapPoint.DROP | abi.CapPoint.FORWARD
    with pytest.raises(ValueError, match="unknown capture point 'drops'"):
        parse_points("drop,drops")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"sample": 0}, "sample: 0 is not in 1..4294967295"),
        ({"snap_len": 257}, "snap_len: 257 is not in 1..256"),
        ({"max_per_sec": -1}, "max_per_sec: -1 is not in 0..4294967295"),
    ],
)
def test_settings_refuse_bad_values(kw: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CaptureSettings(abi.CapPoint.DROP, **kw)


def test_settings_make_the_config_value() -> None:
    dst = ipaddress.ip_address("fd78:6470:6c62:100::1")
    cfg = CaptureSettings(abi.CapPoint.PASS, sample=1000, dst=dst).abi_value(77)
    assert (cfg.expires_ns, cfg.points, cfg.sample, cfg.max_per_sec, cfg.snap_len) == (
        77, abi.CAP_PASS, 1000, 1000, 256
    )  # fmt: skip
    assert (tuple(cfg.dst), cfg.dst_family) == (abi.addr_words(dst), 6)


def test_records_decode_with_their_reason_and_backend() -> None:
    drop = Record.from_bytes(raw_record(abi.CAP_DROP, abi.DropReason.ACL, FRAME))
    assert (drop.reason_name, drop.frame, drop.backend) == ("ACL", FRAME, None)
    assert drop.comment() == "point=drop reason=ACL"
    be = ipaddress.ip_address("198.18.0.12")
    fwd = Record.from_bytes(
        raw_record(
            abi.CAP_FORWARD,
            abi.CapDecision.CONN_HIT,
            FRAME,
            vip_id=3,
            be_id=2,
            be_addr=abi.addr_words(be),
            be_family=4,
            nhops=1,
        )
    )
    assert fwd.comment({3: "198.18.100.1:80/tcp"}) == (
        "point=forward reason=CONN_HIT vip=198.18.100.1:80/tcp vip_id=3 backend=198.18.0.12 "
        "backend_id=2 hops=1"
    )
    assert fwd.summary().startswith("forward CONN_HIT       198.18.5.1:40000 > 198.18.100.1:80 tcp")
    assert fwd.summary().endswith("-> backend 198.18.0.12 (id 2)")
    with pytest.raises(ValueError, match="capture record of 10 bytes"):
        Record.from_bytes(b"x" * 10)


def test_describe_frame_says_what_stops_it() -> None:
    assert describe_frame(FRAME[:10]) == "runt (10 bytes)"
    assert describe_frame(FRAME[:20]) == "IPv4 (malformed)"
    assert describe_frame(bytes(Ether(type=0x0806) / (b"x" * 28))) == "ethertype 0x0806"


def test_pcapng_reads_back_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "c.pcapng"
    with path.open("wb") as f:
        f.write(pcapng.section_header())
        f.write(pcapng.interface("eth0", 256))
        f.write(pcapng.packet(0, 1_700_000_000_123_456_789, FRAME, len(FRAME), "point=drop x"))
        f.write(pcapng.packet(0, 1_700_000_001_000_000_000, FRAME[:20], 900, ""))
    with PcapNgReader(str(path)) as r:
        pkts = list(r)
    assert [bytes(p) for p in pkts] == [FRAME, FRAME[:20]]
    assert pkts[0].comments == [b"point=drop x"]
    assert pkts[0].time == pytest.approx(1_700_000_000.123456789)
    assert pkts[1].wirelen == 900
    assert pkts[0][TCP].dport == 80


def test_cli_refuses_bad_options_and_a_missing_instance() -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["capture", "-i", "nope-capture", "--points", "dorp"])
    assert res.exit_code == 2
    assert "unknown capture point 'dorp'" in res.output
    res = runner.invoke(app, ["capture", "-i", "nope-capture", "--vip", "198.18.100"])
    assert res.exit_code == 2
    assert "invalid --vip: '198.18.100'" in res.output
    res = runner.invoke(app, ["capture", "-i", "nope-capture", "--seconds", "0"])
    assert (res.exit_code, "invalid --seconds" in res.output) == (2, True)
    res = runner.invoke(app, ["capture", "-i", "nope-capture-instance"])
    assert res.exit_code == 3
    assert "instance nope-capture-instance is not running" in res.output
