"""Shared test setup: one CPU thread (the test machines are small and shared).

Set before any test module imports torch, and inherited by every subprocess a test starts
(``kvmem`` commands, worker ranks), whatever the caller's environment says.
"""

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
