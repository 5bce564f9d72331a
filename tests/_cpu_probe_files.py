"""The test files that read the CPU's bf16 probe (ampx.policy._cpu_has_native_bf16, which
AMPX_CPU_BF16 forces): CI's pass 2, with the probe forced to 1, runs these and no others
(.ci/run says why), after pass 1 ran the whole suite with it forced to 0.

conftest.py fails a test that reads the probe in the pytest process from a file not listed here,
so the list cannot fall behind what the tests themselves read. Not seen there: a read in a module-
or session-scoped fixture, at collection, or only in a child process (a subprocess the
test starts): list such a file by hand. Measured on 2026-12-07 by logging every
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
