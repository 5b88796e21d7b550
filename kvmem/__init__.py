"""kvmem: KV-cache memory planning, block accounting, offloading and elastic mapping.

`kvmem.spec`, `kvmem.plan` and `kvmem.cache` import no torch; the engine and server
live in `kvmem.engine` and `kvmem.serve` and need the `engine`/`serve` extras.
"""

__version__ = "0.1.0"
