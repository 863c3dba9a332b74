"""`make install` into a scratch root (issue 10, production install): the daemon started
from the installed unit's own ExecStart line serves the lab without the source tree, the
installed CLI talks to it, the unit's ExecReload reloads it, and a SIGTERM'd daemon leaves
lb_xdp serving for the next one to adopt.

The install runs scripts/install.sh (what `make install` runs, without re-running `make
build`) with the dependencies' wheels cached in build/wheels, so only the first run on a
machine reads the package index."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.core import paths
from xdplb.daemon.main import read_pid
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import http_post
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
PREFIX = "/usr"
UNIT = f"{PREFIX}/lib/systemd/system/xdplb.service"
#: A cold install (the wheels fetched once) and a warm one (about 15 s here) both fit.
INSTALL_TIMEOUT = 300


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make install DESTDIR=<root> PREFIX=/usr``, through the script it runs."""
    root = tmp_path_factory.mktemp("root")
    env = {
        **os.environ,
        "DESTDIR": str(root),
        "PREFIX": PREFIX,
        "BUILD_PY": sys.executable,
    }
    done = subprocess.run(
        [str(paths.ROOT / "scripts" / "install.sh"), "install"],
        cwd=paths.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return root


def clean_env() -> dict[str, str]:
    """No variable that would point the installed package back at this tree."""
    drop = ("PYTHONPATH", "XDPLB_BUILD_DIR", "VIRTUAL_ENV", "PYTHONHOME")
    return {k: v for k, v in os.environ.items() if k not in drop}


def in_root(root: Path, argv: list[str]) -> list[str]:
    """A unit's command line with its absolute paths moved into the scratch root (the
    commands a root filesystem has anyway, /bin/kill, stay)."""
    return [str(root) + a if a.startswith(("/usr/", "/etc/")) else a for a in argv]


def unit_lines(root: Path, key: str, unit: str = UNIT) -> list[list[str]]:
    text = (root / unit.lstrip("/")).read_text()
    return [
        shlex.split(line.split("=", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"{key}=")
    ]


def xdplb(root: Path, *args: str, ns: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [str(root / "usr/bin/xdplb"), *args]
    if ns is not None:
        argv = ["ip", "netns", "exec", ns, *argv]
    return subprocess.run(
        argv, cwd="/", env=clean_env(), capture_output=True, text=True, timeout=30, check=False
    )


def test_installed_tree(root: Path) -> None:
    venv_python = root / "usr/lib/xdplb/bin/python"
    where = subprocess.run(
        [
            str(venv_python),
            "-I",
            "-c",
            "import xdplb, xdplb.core.paths as p, xdplb.datapath._libbpf_c, "
            "xdplb.tables._maglev_c; print(xdplb.__file__); print(p.bpf_object('lb_xdp'))",
        ],
        cwd="/",
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    site = root / "usr/lib/xdplb/lib"
    assert all(Path(w).is_relative_to(site) for w in where), where
    # Not an editable install: no path back into the source tree.
    pth = [p.read_text() for p in site.rglob("*.pth")]
    assert not any(str(paths.ROOT) in text for text in pth), pth
    # The venv's scripts name the final path, the launcher its own location.
    assert (root / "usr/lib/xdplb/bin/uvicorn").read_text().startswith("#!/usr/lib/xdplb/bin/")
    for unit in ("xdplb.service", "xdplb@.service", "xdplb-host.service"):
        assert (root / "usr/lib/systemd/system" / unit).is_file()
    assert unit_lines(root, "ExecStart") == [
        ["/usr/bin/xdplb", "run", "-c", "/etc/xdplb/xdplb.yaml"]
    ]
    assert unit_lines(root, "ExecReload") == [["/bin/kill", "-HUP", "$MAINPID"]]
    assert unit_lines(root, "Restart") == [["on-failure"]]
    host = f"{PREFIX}/lib/systemd/system/xdplb-host.service"
    assert unit_lines(root, "ExecStart", host)[0][:4] == [
        "/usr/bin/xdplb",
        "host",
        "attach",
        "--dev",
    ]
    assert unit_lines(root, "ExecStop", host)[0][:4] == [
        "/usr/bin/xdplb",
        "host",
        "detach",
        "--dev",
    ]
    # The example configuration validates with the installed CLI.
    done = xdplb(root, "validate", "-c", str(root / "etc/xdplb/xdplb.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_units_verify(root: Path, tmp_path: Path) -> None:
    """systemd-analyze accepts the units (their commands moved into the scratch root)."""
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing (apt-get install systemd)")
    units = []
    for name in ("xdplb.service", "xdplb-host.service"):
        text = (root / "usr/lib/systemd/system" / name).read_text()
        text = text.replace("/usr/bin/", f"{root}/usr/bin/").replace(
            "/etc/xdplb", f"{root}/etc/xdplb"
        )
        (tmp_path / name).write_text(text)
        units.append(str(tmp_path / name))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *units],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_reinstall_keeps_the_configuration(root: Path) -> None:
    conf = root / "etc/xdplb/xdplb.yaml"
    before = conf.read_text()
    conf.write_text(before + "# edited by the operator\n")
    env = {**os.environ, "DESTDIR": str(root), "PREFIX": PREFIX, "BUILD_PY": sys.executable}
    done = subprocess.run(
        [str(paths.ROOT / "scripts" / "install.sh")],
        cwd=paths.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert conf.read_text() == before + "# edited by the operator\n"
    assert (root / "etc/xdplb/xdplb.yaml.example").read_text() == before


def vips(lab: Lab, weights: dict[str, int]) -> list[dict[str, Any]]:
    backends = [{"address": str(lab.addr(b)), "weight": w} for b, w in weights.items()]
    return [{"address": VIP, "port": 80, "backends": backends}]


@pytest.fixture
def node(lab: Lab, root: Path, tmp_path: Path) -> Iterator[LbNode]:
    """The lab's LB configuration, written where the unit reads it (its log in tmp_path)."""
    servers = lab.start_servers()
    lb = LbNode(lab, tmp_path, vips(lab, {"b1": 1, "b2": 1}))
    lb.config_path = root / "etc/xdplb/xdplb.yaml"
    lb.write(vips(lab, {"b1": 1, "b2": 1}))
    yield lb
    lb.destroy()
    for p in servers:
        p.kill()
        p.wait()


def start_unit(lab: Lab, root: Path, lb: LbNode) -> subprocess.Popen[bytes]:
    """The daemon as systemd would start it: the unit's ExecStart, in the LB namespace."""
    (argv,) = unit_lines(root, "ExecStart")
    log = lb.log_path.open("ab")
    proc = lab.popen("lb", in_root(root, argv), cwd="/", env=clean_env(), stdout=log, stderr=log)
    log.close()
    lb.proc = proc  # LbNode's waits watch it, and its teardown kills it

    def pid() -> int | None:
        if proc.poll() is not None:
            raise AssertionError(f"the installed daemon exited: {lb.log_tail()}")
        return read_pid(lb.instance)

    wait_for(pid, "the installed daemon's pid file", until=lambda p: p == proc.pid, timeout=20)
    lb.wait_applied(20)
    # It runs the installed package: its cffi module is mapped from the root, none from here.
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    cffi = [line for line in maps.splitlines() if "xdplb/datapath/_libbpf_c" in line]
    assert cffi and all(f"{root}/usr/lib/xdplb/lib/" in line for line in cffi), cffi
    assert str(paths.ROOT / "src") not in maps
    return proc


def weights(root: Path, lb: LbNode) -> dict[str, int]:
    done = xdplb(root, "status", "--json", "-i", lb.instance)
    assert done.returncode == 0, done.stdout + done.stderr
    st = json.loads(done.stdout)
    (vip,) = st["vips"]
    return {b["address"]: b["weight"] for b in vip["backends"]}


def test_unit_serves_reloads_and_restarts(lab: Lab, root: Path, node: LbNode) -> None:
    lb = node
    b1, b2 = str(lab.addr("b1")), str(lab.addr("b2"))
    proc = start_unit(lab, root, lb)
    client = lab.ns("client")

    # It serves: traffic to the VIP reaches the backends, the installed CLI talks to it.
    landed = {http_post(client, VIP, 80, b"x", src_port=p) for p in range(21000, 21040)}
    assert landed == {"b1", "b2"}
    listing = xdplb(root, "list", "-i", lb.instance)
    assert listing.returncode == 0, listing.stderr
    assert b1 in listing.stdout and b2 in listing.stdout
    assert weights(root, lb) == {b1: 1, b2: 1}

    # ExecReload, as systemd runs it: a changed weight shows in the daemon's status.
    lb.write(vips(lab, {"b1": 3, "b2": 1}))
    (reload,) = unit_lines(root, "ExecReload")
    subprocess.run([a.replace("$MAINPID", str(proc.pid)) for a in reload], check=True)
    lb.wait_applied(10)
    assert weights(root, lb) == {b1: 3, b2: 1}

    # systemctl stop/restart: SIGTERM; lb_xdp stays attached and the pins keep serving.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0, lb.log_tail()
    assert lb.link_pin.exists()
    assert not paths.api_socket(lb.instance).exists()
    assert http_post(client, VIP, 80, b"y", src_port=21000) in {"b1", "b2"}

    # The next start adopts the pins: its status is the same instance, same weights.
    start_unit(lab, root, lb)
    assert weights(root, lb) == {b1: 3, b2: 1}
    assert http_post(client, VIP, 80, b"z", src_port=21001) in {"b1", "b2"}


def test_deb(tmp_path: Path) -> None:
    """`make deb` (scripts/deb.sh): the package's fields, conffiles and files; unpacked
    anywhere, its CLI runs (not installed with dpkg here: that would change this host)."""
    if shutil.which("dpkg-deb") is None:
        pytest.fail("dpkg-deb is missing")
    done = subprocess.run(
        [str(paths.ROOT / "scripts" / "deb.sh")],
        cwd=paths.ROOT,
        env={**os.environ, "BUILD_PY": sys.executable},
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    deb = paths.ROOT / done.stdout.strip().splitlines()[-1]

    def dpkg_deb(*args: str) -> str:
        return subprocess.run(
            ["dpkg-deb", *args], capture_output=True, text=True, check=True
        ).stdout

    assert dpkg_deb("-f", str(deb), "Package", "Depends").splitlines() == [
        "Package: xdplb",
        "Depends: python3.11, libbpf1 (>= 1:1.1), iproute2",
    ]
    assert dpkg_deb("-I", str(deb), "conffiles").split() == [
        "/etc/xdplb/xdplb.yaml",
        "/etc/xdplb/host.env",
    ]
    files = {line.split()[-1] for line in dpkg_deb("-c", str(deb)).splitlines()}
    for f in ("./usr/bin/xdplb", "./usr/lib/systemd/system/xdplb.service", "./etc/xdplb/host.env"):
        assert f in files
    assert not any(str(paths.ROOT) in f for f in files)
    dpkg_deb("-x", str(deb), str(tmp_path))
    cfg = (tmp_path / "usr/lib/xdplb/pyvenv.cfg").read_text()
    assert str(paths.ROOT) not in cfg, cfg
    ok = xdplb(tmp_path, "validate", "-c", str(tmp_path / "etc/xdplb/xdplb.yaml"))
    assert ok.returncode == 0, ok.stdout + ok.stderr


def unit_command(line: list[str], env: dict[str, str]) -> list[str]:
    """Expand a unit's command line as systemd does: ``${VAR}`` is one word, ``$VAR`` is
    split on whitespace."""
    out: list[str] = []
    for word in line:
        if word.startswith("${") and word.endswith("}"):
            out.append(env[word[2:-1]])
        elif word.startswith("$") and word[1:] in env:
            out.extend(env[word[1:]].split())
        else:
            out.append(word)
    return out


def test_host_unit_attaches_and_detaches(root: Path, lab_factory: Any) -> None:
    """xdplb-host.service's ExecStart, ExecReload and ExecStop, with host.env, on a backend."""
    lab = lab_factory(backends=1)
    instance = f"{lab.prefix}-hostunit"
    pins = lab.pin_root("hostunit")  # removed at teardown whatever happens
    (root / "etc/xdplb/host.env").write_text(
        f"# the test's backend\nXDPLB_HOST_DEV=eth0\nXDPLB_HOST_INSTANCE={instance}\n"
        f"XDPLB_HOST_ARGS=--addr {lab.addr('b1')} --addr {lab.addr('b1', 6)}\n"
    )
    env = dict(
        line.split("=", 1)
        for line in (root / "etc/xdplb/host.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    host = f"{PREFIX}/lib/systemd/system/xdplb-host.service"
    assert unit_lines(root, "EnvironmentFile", host) == [["/etc/xdplb/host.env"]]

    def run(key: str) -> subprocess.CompletedProcess[str]:
        (line,) = unit_lines(root, key, host)
        argv = in_root(root, unit_command(line, env))
        return lab.run("b1", argv, check=False, cwd="/", env=clean_env(), timeout=60)

    def filters() -> str:
        return lab.run("b1", ["tc", "filter", "show", "dev", "eth0", "ingress"]).stdout

    for key in ("ExecStart", "ExecReload"):  # reload: attach again, in place
        done = run(key)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"host_tc attached to eth0 for {lab.addr('b1')}" in done.stdout
        assert "host_tc" in filters()
        assert pins.is_dir()
    status = xdplb(root, "host", "status", "--instance", instance, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["instance"] == instance
    done = run("ExecStop")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "host_tc" not in filters()
    assert not pins.exists()


def test_uninstall_keeps_the_configuration(root: Path) -> None:
    """`make uninstall` (last: the other tests use the module's root)."""
    env = {**os.environ, "DESTDIR": str(root), "PREFIX": PREFIX, "BUILD_PY": sys.executable}
    subprocess.run(
        [str(paths.ROOT / "scripts" / "install.sh"), "uninstall"],
        cwd=paths.ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert left == [
        "etc/xdplb/host.env",
        "etc/xdplb/host.env.example",
        "etc/xdplb/xdplb.yaml",
        "etc/xdplb/xdplb.yaml.example",
    ]
