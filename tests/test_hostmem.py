"""`tpurl.hostmem`: with the memory kept, a freed large block is reused without the kernel faulting
its pages in again; with glibc's defaults (`TPURL_HOST_MALLOC=system`) every allocation is faulted in
anew. Each case runs in a fresh process: the settings only take effect before threads allocate."""

import json
import os
import subprocess
import sys

import pytest

from tpurl import hostmem

CHILD = """
import json, resource
import numpy as np
from tpurl.hostmem import keep_freed_memory

applied = keep_freed_memory()

def faults():  # minor page faults of allocating, writing and freeing 64 MiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.ones(2**24, np.float32)
    del a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults()  # the first allocation grows the heap: its pages are new either way
print(json.dumps({"applied": applied, "faults": [faults() for _ in range(3)]}))
"""
HUGE_PAGES = 2**26 // 2**21  # the kernel may back the block with 2 MiB pages: at least one fault each


def _run(mode: str) -> dict:
    env = {**os.environ, hostmem.ENV: mode}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_memory_is_reused_without_page_faults():
    kept, system = _run("keep"), _run("system")
    assert kept["applied"] and not system["applied"]
    assert min(system["faults"]) >= HUGE_PAGES  # the violation this guards against: faults every time
    assert max(kept["faults"]) < 8


@pytest.mark.parametrize("value", ["tcmalloc", "1"])
def test_bad_mode_is_a_one_line_error(monkeypatch, value):
    monkeypatch.setenv(hostmem.ENV, value)
    with pytest.raises(ValueError, match=f"{hostmem.ENV}='{value}' is not a host allocator mode") as e:
        hostmem.keep_freed_memory()
    assert len(str(e.value).splitlines()) == 1
