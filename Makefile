# xdplb: `make demo` and `make test` are all a newcomer needs (both install what is missing).
SHELL      := /bin/sh
VENV       ?= .venv
PY         := $(VENV)/bin/python
PYTHON     ?= python3
CLANG      ?= clang
ARCH_INC   := /usr/include/$(shell uname -m)-linux-gnu
# -fno-strict-aliasing, as the kernel: keys and headers written field by field are read
# back as words (hashes, checksums), which type-based alias analysis may reorder.
BPF_CFLAGS := -O2 -g -target bpf -fno-strict-aliasing -Wall -Werror -I$(ARCH_INC) -Ibpf/include -Ibpf
BPF_SRCS   := $(wildcard bpf/*.bpf.c)
BPF_OBJS   := $(patsubst bpf/%.bpf.c,build/%.bpf.o,$(BPF_SRCS))
# Small programs that exist only for tests (tests/bpf/progs/*.bpf.c).
TEST_SRCS  := $(wildcard tests/bpf/progs/*.bpf.c)
TEST_OBJS  := $(patsubst tests/bpf/progs/%.bpf.c,build/test/%.bpf.o,$(TEST_SRCS))
BPF_HDRS   := $(wildcard bpf/include/*.h bpf/lib/*.h)
# lb_xdp with another map layout, for the upgrade tests (docs/operations.md, "Upgrades"):
# the next layout as a release would make it, and one the migration must refuse.
LAYOUT_OBJS := build/test/lb_xdp_abi_next.bpf.o build/test/lb_xdp_abi_bad.bpf.o \
               build/test/lb_tc_abi_next.bpf.o build/test/lb_tc_abi_bad.bpf.o
# The legacy layout: lb_xdp of the last release before pins were versioned, built from
# its commit's bpf/ (git archive), for the tests only.
LEGACY_COMMIT := 3e42602
LEGACY_OBJ  := build/test/lb_xdp_legacy.bpf.o
CFFI_MODS  := src/xdplb/datapath/libbpf_build.py src/xdplb/tables/maglev_build.py
PYTEST     := $(PY) -m pytest -q
# make install: DESTDIR for a scratch or package root (docs/operations.md#production-install).
PREFIX     ?= /usr/local
DESTDIR    ?=
SYSCONFDIR ?= /etc
INSTALL_ENV = DESTDIR='$(DESTDIR)' PREFIX='$(PREFIX)' SYSCONFDIR='$(SYSCONFDIR)' BUILD_PY='$(PY)'

.PHONY: all deps build test test-unit test-bpf test-e2e fuzz demo bench bench-hooks bench-sync bench-sockets soak lint clean \
        install uninstall deb

all: build

deps: $(VENV)/.installed
	@./scripts/deps.sh

$(VENV)/.installed: pyproject.toml
	@./scripts/deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

build: deps $(BPF_OBJS) $(TEST_OBJS) $(LAYOUT_OBJS) build/.cffi

build/%.bpf.o: bpf/%.bpf.c $(BPF_HDRS)
	@mkdir -p build
	$(CLANG) $(BPF_CFLAGS) -c $< -o $@

build/test/%.bpf.o: tests/bpf/progs/%.bpf.c $(BPF_HDRS)
	@mkdir -p build/test
	$(CLANG) $(BPF_CFLAGS) -c $< -o $@

# Both programs of the balancer (lb_xdp, lb_tc) in the test layouts: a daemon of a test
# build attaches lb_tc of its layout where an interface's hook is TC.
build/test/%_abi_next.bpf.o: bpf/%.bpf.c $(BPF_HDRS)
	@mkdir -p build/test
	$(CLANG) $(BPF_CFLAGS) -DXDPLB_ABI_TEST_NEXT -c $< -o $@

build/test/%_abi_bad.bpf.o: bpf/%.bpf.c $(BPF_HDRS)
	@mkdir -p build/test
	$(CLANG) $(BPF_CFLAGS) -DXDPLB_ABI_TEST_BAD -c $< -o $@

$(LEGACY_OBJ):
	@rm -rf build/legacy && mkdir -p build/legacy build/test
	git archive $(LEGACY_COMMIT) bpf | tar -x -C build/legacy
	$(CLANG) -O2 -g -target bpf -Wall -Werror -I$(ARCH_INC) -Ibuild/legacy/bpf/include \
		-Ibuild/legacy/bpf -c build/legacy/bpf/lb_xdp.bpf.c -o $@

build/.cffi: $(CFFI_MODS) bpf/lib/hash.h bpf/include/xdplb_abi.h src/xdplb/datapath/sessions.c $(VENV)/.installed
	@mkdir -p build
	for m in $(CFFI_MODS); do $(PY) $$m || exit 1; done
	@touch $@

# The test builds of lb_xdp compile its source whole (tests/bpf/test_concurrency.py).
build/test/lb_xdp_check.bpf.o build/test/lb_xdp_noclaim.bpf.o build/test/lb_xdp_novalidate.bpf.o: \
		bpf/lb_xdp.bpf.c tests/bpf/progs/lb_xdp_check.bpf.c

# Lint first: a suite that passes on code that does not type-check is not green.
test: build lint $(LEGACY_OBJ)
	$(PYTEST) tests

test-unit: build
	$(PYTEST) -m unit tests

test-bpf: build $(LEGACY_OBJ)
	$(PYTEST) -m bpf tests

test-e2e: build
	$(PYTEST) -m e2e tests

# The lb_xdp fuzz alone (also part of `make test`, at 10^6 packets): FUZZ_PACKETS, FUZZ_SEED.
FUZZ_PACKETS ?= 1000000
fuzz: build
	FUZZ_PACKETS=$(FUZZ_PACKETS) $(PYTEST) -s tests/bpf/test_fuzz.py

# KEEP=1: the lab stays up after the tour (status page, CLI) until Ctrl-C.
demo: build
	$(PY) -m xdplb.lab.demo $(if $(filter-out 0,$(KEEP)),--keep)
	$(PY) -m xdplb.lab.demo_cluster

# A venv under $(PREFIX)/lib/xdplb, launchers in $(PREFIX)/bin, systemd units, /etc/xdplb.
install: build
	$(INSTALL_ENV) ./scripts/install.sh install

uninstall:
	$(INSTALL_ENV) ./scripts/install.sh uninstall

# build/xdplb_<version>_<arch>.deb: the same install under /usr, for this python3.11.
deb: build
	BUILD_PY='$(PY)' ./scripts/deb.sh

bench: build
	$(PY) bench/bench.py --out bench/results.json

# The two hooks on veth against plain routing and nftables DNAT, in the lab (docs/benchmarks.md).
bench-hooks: build
	@XDPLB_BENCH_DEPS=1 ./scripts/deps.sh
	$(PY) bench/hooks_bench.py --out bench/hooks_results.json

# Session sync between two nodes: a full copy of 10^6 sessions, the incremental stream,
# the export ring's read and the lag from a new flow on one node to the other (docs/sync.md).
bench-sync: build
	$(PY) bench/sync_bench.py --out bench/sync_results.json

# The socket tier (docs/benchmarks.md): UDP through one SO_REUSEPORT group of 4 sockets,
# with and without the generations program, against one socket. Socket-level balancing's
# rows are a mode of bench-hooks (the same lab, the same run as nftables and the XDP tier).
bench-sockets: build
	$(PY) bench/reuseport_bench.py --out bench/reuseport_results.json

# Not part of `make test`: the lab under load and churn for SOAK_SECONDS (docs/operations.md).
SOAK_SECONDS ?= 600
soak: build
	$(PY) -m xdplb.lab.soak --seconds $(SOAK_SECONDS) --out build/soak.json

lint: deps
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy --strict

clean:
	rm -rf build src/xdplb/*/_*_c.*
