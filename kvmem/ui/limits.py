"""What one `kvmem ui` request may ask of the server, and how long a connection may take.

The page's links are meant to be shared, so a query string is untrusted input: each
bound keeps one request's memory and time small whatever it holds, and is far above any
real deployment. A value above its bound is a 400 naming the field. The config.json's own
sizes (layers, heads, vocabulary...) are bounded where every config is read
(``kvmem.spec.bounds``).
"""

# the request
MAX_REQUEST_LINE = 65_536  # bytes, as http.server reads it: a pasted config fits many times
MAX_HEAD_BYTES = MAX_REQUEST_LINE + 32_768  # request line and headers together
MAX_VALUE_CHARS = 8192  # one query value other than the pasted config (a list of 1,024 GPUs)
REQUEST_SECONDS = 5.0  # a request's line and headers must arrive in this; idle keep-alive too
MAX_CONNECTIONS = 64  # open at once (one thread each); more are answered 503 and closed

# the plan
PLAN_SECONDS = 20.0  # one plan's computing time (a Hub read included), in a worker process
PLAN_WORKERS = 2  # plans computed at once
PLAN_MEMORY_BYTES = 4 << 30  # address space of a worker process
MAX_WORLD = 1024  # tensor x pipeline ranks: the page's table and bars have one row each

# flags, by argparse's name: the largest value the page plans
FLAG_BOUNDS = {
    "tp": MAX_WORLD, "pp": MAX_WORLD, "max_concurrent_batches": MAX_WORLD,
    "max_model_len": 1 << 30, "max_num_batched_tokens": 1 << 30, "max_num_seqs": 1 << 20,
    "block_size": 1 << 16,
}

