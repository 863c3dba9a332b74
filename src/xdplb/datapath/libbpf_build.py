"""cffi builder for ``xdplb.datapath._libbpf_c``: API mode against the system libbpf (-lbpf).

Run as a script (``make build`` does): compiles in build/cffi and places the
extension next to the package, in src/xdplb/. It must not import xdplb.

API mode lets the C compiler lay out libbpf's option structs (they have hidden
padding, see KERNEL_NOTES.md); every struct below is partial (``...;``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from cffi import FFI

ROOT = Path(__file__).resolve().parents[3]

CDEF = r"""
typedef uint8_t __u8;
typedef uint32_t __u32;
typedef uint64_t __u64;

enum libbpf_print_level { LIBBPF_WARN, LIBBPF_INFO, LIBBPF_DEBUG };
enum bpf_map_type { BPF_MAP_TYPE_UNSPEC, ... };
enum bpf_prog_type { BPF_PROG_TYPE_XDP, BPF_PROG_TYPE_SCHED_CLS, ... };
enum bpf_attach_type {
    BPF_XDP, BPF_CGROUP_SOCK_OPS, BPF_CGROUP_INET4_CONNECT, BPF_CGROUP_INET6_CONNECT,
    BPF_CGROUP_INET4_POST_BIND, BPF_CGROUP_INET6_POST_BIND, BPF_CGROUP_UDP4_SENDMSG,
    BPF_CGROUP_UDP6_SENDMSG, BPF_CGROUP_UDP4_RECVMSG, BPF_CGROUP_UDP6_RECVMSG,
    BPF_CGROUP_INET4_GETPEERNAME, BPF_CGROUP_INET6_GETPEERNAME, BPF_TRACE_ITER,
    BPF_SK_LOOKUP, BPF_SK_REUSEPORT_SELECT, BPF_SK_REUSEPORT_SELECT_OR_MIGRATE, ...
};
enum bpf_tc_attach_point { BPF_TC_INGRESS, BPF_TC_EGRESS, BPF_TC_CUSTOM, ... };
enum bpf_tc_flags { BPF_TC_F_REPLACE, ... };

struct bpf_object;
struct bpf_program;
struct bpf_map;

struct bpf_object_open_opts { size_t sz; const char *pin_root_path; ...; };
struct bpf_map_create_opts { size_t sz; __u32 inner_map_fd; __u32 map_flags; ...; };
struct bpf_map_batch_opts { size_t sz; __u64 elem_flags; __u64 flags; ...; };
struct bpf_test_run_opts {
    size_t sz;
    const void *data_in; void *data_out; __u32 data_size_in; __u32 data_size_out;
    const void *ctx_in; void *ctx_out; __u32 ctx_size_in; __u32 ctx_size_out;
    __u32 retval; int repeat; __u32 duration; __u32 flags; __u32 cpu; __u32 batch_size;
    ...;
};
struct bpf_link_create_opts { size_t sz; __u32 flags; ...; };
struct bpf_link_update_opts { size_t sz; __u32 flags; __u32 old_prog_fd; ...; };
struct bpf_tc_hook {
    size_t sz; int ifindex; enum bpf_tc_attach_point attach_point; __u32 parent; ...;
};
struct bpf_tc_opts {
    size_t sz; int prog_fd; __u32 flags; __u32 prog_id; __u32 handle; __u32 priority; ...;
};

/* uapi <linux/bpf.h> */
struct xdp_md {
    __u32 data; __u32 data_end; __u32 data_meta;
    __u32 ingress_ifindex; __u32 rx_queue_index; __u32 egress_ifindex;
};
struct bpf_map_info {
    __u32 type; __u32 id; __u32 key_size; __u32 value_size; __u32 max_entries;
    __u32 map_flags; char name[16]; __u32 btf_id; __u32 btf_key_type_id;
    __u32 btf_value_type_id; ...;
};
struct bpf_prog_info { __u32 type; __u32 id; char name[16]; ...; };
struct bpf_link_info { __u32 type; __u32 id; __u32 prog_id; ...; };

/* libbpf.h */
struct bpf_object *bpf_object__open_file(const char *path, const struct bpf_object_open_opts *opts);
int bpf_object__load(struct bpf_object *obj);
void bpf_object__close(struct bpf_object *obj);
struct bpf_program *bpf_object__next_program(const struct bpf_object *obj,
                                             struct bpf_program *prog);
struct bpf_map *bpf_object__next_map(const struct bpf_object *obj, const struct bpf_map *map);
const char *bpf_program__name(const struct bpf_program *prog);
int bpf_program__fd(const struct bpf_program *prog);
int bpf_program__set_autoload(struct bpf_program *prog, _Bool autoload);
const char *bpf_map__name(const struct bpf_map *map);
int bpf_map__fd(const struct bpf_map *map);
int bpf_map__set_max_entries(struct bpf_map *map, __u32 max_entries);
__u32 bpf_map__max_entries(const struct bpf_map *map);
const char *bpf_map__pin_path(const struct bpf_map *map);
int bpf_map__set_pin_path(struct bpf_map *map, const char *path);
int libbpf_num_possible_cpus(void);
int bpf_tc_hook_create(struct bpf_tc_hook *hook);
int bpf_tc_hook_destroy(struct bpf_tc_hook *hook);
int bpf_tc_attach(const struct bpf_tc_hook *hook, struct bpf_tc_opts *opts);
int bpf_tc_detach(const struct bpf_tc_hook *hook, const struct bpf_tc_opts *opts);
int bpf_tc_query(const struct bpf_tc_hook *hook, struct bpf_tc_opts *opts);

/* bpf.h */
int bpf_map_create(enum bpf_map_type map_type, const char *map_name, __u32 key_size,
                   __u32 value_size, __u32 max_entries, const struct bpf_map_create_opts *opts);
int bpf_map_update_elem(int fd, const void *key, const void *value, __u64 flags);
int bpf_map_lookup_elem(int fd, const void *key, void *value);
int bpf_map_lookup_elem_flags(int fd, const void *key, void *value, __u64 flags);
int bpf_map_delete_elem(int fd, const void *key);
int bpf_map_get_next_key(int fd, const void *key, void *next_key);
int bpf_map_lookup_batch(int fd, void *in_batch, void *out_batch, void *keys, void *values,
                         __u32 *count, const struct bpf_map_batch_opts *opts);
int bpf_map_update_batch(int fd, const void *keys, const void *values, __u32 *count,
                         const struct bpf_map_batch_opts *opts);
int bpf_map_get_fd_by_id(__u32 id);
int bpf_obj_pin(int fd, const char *pathname);
int bpf_obj_get(const char *pathname);
int bpf_obj_get_info_by_fd(int bpf_fd, void *info, __u32 *info_len);
int bpf_prog_test_run_opts(int prog_fd, struct bpf_test_run_opts *opts);
int bpf_link_create(int prog_fd, int target_fd, enum bpf_attach_type attach_type,
                    const struct bpf_link_create_opts *opts);
int bpf_link_detach(int link_fd);
int bpf_prog_query(int target_fd, enum bpf_attach_type type, __u32 query_flags,
                   __u32 *attach_flags, __u32 *prog_ids, __u32 *prog_cnt);
int bpf_link_update(int link_fd, int new_prog_fd, const struct bpf_link_update_opts *opts);
int bpf_iter_create(int link_fd);
int bpf_prog_attach(int prog_fd, int attachable_fd, enum bpf_attach_type type, unsigned int flags);
int bpf_prog_detach2(int prog_fd, int attachable_fd, enum bpf_attach_type type);

/* Ours: route libbpf's printf-style output, already formatted, to Python. */
extern "Python" void xdplb_libbpf_log(int level, const char *msg);
void xdplb_install_print(void);

/* libbpf btf.h: a map's or an object's type information, as raw bytes (core/btf.py). */
struct btf;
struct btf *btf__load_from_kernel_by_id(__u32 id);
struct btf *btf__parse(const char *path, struct btf_ext **btf_ext);
const void *btf__raw_data(const struct btf *btf, __u32 *size);
void btf__free(struct btf *btf);
struct btf_ext;

/* sessions.c: lb_conns mapped into memory, with lb_xdp's claim protocol. */
struct xdplb_session { ...; };
struct xdplb_flow_key { ...; };
int xdplb_sess_read(void *base, uint32_t start, uint32_t count, struct xdplb_session *out,
                    uint32_t *pos, uint32_t cap, uint32_t tries, uint32_t *busy);
uint32_t xdplb_sess_import(void *base, uint32_t mask, uint32_t seed, uint16_t gen, uint32_t now,
                           const uint32_t *timeouts, const struct xdplb_session *in, uint32_t n,
                           int replace, uint32_t tries, uint8_t *result);
int xdplb_sess_get(void *base, uint32_t mask, uint32_t seed, const struct xdplb_flow_key *key,
                   uint32_t tries, struct xdplb_session *out, uint32_t *pos);
"""

SOURCE = r"""
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <linux/bpf.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>

static void xdplb_libbpf_log(int level, const char *msg);

/* libbpf hands us a va_list: format it here, in C, where va_list is a real type. */
static int xdplb_print(enum libbpf_print_level level, const char *fmt, va_list args)
{
    char small[1024];
    va_list copy;
    int n;

    va_copy(copy, args);
    n = vsnprintf(small, sizeof(small), fmt, copy);
    va_end(copy);
    if (n < 0)
        return 0;
    if ((size_t)n < sizeof(small)) {
        xdplb_libbpf_log(level, small);
        return n;
    }
    /* Verifier logs are long: size the buffer to the message. */
    char *big = malloc((size_t)n + 1);
    if (!big) {
        xdplb_libbpf_log(level, small);
        return n;
    }
    vsnprintf(big, (size_t)n + 1, fmt, args);
    xdplb_libbpf_log(level, big);
    free(big);
    return n;
}

void xdplb_install_print(void)
{
    libbpf_set_print(xdplb_print);
}

#include <bpf/btf.h>
"""

#: sessions.c, compiled in: the session table's user-space side (its own header says why C).
SESSIONS_C = Path(__file__).resolve().parent / "sessions.c"


def make_ffi() -> FFI:
    ffibuilder = FFI()
    ffibuilder.cdef(CDEF)
    ffibuilder.set_source(
        "xdplb.datapath._libbpf_c",
        SOURCE + SESSIONS_C.read_text(),
        libraries=["bpf"],
        include_dirs=[str(ROOT / "bpf" / "include"), str(ROOT / "bpf")],
        # sessions.c reads structs as words (the hashes take __u32 *), as the kernel does:
        # with strict aliasing, gcc -O2 hashed an import's key before its ports were stored.
        extra_compile_args=["-O2", "-Wall", "-fno-strict-aliasing"],
    )
    return ffibuilder


def main() -> None:
    tmpdir = ROOT / "build" / "cffi"
    tmpdir.mkdir(parents=True, exist_ok=True)
    built = Path(make_ffi().compile(tmpdir=str(tmpdir)))
    dest_dir = Path(__file__).resolve().parent
    # Copy then rename: a process that has the old .so mapped keeps it intact.
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".libbpf_c.", suffix=".tmp")
    os.close(fd)
    shutil.copy2(built, tmp)
    os.replace(tmp, dest_dir / built.name)
    print(f"built {dest_dir / built.name}")


if __name__ == "__main__":
    main()
