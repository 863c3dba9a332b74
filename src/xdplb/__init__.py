"""xdplb: a layer-4 load balancer from XDP to socket."""

import os

# numpy's OpenBLAS starts a worker thread per core at import. Nothing here does linear
# algebra, and a thread started before the daemon drops its capabilities would keep
# them (capabilities are per thread): one thread, as the daemon's privileges need.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
