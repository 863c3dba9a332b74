#!/bin/sh
# `make deb`: build/xdplb_<version>_<arch>.deb from `make install DESTDIR=... PREFIX=/usr`.
# The venv in /usr/lib/xdplb runs on the distribution's python3.11, so the package is tied
# to it and to the architecture it was built on. /etc/xdplb files are conffiles.
set -eu
cd "$(dirname "$0")/.."
BUILD_PY=${BUILD_PY:-.venv/bin/python}
version=$("$BUILD_PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
arch=$(dpkg --print-architecture)
work=build/deb
root=$work/root
rm -rf "$work"
mkdir -p "$root"
DESTDIR=$root PREFIX=/usr SYSCONFDIR=/etc TARGET_PYTHON=/usr/bin/python3.11 BUILD_PY=$BUILD_PY \
    ./scripts/install.sh install >/dev/null
mkdir -p "$root/DEBIAN"
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
cat >"$root/DEBIAN/control" <<CONTROL
Package: xdplb
Version: $version
Architecture: $arch
Maintainer: ${DEB_MAINTAINER:-xdplb maintainers <root@localhost>}
Installed-Size: $size
Depends: python3.11, libbpf1 (>= 1:1.1), iproute2
Recommends: bird2
Section: net
Priority: optional
Description: layer-4 load balancer on XDP, with its control plane
 lb_xdp (XDP; lb_tc at TC on veth) picks a backend (Maglev or Beamer tables, a session table) and tunnels the
 packet to it (GUE or IPIP); host_tc decapsulates it on the backend; replies go straight
 back to the client. Units: xdplb.service (the balancer), xdplb-host.service (backends).
CONTROL
printf '/etc/xdplb/xdplb.yaml\n/etc/xdplb/host.env\n' >"$root/DEBIAN/conffiles"
for script in postinst postrm; do
    printf '#!/bin/sh\nset -e\nif [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi\n' \
        >"$root/DEBIAN/$script"
    chmod 0755 "$root/DEBIAN/$script"
done
deb=build/xdplb_${version}_${arch}.deb
dpkg-deb --root-owner-group -Zgzip -z1 --build "$root" "$deb" >/dev/null
echo "$deb"
