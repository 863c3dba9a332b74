"""cffi builder for ``xdplb.tables._maglev_c``, the Maglev table population loop in C.

Run as a plain script (``make build`` does): it must not import the xdplb
package, which may not be importable before its extensions exist.  The
extension is compiled under build/cffi and copied into src/xdplb/, next to
maglev.py, which is where the editable install imports it from.

Why C: the loop is sequential (each turn depends on which slots the earlier
turns took) and needs hundreds of thousands of probes for M = 65537, far too
slow in Python; maglev.py keeps a pure-Python twin to test this one against.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import cffi

CDEF = """
int maglev_populate(uint32_t m, uint32_t n, const uint32_t *offset,
                    const uint32_t *skip, const uint32_t *weight, uint32_t *out);
"""

# Weighted population as Envoy's MaglevTable does it (maglev_lb.cc), with integer
# weights: in round r backend i takes a turn when r * w_i >= target_i, and each turn
# raises target_i by the largest weight.  The backend with the largest weight takes a
# turn every round, so every round fills at least one slot and the loop ends.  skip is
# in [1, m-1] and m is prime, so each permutation visits every slot and the probe ends.
# Returns 0, -EINVAL (no backend, a zero weight, or an offset/skip out of range: any of
# these would loop forever or index out of bounds) or -ENOMEM.
SOURCE = r"""
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>

#define MAGLEV_EMPTY UINT32_MAX

int maglev_populate(uint32_t m, uint32_t n, const uint32_t *offset,
                    const uint32_t *skip, const uint32_t *weight, uint32_t *out)
{
	uint64_t *target, *pos, max_weight = 0, round, filled = 0, c;
	uint32_t i;

	if (m == 0 || n == 0)
		return -EINVAL;
	for (i = 0; i < n; i++) {
		if (weight[i] == 0 || offset[i] >= m || skip[i] == 0 || skip[i] >= m)
			return -EINVAL;
		if (weight[i] > max_weight)
			max_weight = weight[i];
	}
	target = calloc(n, sizeof(*target));
	pos = malloc((size_t)n * sizeof(*pos));
	if (!target || !pos) {
		free(target);
		free(pos);
		return -ENOMEM;
	}
	for (i = 0; i < n; i++)
		pos[i] = offset[i];
	for (c = 0; c < m; c++)
		out[c] = MAGLEV_EMPTY;

	for (round = 0; filled < m; round++) {
		for (i = 0; i < n && filled < m; i++) {
			if (round * weight[i] < target[i])
				continue;
			target[i] += max_weight;
			/* pos[i] is the next entry of i's permutation (offset + j * skip) % m. */
			c = pos[i];
			while (out[c] != MAGLEV_EMPTY) {
				c += skip[i];
				if (c >= m)
					c -= m;
			}
			out[c] = i;
			c += skip[i];
			pos[i] = c >= m ? c - m : c;
			filled++;
		}
	}
	free(target);
	free(pos);
	return 0;
}
"""

ROOT = Path(__file__).resolve().parents[3]


def build() -> Path:
    """Compile the extension and copy it into src/xdplb/; return its path there."""
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source("xdplb.tables._maglev_c", SOURCE, extra_compile_args=["-O2", "-std=c11"])
    tmpdir = ROOT / "build" / "cffi"
    tmpdir.mkdir(parents=True, exist_ok=True)
    built = Path(ffi.compile(tmpdir=str(tmpdir), verbose=False))
    dest = Path(__file__).resolve().parent / built.name
    # Copy then rename: copying over the file would change the pages of every process
    # that has it mapped (a test run segfaulted when `make build` ran beside it).
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".maglev_c.", suffix=".tmp")
    os.close(fd)
    shutil.copy2(built, tmp)
    os.replace(tmp, dest)
    return dest


if __name__ == "__main__":
    print(build())
