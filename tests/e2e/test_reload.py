"""Hot reload under load: 200 streaming connections live through reloads by SIGHUP and by
the API (weights, a new backend, a new VIP); a configuration that fails validation
changes nothing and names the field; no packet is dropped meanwhile. A reload that
would drop a change made through the API (an ACL rule) is refused, by SIGHUP, by the
file changing and by ``xdplb reload``, until forced; the log names what it kept."""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.cli.args import EXIT_CONFIG, EXIT_OK
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import EchoStream, ExchangeError
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
STREAMS = 200


def vips(lab: Lab, weights: dict[str, int], *, extra: bool = False) -> list[dict[str, Any]]:
    backends = [{"address": str(lab.addr(b)), "weight": w} for b, w in weights.items()]
    out = [{"address": VIP, "port": 7, "backends": backends}]
    if extra:
        out.append({"address": VIP, "port": 80, "backends": backends})
    return out


@pytest.fixture
def lb(lab: Lab, tmp_path: Path) -> Iterator[LbNode]:
    procs = lab.start_servers()
    node = LbNode(lab, tmp_path, vips(lab, {"b1": 1, "b2": 1}))
    node.start()
    yield node
    node.destroy()
    for p in procs:
        p.kill()
        p.wait()


class Streams:
    """``STREAMS`` echo connections, exchanging bytes round-robin in a thread."""

    def __init__(self, lab: Lab) -> None:
        ns = lab.ns("client")
        self.streams = [EchoStream.open(ns, VIP, 7) for _ in range(STREAMS)]
        self.broken: list[str] = []
        self._dead: set[int] = set()
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, s in enumerate(self.streams):
                if i in self._dead:
                    continue
                try:
                    s.exchange(512)
                except ExchangeError as e:
                    self._dead.add(i)
                    self.broken.append(str(e))
            self.rounds += 1

    def __enter__(self) -> Streams:
        self._thread.start()
        return self

    def wait_rounds(self, n: int = 2) -> None:
        """Until every stream has exchanged bytes ``n`` more times."""
        target = self.rounds + n
        wait_for(
            lambda: self.rounds,
            f"{n} more rounds of exchanges (to round {target})",
            until=lambda rounds: rounds >= target or not self._thread.is_alive(),
            interval=0.01,
            detail=lambda: f"broken: {self.broken}",
        )
        assert self._thread.is_alive(), "the streams' thread died"

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.streams:
            s.close()


def drops(node: LbNode) -> int:
    with node.maps() as maps:
        return sum(maps.counters(exact_conns=False).drops.values())


def test_reloads_under_load_break_nothing(lab: Lab, lb: LbNode) -> None:
    before = drops(lb)
    with Streams(lab) as streams:
        streams.wait_rounds()
        assert {s.backend for s in streams.streams} == {"b1", "b2"}
        # SIGHUP: weights change, a backend joins, a VIP appears.
        lb.reload(vips(lab, {"b1": 2, "b2": 1}))
        streams.wait_rounds()
        lb.reload(vips(lab, {"b1": 2, "b2": 1, "b3": 1}, extra=True))
        streams.wait_rounds()
        # A configuration that fails validation changes nothing.
        bad = lb.config_path.read_text().replace("weight: 2", "weight: 70000")
        lb.config_path.write_text(bad)
        with lb.api() as api:
            resp = api.post("/api/v1/reload")
            assert resp.status_code == 422, resp.text
            assert resp.json()["field"] == "vips[0].backends[0].weight"
            # Through the API: the running configuration with b3 weighted 3.
            cfg = api.get("/api/v1/config").json()
            cfg["vips"][0]["backends"][2]["weight"] = 3
            resp = api.put("/api/v1/config", json=cfg)
            assert resp.status_code == 200, resp.text
            assert resp.json()["runtime_changes"] is True
            streams.wait_rounds()
            st = api.get("/api/v1/status").json()
        (vip7,) = [v for v in st["vips"] if v["port"] == 7]
        assert [b["weight"] for b in vip7["backends"]] == [2, 1, 3]
        assert abs(vip7["backends"][2]["table_share"] - 0.5) < 0.01
        streams.wait_rounds()
    assert streams.broken == []
    assert drops(lb) == before


DENY = "acl: deny 203.0.113.0/24 (added through the API) would be dropped"


def log_lines(node: LbNode, pattern: str) -> list[str]:
    """The daemon's log lines (text format: time, level, logger, message) that match."""
    return [ln for ln in node.log_path.read_text().splitlines() if re.search(pattern, ln)]


def test_a_reload_that_would_drop_an_api_change_is_refused_until_forced(
    lab: Lab, lb: LbNode
) -> None:
    b1 = lab.addr("b1")
    done = lb.cli("acl", "deny", "203.0.113.0/24")
    assert done.returncode == EXIT_OK, done.stderr
    # The change is logged with who made it (the CLI's uid and pid) and what it was.
    (line,) = log_lines(lb, r"change by ")
    assert re.search(
        r" INFO xdplb\.control\.runtime change by uid 0 pid \d+ \(unix socket, no token\): "
        r"acl: \+ deny 203\.0\.113\.0/24 who=",
        line,
    ), line
    with lb.api() as api:
        # The file changes (b1's weight): the daemon sees it and refuses to apply it.
        lb.write(vips(lab, {"b1": 2, "b2": 1}))
        st = wait_for(
            lambda: api.get("/api/v1/status").json(),
            "the refused reload in the status",
            until=lambda st: st["last_reload_error"] is not None,
            detail=lb.log_tail,
        )
        assert DENY in st["last_reload_error"]
        assert [b["weight"] for b in st["vips"][0]["backends"]] == [1, 1]  # still serving
        assert api.get("/api/v1/acl").json()["deny"] == ["203.0.113.0/24"]
        # SIGHUP: refused too, at WARNING, naming what it kept.
        assert lb.proc is not None
        lb.proc.send_signal(signal.SIGHUP)
        (line,) = wait_for(
            lambda: log_lines(lb, r"reload \(SIGHUP\)"),
            "the SIGHUP's refusal in the log",
            until=lambda lines: lines,
            detail=lb.log_tail,
        )
        assert " WARNING xdplb.control.runtime reload (SIGHUP): reload refused, " in line
        assert DENY in line
        (line,) = log_lines(lb, r"reload \(the file changed\)")
        assert " WARNING " in line and DENY in line
        # The CLI: exit 2 with the API's 409, naming it; --force applies the file.
        done = lb.cli("reload")
        assert done.returncode == EXIT_CONFIG, done.stdout
        assert done.stderr.startswith("error 409: reload refused, the running configuration")
        assert DENY in done.stderr
        assert api.get("/api/v1/acl").json()["deny"] == ["203.0.113.0/24"]
        before = len(lb.log_path.read_text().splitlines())
        done = lb.cli("reload", "--force")
        assert done.returncode == EXIT_OK, done.stderr
        assert done.stdout.startswith("reloaded: ")
        lb.wait_applied(10)  # the maps hold the file's configuration
        st = api.get("/api/v1/status").json()
        assert st["last_reload_error"] is None and st["runtime_changes"] is False
        assert [b["weight"] for b in st["vips"][0]["backends"]] == [2, 1]
        assert api.get("/api/v1/acl").json()["deny"] == []
    # The forced reload logged what it dropped and its diff, naming who asked; messages
    # end where the fields (who=...) begin.
    forced = lb.log_path.read_text().splitlines()[before:]
    who = r"uid 0 pid \d+ \(unix socket, no token\)"
    got = [re.sub(r" who=.*", "", ln.split(" xdplb.control.runtime ", 1)[1]) for ln in forced]
    assert [re.sub(who, "WHO", m) for m in got] == [
        f"reload (WHO, forced): {DENY}",
        "reload (WHO): acl: - deny 203.0.113.0/24",
        f"reload (WHO): VIP {VIP}:7/tcp: backend {b1} weight 1 -> 2",
    ], forced
    assert " WARNING " in forced[0] and " INFO " in forced[2]
    assert f"vip={VIP}:7/tcp backend={b1}" in forced[2]
