#!/bin/sh
# `make install` / `make uninstall`: xdplb under $DESTDIR$PREFIX, runnable without this tree.
#
#   $PREFIX/lib/xdplb/                a venv: the package (not editable; the BPF objects and
#                                     the cffi modules inside it) and its dependencies
#   $PREFIX/bin/xdplb, xdplb-agent    launchers of that venv
#   $PREFIX/lib/systemd/system/       xdplb.service, xdplb@.service, xdplb-host.service
#   $SYSCONFDIR/xdplb/                xdplb.yaml and host.env (examples; never overwritten)
#   $PREFIX/share/doc/xdplb/          the docs the units point at
#
# Run from the source tree after `make build`. BUILD_PY is the build venv's Python (its pip
# builds and installs the wheels); TARGET_PYTHON the interpreter of the installed venv.
# Wheels of the dependencies are cached in $WHEELS: an install that finds them all there
# needs no package index.
set -eu
cd "$(dirname "$0")/.."

action=${1:-install}
PREFIX=${PREFIX:-/usr/local}
DESTDIR=${DESTDIR:-}
SYSCONFDIR=${SYSCONFDIR:-/etc}
BUILD_PY=${BUILD_PY:-.venv/bin/python}
WHEELS=${WHEELS:-build/wheels}
if [ -z "${TARGET_PYTHON:-}" ]; then
    # The distribution's Python: it outlives a user's pyenv or build venv.
    if [ -x /usr/bin/python3 ]; then TARGET_PYTHON=/usr/bin/python3; else TARGET_PYTHON=python3; fi
fi

libdir=$PREFIX/lib/xdplb
bindir=$PREFIX/bin
unitdir=$PREFIX/lib/systemd/system
docdir=$PREFIX/share/doc/xdplb
confdir=$SYSCONFDIR/xdplb
root=$DESTDIR
case $root in /* | '') ;; *) root=$(pwd)/$root ;; esac  # the venv records absolute paths
units="xdplb.service xdplb@.service xdplb-host.service"

die() { echo "install.sh: $*" >&2; exit 1; }

if [ "$action" = uninstall ]; then
    rm -rf "$root$libdir" "$root$docdir"
    rm -f "$root$bindir/xdplb" "$root$bindir/xdplb-agent"
    for u in $units; do rm -f "$root$unitdir/$u"; done
    echo "xdplb removed from $root$PREFIX (kept $root$confdir)"
    exit 0
fi
[ "$action" = install ] || die "usage: install.sh [install|uninstall]"

for o in lb_xdp lb_tc host_tc hc_tc; do
    [ -f "build/$o.bpf.o" ] || die "build/$o.bpf.o is missing: run make build"
done
for m in src/xdplb/datapath/_libbpf_c src/xdplb/tables/_maglev_c; do
    ls "$m".*.so >/dev/null 2>&1 || die "$m.*.so is missing: run make build"
done

# A clean copy of the package with the objects as package data (xdplb/_bpf, which
# xdplb.core.paths.build_dir finds), so the wheel holds nothing stale of this tree.
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp pyproject.toml README.md "$stage/"
cp -R src "$stage/src"
find "$stage/src" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
rm -f "$stage"/src/xdplb/*/_*_c.c
mkdir -p "$stage/src/xdplb/_bpf"
for o in build/*.bpf.o; do
    case $o in build/bench_*) ;; *) cp "$o" "$stage/src/xdplb/_bpf/" ;; esac  # not the benchmarks'
done
"$BUILD_PY" -m pip wheel -q --no-deps -w "$stage/dist" "$stage"
wheel=$(ls "$stage"/dist/xdplb-*.whl)

venv=$root$libdir
"$TARGET_PYTHON" -m venv --clear --without-pip "$venv"
pip_install() {
    "$BUILD_PY" -m pip --python "$venv/bin/python" install -q --no-index \
        --find-links "$WHEELS" "$wheel"
}
if ! pip_install 2>/dev/null; then
    echo "fetching the dependencies' wheels into $WHEELS (once)"
    mkdir -p "$WHEELS"
    "$BUILD_PY" -m pip wheel -q -w "$WHEELS" "$wheel"
    rm -f "$WHEELS"/xdplb-*.whl
    pip_install
fi
if [ -n "$root" ]; then
    # The venv's own scripts name its Python by absolute path: the final one, not $DESTDIR's.
    for f in "$venv"/bin/*; do
        [ -f "$f" ] && [ ! -L "$f" ] && sed -i "1s|^#!$venv/|#!$libdir/|" "$f"
    done
    sed -i "s|$venv|$libdir|" "$venv/pyvenv.cfg"
fi

# Launchers find the venv next to themselves, so a DESTDIR tree runs in place as well.
mkdir -p "$root$bindir"
launcher() {  # name, python arguments
    {
        echo '#!/bin/sh'
        echo "# $1, installed by make install: the Python of $libdir (-I: no cwd, no PYTHON* vars)."
        echo 'venv=$(cd "$(dirname "$(readlink -f "$0")")/../lib/xdplb" && pwd)'
        echo "exec \"\$venv/bin/python\" -I $2 \"\$@\""
    } >"$root$bindir/$1"
    chmod 0755 "$root$bindir/$1"
}
launcher xdplb "-c 'import sys; sys.argv[0] = \"xdplb\"; from xdplb.cli.app import main; main()'"
launcher xdplb-agent "-m xdplb.agent"

mkdir -p "$root$unitdir"
for u in $units; do
    sed -e "s|@BINDIR@|$bindir|g" -e "s|@SYSCONFDIR@|$SYSCONFDIR|g" -e "s|@DOCDIR@|$docdir|g" \
        "packaging/systemd/$u.in" >"$root$unitdir/$u"
    chmod 0644 "$root$unitdir/$u"
done

mkdir -p "$root$confdir"
for f in xdplb.yaml host.env; do
    install -m 0644 "packaging/$f" "$root$confdir/$f.example"
    [ -e "$root$confdir/$f" ] || install -m 0644 "packaging/$f" "$root$confdir/$f"
done

mkdir -p "$root$docdir"
cp README.md docs/*.md "$root$docdir/"

echo "xdplb installed in $root$PREFIX ($(cd "$venv" && bin/python -c 'import sys; print(sys.version.split()[0])'))"
echo "next: edit $confdir/xdplb.yaml, then: systemctl daemon-reload && systemctl enable --now xdplb"
