"""The test files that read the CPU's bf16 probe (ampx.policy._cpu_has_native_bf16, which
AMPX_CPU_BF16 forces): CI's pass 2, with the probe forced to 1, runs these and no others
(.ci/run says why), after pass 1 ran the whole suite with it forced to 0.

conftest.py charges every read of the probe in the pytest process to the file of the test
running then (PYTEST_CURRENT_TEST, so a read in a module- or session-scoped fixture counts for
the test that set it up) and fails a test whose file is not listed here; a read at collection,
outside every test, fails the next test that ends. So the list cannot fall behind what the
tests read in that process. Not seen: a read only in a child process (a subprocess a test
starts): list such a file by hand. Measured on 2026-12-07 by logging every
read with PYTEST_CURRENT_TEST over the whole suite, children included: these six files and no
others read it.

Plain Python with no imports, so that .ci/run can read it without torch.
"""
FILES = (
    "tests/test_clip_dtype.py",
    "tests/test_demo.py",
    "tests/test_policy.py",
    "tests/test_prepare.py",
    "tests/test_probe.py",
    "tests/test_readme.py",
)
