import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SECRET = "codedance-test-secret-7f3a"
os.environ.setdefault("CODEDANCE_SANDBOX_TEST_SECRET", SECRET)  # must not reach any cell


@pytest.fixture(scope="session")
def pool():
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the sandbox needs Linux and root")
    from sandbox import SandboxPool

    with SandboxPool(num_workers=4, timeout_s=2.0, memory_mb=512, disk_mb=64, max_files=500,
                     max_open_files=64, max_processes=32, max_output_bytes=4096, max_images=3,
                     max_image_pixels=300_000) as p:
        yield p
