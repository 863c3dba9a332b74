"""BIRD 2 as the BGP speaker of an LB node (docs/cluster.md).

xdplb renders BIRD's whole configuration, runs ``bird`` as its own child (``-f``, a
control socket and a log file in the run directory) and drives it through that socket
with ``birdc``. The VIPs to announce are two include files of static routes, one per
family; announcing or withdrawing is rewriting them and ``birdc configure``, which
touches no BGP session. BIRD dies with the daemon (``PR_SET_PDEATHSIG``): a node whose
daemon was killed stops announcing at once (its sessions close), and BFD takes the
routes away from a node that went silent.

Why BIRD and not ExaBGP: BFD. A node black-holed by its link (up, but every packet
lost) is only noticed by the routers through BFD (300 ms here) or the BGP hold time
(3 s at the least); ExaBGP has no BFD.
"""

from __future__ import annotations

import ctypes
import ipaddress
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from xdplb.core.addresses import IPAddress
from xdplb.core.errors import XdplbError

#: prctl(PR_SET_PDEATHSIG): the signal a child gets when its parent thread exits.
_PR_SET_PDEATHSIG = 1


class BirdError(XdplbError):
    """BIRD could not be started, configured or asked."""


@dataclass(frozen=True)
class Peer:
    """A BGP neighbor of the node: the router's address and AS."""

    address: IPAddress
    asn: int
    bfd: bool = True


@dataclass(frozen=True)
class Timers:
    """BGP and BFD timers (BIRD's units: seconds, milliseconds)."""

    hold_time: int = 3
    bfd_interval_ms: int = 100
    bfd_multiplier: int = 3


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def prefix(addr: IPAddress) -> str:
    """The host route of a VIP: ``a.b.c.d/32`` or ``.../128``."""
    return f"{addr}/{32 if addr.version == 4 else 128}"


def static_routes(vips: Iterable[IPAddress], family: int) -> str:
    """The include file of one family's announced VIPs (blackhole routes: they exist in
    BIRD only, to be exported; BIRD on the node exports nothing to its kernel)."""
    lines = [
        f"route {prefix(v)} blackhole;" for v in sorted(set(vips), key=int) if v.version == family
    ]
    return "".join(line + "\n" for line in lines)


def node_config(
    *,
    router_id: ipaddress.IPv4Address,
    asn: int,
    peers: Sequence[Peer],
    timers: Timers,
    vips_dir: Path,
    log_file: Path,
) -> str:
    """BIRD's configuration for an LB node: one session per peer, each carrying the
    VIPs of its own family (an IPv4 session the IPv4 VIPs)."""
    out = [
        f'log "{log_file}" all;',
        f"router id {router_id};",
        "protocol device { scan time 10; }",
        # BFD on every interface BIRD's sessions use; the peers' "bfd on" asks for it.
        "protocol bfd xdplb_bfd {",
        '  interface "*" {',
        f"    min rx interval {timers.bfd_interval_ms} ms;",
        f"    min tx interval {timers.bfd_interval_ms} ms;",
        f"    multiplier {timers.bfd_multiplier};",
        "  };",
        "}",
    ]
    for family in (4, 6):
        out += [
            f"protocol static xdplb_vips{family} {{",
            f"  ipv{family};",
            f'  include "{vips_dir / f"vips{family}.conf"}";',
            "}",
        ]
    for i, p in enumerate(peers, 1):
        fam = p.address.version
        out += [
            f"protocol bgp xdplb_peer{i} {{",
            f"  local as {asn};",
            f"  neighbor {p.address} as {p.asn};",
            f"  hold time {timers.hold_time};",
            f"  keepalive time {max(1, timers.hold_time // 3)};",
            "  connect delay time 1;",
            "  connect retry time 1;",
            "  error wait time 1, 4;",
            f"  bfd {'on' if p.bfd else 'off'};",
            f'  ipv{fam} {{ import none; export where proto = "xdplb_vips{fam}"; }};',
            "}",
        ]
    return "\n".join(out) + "\n"


class Bird:
    """One BIRD process: its configuration, control socket and log in ``directory``."""

    def __init__(self, directory: Path, *, binary: str = "bird") -> None:
        self.dir = directory
        self.conf = directory / "bird.conf"
        self.socket = directory / "bird.ctl"
        self.log = directory / "bird.log"
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None

    def check_config(self, text: str) -> None:
        """Parse ``text`` with ``bird -p`` (BirdError with BIRD's message if it fails)."""
        probe = self.dir / "bird.conf.check"
        probe.write_text(text)
        try:
            done = subprocess.run(
                [self._path(), "-p", "-c", str(probe)], capture_output=True, text=True, timeout=10
            )
        finally:
            probe.unlink(missing_ok=True)
        if done.returncode != 0:
            raise BirdError(
                f"BIRD refused its configuration: {(done.stderr or done.stdout).strip()}"
            )

    def _path(self) -> str:
        found = shutil.which(self.binary) or shutil.which(self.binary, path="/usr/sbin:/sbin")
        if found is None:
            raise BirdError(f"{self.binary}: not found (Debian: apt install bird2)")
        return found

    def start(
        self,
        text: str,
        *,
        timeout: float = 5.0,
        spawn: Callable[[list[str]], subprocess.Popen[bytes]] | None = None,
    ) -> None:
        """Write the configuration and start BIRD; return once its socket answers.
        ``spawn`` starts it elsewhere (the lab's router namespace); by default it is our
        child and dies with the thread that started it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.check_config(text)
        self.conf.write_text(text)
        self.socket.unlink(missing_ok=True)
        argv = [self._path(), "-f", "-c", str(self.conf), "-s", str(self.socket)]
        if spawn is not None:
            self.proc = spawn(argv)
        else:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,  # one prctl: safe between fork and exec
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BirdError(f"bird exited ({self.proc.returncode}): {self.log_tail()}")
            if self.socket.exists():
                try:
                    self.command("show status")
                    return
                except BirdError:
                    pass
            if time.monotonic() >= deadline:
                self.stop()
                raise BirdError(f"bird did not answer on {self.socket} within {timeout} s")
            time.sleep(0.02)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self, *words: str, timeout: float = 5.0) -> str:
        """One ``birdc`` command; its output (BirdError if BIRD says it failed)."""
        birdc = shutil.which("birdc") or shutil.which("birdc", path="/usr/sbin:/sbin") or "birdc"
        try:
            done = subprocess.run(
                [birdc, "-s", str(self.socket), *words],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as e:
            raise BirdError(f"birdc {' '.join(words)}: no answer in {timeout} s") from e
        if done.returncode != 0:
            raise BirdError(f"birdc {' '.join(words)}: {(done.stderr or done.stdout).strip()}")
        return done.stdout

    def configure(self, text: str | None = None) -> None:
        """Reload the configuration (rewritten first when ``text`` is given)."""
        if text is not None:
            self.check_config(text)
            self.conf.write_text(text)
        out = self.command("configure")
        if "Reconfigured" not in out and "Reconfiguration in progress" not in out:
            raise BirdError(f"birdc configure: {out.strip()}")

    def protocols(self) -> dict[str, str]:
        """Every protocol's name → its state and info (``Established``, ``Active`` ...)."""
        out: dict[str, str] = {}
        for line in self.command("show protocols").splitlines():
            parts = line.split()  # BIRD pads its columns: no trailing blanks kept
            if len(parts) >= 4 and parts[0] != "Name" and not line.startswith("BIRD"):
                out[parts[0]] = " ".join(parts[3:])
        return out

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (BIRD closes its sessions with a Cease), then SIGKILL if it lingers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.socket.unlink(missing_ok=True)

    def log_tail(self, n: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"
