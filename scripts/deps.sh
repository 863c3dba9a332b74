#!/bin/sh
# Installs what the build and the tests need, and nothing that is already there.
# Idempotent: safe to run before every build (make deps).
set -eu

APT_PACKAGES="clang llvm libbpf-dev bpftool iproute2 gcc make python3 python3-venv python3-dev bird2 etcd-server etcd-client
    pkg-config libelf-dev zlib1g-dev ethtool iputils-ping
    chromium chromium-driver fonts-dejavu-core"

# make bench-hooks: the servers and load generators of the hooks benchmark.
if [ "${XDPLB_BENCH_DEPS:-0}" = 1 ]; then
    APT_PACKAGES="$APT_PACKAGES nginx-light wrk iperf3 nftables"
fi

missing=""
for p in $APT_PACKAGES; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "deps: installing apt packages:$missing"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing
fi

# bpffs is not always mounted (KERNEL_NOTES.md).
if ! mount | grep -q " /sys/fs/bpf type bpf"; then
    mount -t bpf bpf /sys/fs/bpf
fi
