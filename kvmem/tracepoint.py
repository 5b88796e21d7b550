import os, time, threading
_f = None
def T(name, extra=""):
    global _f
    if os.environ.get("KVMEM_TRACE_NAME") != "A":
        return
    if _f is None:
        _f = open(f"/tmp/trace-A-{os.getpid()}.txt", "a", buffering=1)
    _f.write(f"{time.time():.6f} {time.thread_time()*1e3:.3f} {threading.current_thread().name} {name} {extra}\n")
