"""Shared test setup: one CPU thread (the test machines are small and shared), and a
ledger folder of the test process's own.

Set before any test module imports torch, and inherited by every subprocess a test starts
(``kvmem`` commands, worker ranks), whatever the caller's environment says. The suite runs
in two processes at once (``pytest -n 2``): engines of one must not meet the other's, or
the user's, in the default ledger (``/dev/shm``). Tests of the default folder unset it.
"""

import atexit
import os
import shutil
import tempfile

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if "KVMEM_LEDGER_DIR" not in os.environ:
    _ledgers = tempfile.mkdtemp(prefix="kvmem-test-ledgers-")
    os.environ["KVMEM_LEDGER_DIR"] = _ledgers
    atexit.register(shutil.rmtree, _ledgers, ignore_errors=True)
