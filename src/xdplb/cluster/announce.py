"""When this node announces its VIPs (docs/cluster.md, "Announcing").

The node announces only while its self-check passes; a failure withdraws at once, and a
recovery announces again only after the check has passed for ``hold_down`` seconds (a
flapping node would otherwise move flows back and forth). ``withdraw`` at shutdown, then
``close``: BIRD ends its sessions.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from xdplb.cluster.bird import Bird, BirdError, Peer, Timers, node_config, static_routes
from xdplb.cluster.selfcheck import set_interface_down
from xdplb.config.schema import BgpConfig
from xdplb.control.status import BgpSession, BgpStatus
from xdplb.core.addresses import IPAddress

log = logging.getLogger("xdplb.cluster")


class Announcer:
    """The node's BGP speaker (BIRD, our child) and what it announces."""

    def __init__(self, cfg: BgpConfig, router_id: IPAddress, directory: Path) -> None:
        self.cfg = cfg
        self.router_id = router_id
        self.bird = Bird(directory, binary=cfg.bird)
        self._announced: frozenset[IPAddress] = frozenset()
        self._failing: str | None = "not checked yet"
        self._passing_since: float | None = None
        self._ever_announced = False
        self._stopped = False
        self.checks = 0
        self.check_failures = 0
        self._sessions: tuple[float, list[BgpSession]] | None = None

    def _text(self) -> str:
        return node_config(
            router_id=self.router_id,  # type: ignore[arg-type]
            asn=self.cfg.asn,
            peers=[Peer(p.address, p.asn, p.bfd) for p in self.cfg.peers],
            timers=Timers(self.cfg.hold_time, self.cfg.bfd_interval_ms, self.cfg.bfd_multiplier),
            vips_dir=self.bird.dir,
            log_file=self.bird.log,
        )

    def _write_routes(self, vips: Iterable[IPAddress]) -> None:
        vips = list(vips)
        for family in (4, 6):
            (self.bird.dir / f"vips{family}.conf").write_text(static_routes(vips, family))

    def start(self) -> None:
        """Start BIRD announcing nothing (the sessions come up meanwhile)."""
        self.bird.dir.mkdir(parents=True, exist_ok=True)
        self._write_routes(())
        self.bird.start(self._text())

    def reconfigure(self, cfg: BgpConfig, router_id: IPAddress) -> None:
        """A reload's new bgp section: BIRD reconfigured (sessions kept where unchanged)."""
        self.cfg, self.router_id = cfg, router_id
        self.bird.configure(self._text())

    def _set(self, vips: frozenset[IPAddress]) -> None:
        if vips == self._announced:
            return
        self._write_routes(vips)
        self.bird.configure()
        added, gone = vips - self._announced, self._announced - vips
        self._announced = vips
        if added:
            log.info("announcing %s", ", ".join(sorted(map(str, added))))
        if gone:
            log.info("withdrew %s", ", ".join(sorted(map(str, gone))))

    def update(
        self,
        failure: str | None,
        vips: Iterable[IPAddress],
        now: float,
        *,
        waiting: str | None = None,
    ) -> None:
        """The self-check's verdict (``failure``: None when it passed) and the VIPs the
        node serves: withdraw at once on a failure, announce after ``hold_down`` of
        passing (at once the first time). ``waiting``: why the node may not announce yet
        though nothing failed (session sync's copies not all taken): nothing is
        announced meanwhile, and it is logged as a wait, not as a failure."""
        if self._stopped:
            return  # withdrawn for good: the daemon is stopping
        self.checks += 1
        if failure is None and waiting is not None:
            if waiting != self._failing:
                if self._ever_announced:
                    log.warning("not announcing: %s", waiting)
                else:
                    log.info("not announcing yet: %s", waiting)
            self._failing, self._passing_since = waiting, None
            self._set(frozenset())
            return
        if failure is not None:
            self.check_failures += 1
            if failure != self._failing:  # once per reason, the first one included
                log.error("self-check failed: %s: withdrawing every VIP", failure)
            self._failing, self._passing_since = failure, None
            self._set(frozenset())
            return
        if self._passing_since is None:
            self._passing_since = now
        if self._ever_announced and now - self._passing_since < self.cfg.hold_down:
            return
        if self._failing is not None and self._ever_announced:
            log.info("self-check passing for %.1f s: announcing again", now - self._passing_since)
        self._failing = None
        self._ever_announced = True
        self._set(frozenset(vips))

    @property
    def passing(self) -> bool:
        """The self-check passed last (the node announces, or will after its hold-down)."""
        return self._failing is None

    @property
    def announced(self) -> list[str]:
        return sorted(map(str, self._announced))

    def withdraw(self, why: str) -> None:
        """Stop announcing for good (the daemon stops): later checks change nothing (the
        check task still runs during the drain, and would announce again)."""
        self._failing = why
        self._stopped = True
        self._set(frozenset())

    def sessions(self, max_age: float = 0.0) -> list[BgpSession]:
        """Each peer's session as BIRD reports it (``birdc``, a process: asked again only
        when the last answer is older than ``max_age`` seconds)."""
        now = time.monotonic()
        if self._sessions is None or now - self._sessions[0] > max_age:
            try:
                protocols = self.bird.protocols()
            except BirdError:  # a status, not an action: say BIRD is gone
                protocols = {}
            self._sessions = (
                now,
                [
                    BgpSession(
                        peer=str(p.address),
                        state=protocols.get(f"xdplb_peer{i}", "BIRD not answering"),
                    )
                    for i, p in enumerate(self.cfg.peers, 1)
                ],
            )
        return self._sessions[1]

    def state(self) -> BgpStatus:
        """What the node announces, why not, its sessions (BIRD asked now)."""
        return BgpStatus(
            asn=self.cfg.asn,
            router_id=str(self.router_id),
            announced=self.announced,
            withdrawn_because=self._failing or "",
            sessions=self.sessions(),
            self_checks=self.checks,
            self_check_failures=self.check_failures,
        )

    def close(self) -> None:
        """Stop BIRD (its sessions end with a Cease) and remove its directory."""
        self.bird.stop()
        shutil.rmtree(self.bird.dir, ignore_errors=True)


def fence(interfaces: list[str], why: str) -> None:
    """Set ``interfaces`` down (``bgp.uplink_down``): the routers on their links see them
    go. Logged; an interface that cannot be set down is logged and left."""
    for name in interfaces:
        try:
            set_interface_down(name)
        except OSError as e:
            log.error("bgp.uplink_down: %s stays up: %s", name, e.strerror or e)
            continue
        log.error(
            "bgp.uplink_down: took %s down (self-check failed: %s); set it up once the node "
            "is fixed",
            name,
            why,
        )
