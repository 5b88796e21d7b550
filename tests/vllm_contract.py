"""kvmem's vLLM integration driven by vLLM's own code, run inside a vLLM venv (0.32 or 0.33).

Not a test module: ``tests/test_vllm_contract.py`` runs this file with a vLLM venv's
interpreter (``python vllm_contract.py MODEL_DIR``) and checks the JSON it prints last.
No engine starts; everything vLLM-side is vLLM's own code:

- plugin: ``register()`` wraps ``vllm.v1.engine.core.get_kv_cache_configs``, then vLLM's
  ``EngineCore._initialize_kv_caches`` runs over the model's real KV specs (built as the
  attention layers build them) with the workers standing in as one small object that
  answers the engine core's questions (specs, supported layouts, measured memory) and
  records the KV cache configs it is given; for pp 1 and pp 2 (20 + 10 layers,
  ``proportional``). A recorder between the wrapper and vLLM's function captures the
  budgets and the other arguments the wrapper passed on. The three-argument wrapper kvmem
  had before it forwarded arguments is driven the same way, as the control;
- ``kvmem vllm-check --json``, run as a user runs it;
- connector: ``KvmemConnector`` built from vLLM's base class in the scheduler role and in
  two worker roles (pp 2, each over its own KV tensors in vLLM CPU's layout), driven with
  vLLM's ``Request``, ``KVCacheBlocks`` and ``SchedulerOutput``, the workers' outputs joined
  by vLLM's ``KVOutputAggregator`` as the executor joins them;
- the tiers' figures and events of that run: the joined connector stats, through vLLM's
  own serialisation of scheduler stats, into vLLM's log line (``KVConnectorLogging``) and
  Prometheus metrics (``KVConnectorProm``); the scheduler side's KV events through vLLM's
  ZMQ publisher to a subscriber on 127.0.0.1, against vLLM's block hashes of the requests.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace
from typing import Any

import torch


def cpu_platform() -> None:
    """vLLM 0.33's wheel is a CUDA build that finds no device here; use vLLM's CPU platform."""
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()


class Workers:
    """The engine core's view of its workers: KV specs, supported layouts, KV memory."""

    def __init__(self, specs: list[dict], memory: list[int]) -> None:
        self.specs, self.memory = specs, memory
        self.configs: list | None = None

    def get_kv_cache_specs(self) -> list[dict]:
        return self.specs

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["LBHNC"]] * len(self.specs)  # what vLLM CPU's attention backend supports

    def set_kv_cache_layout(self, *args) -> None:
        pass

    def determine_available_memory(self) -> list[int]:
        return list(self.memory)

    def initialize_from_config(self, configs: list) -> None:
        self.configs = configs

    def compile_or_warm_up_model(self) -> None:
        pass


def engine_config(model: str, pp: int, kv_bytes: int, max_len: int, block: int,
                  **extra):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype="float32", pipeline_parallel_size=pp,
                      kv_cache_memory_bytes=kv_bytes, max_model_len=max_len, block_size=block,
                      **extra).create_engine_config()


def worker_specs(config, pp: int) -> list[dict]:
    """Each worker's KV specs, as vLLM's attention layers build them (full attention)."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    hf = config.model_config.hf_config
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    spec = FullAttentionSpec(block_size=config.cache_config.block_size,
                             num_kv_heads=hf.num_key_value_heads, head_size=head,
                             dtype=torch.float32)
    specs = []
    for stage in range(pp):
        start, end = get_pp_indices(hf.num_hidden_layers, stage, pp)
        specs.append({f"model.layers.{i}.self_attn.attn": spec for i in range(start, end)})
    return specs


def initialize_kv_caches(config, specs: list[dict], memory: list[int]):
    """vLLM's engine core sizing the KV caches: (worker configs, scheduler config)."""
    from vllm.v1.engine.core import EngineCore

    workers = Workers(specs, memory)
    core = SimpleNamespace(model_executor=workers, available_gpu_memory_for_kv_cache=0,
                           collective_rpc=lambda *a, **k: None)
    scheduler_config = EngineCore._initialize_kv_caches(core, config)
    return workers.configs, scheduler_config


def three_argument_wrapper(get_kv_cache_configs, policy: str):
    """The wrapper kvmem had before it forwarded the arguments it does not use."""
    from kvmem.integrations.vllm.plugin import plan_deployment

    def wrapper(vllm_config, kv_cache_specs, available_memory):
        kv_plan = plan_deployment(vllm_config, kv_cache_specs, available_memory, policy)
        budgets = [r.kv_budget_bytes for r in kv_plan.ranks]
        return get_kv_cache_configs(vllm_config, kv_cache_specs, budgets)

    return wrapper


def plugin_checks(model: str) -> dict:
    from vllm.v1.engine import core as engine_core

    from kvmem.integrations.vllm import entry_point, plugin

    original = engine_core.get_kv_cache_configs
    calls: list[dict] = []

    @functools.wraps(original)
    def recorder(*args, **kwargs):  # between kvmem's wrapper and vLLM's function
        calls.append({"available_memory": list(args[2]), "more_args": args[3:],
                      "kwargs": sorted(kwargs)})
        return original(*args, **kwargs)

    engine_core.get_kv_cache_configs = recorder
    os.environ[plugin.ENV] = "proportional"
    entry_point.register()
    entry_point.register()  # vLLM may call it more than once: wrapped once
    wrapped = engine_core.get_kv_cache_configs
    out: dict = {"wrapped_once": getattr(wrapped, "__wrapped__", None) is recorder}
    for name, pp, partition in (("pp1", 1, None), ("pp2", 2, "20,10")):
        if partition:
            os.environ["VLLM_PP_LAYER_PARTITION"] = partition
        else:
            os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
        for variant, fn in (("kvmem", wrapped),
                            ("three_argument", three_argument_wrapper(recorder, "proportional"))):
            config = engine_config(model, pp, 1 << 30, 1024, 128)
            specs = worker_specs(config, pp)
            engine_core.get_kv_cache_configs = fn
            calls.clear()
            try:
                configs, scheduler = initialize_kv_caches(config, specs, [1 << 30] * pp)
            except Exception as exc:  # noqa: BLE001 - the control is expected to fail
                out[f"{name}_{variant}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            finally:
                engine_core.get_kv_cache_configs = wrapped
            result = {
                "blocks": [c.num_blocks for c in configs],
                "bytes": [sum(t.size for t in c.kv_cache_tensors) for c in configs],
                "scheduler_blocks": scheduler.num_blocks,
                "tokens": config.cache_config.kv_cache_size_tokens
                if hasattr(config.cache_config, "kv_cache_size_tokens") else None,
                "budgets": calls[0]["available_memory"],
                "num_more_args": len(calls[0]["more_args"]),
                "kwargs": calls[0]["kwargs"],
            }
            if calls[0]["more_args"]:  # forwarded: the very groups vLLM's core computed
                from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

                again = get_global_kv_cache_groups(config, specs)
                result["forwarded_groups_equal"] = calls[0]["more_args"][0] == again
            out[f"{name}_{variant}"] = result
    engine_core.get_kv_cache_configs = original
    del os.environ[plugin.ENV]
    return out


# ---------------------------------------------------------------------- connector
def output_of(kv_output):
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput.with_kv_conn_output_only(kv_output)


class Deployment:
    """A scheduler-role connector and one worker-role connector per rank, joined as
    vLLM's executor joins them (``KVOutputAggregator``)."""

    def __init__(self, model: str, disk_dir: str) -> None:
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        import kvmem.integrations.vllm as integration

        os.environ["VLLM_PP_LAYER_PARTITION"] = "20,10"
        # block 16; rank 0 holds 20 layers, rank 1 10: a rank-0 block is twice the bytes,
        # so the same CPU budget holds 7 blocks on rank 0 and 14 on rank 1
        rank0_block = 20 * 16 * 3 * 64 * 2 * 4
        transfer = KVTransferConfig(**integration.kv_transfer_config(
            cpu_offload_gib=7 * rank0_block / (1 << 30)))
        from vllm.config import KVEventsConfig

        self.config = engine_config(model, 2, 32 * rank0_block, 256, 16,
                                    kv_transfer_config=transfer,
                                    kv_events_config=KVEventsConfig(
                                        enable_kv_cache_events=True, publisher="zmq",
                                        endpoint=f"tcp://127.0.0.1:{free_port()}",
                                        replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
                                        topic="kv"))
        configs, scheduler_config = initialize_kv_caches(
            self.config, worker_specs(self.config, 2), [32 * rank0_block] * 2)
        self.scheduler_config = scheduler_config
        self.block_size = scheduler_config.kv_cache_groups[0].kv_cache_spec.block_size
        connector_cls = integration.KvmemConnector
        self.connector_cls = connector_cls
        self.scheduler = connector_cls(self.config, KVConnectorRole.SCHEDULER, scheduler_config)
        self.workers, self.kv = [], []
        for rank, worker_config in enumerate(configs):
            rank_config = copy.deepcopy(self.config)
            rank_config.parallel_config.rank = rank
            worker = connector_cls(rank_config, KVConnectorRole.WORKER, worker_config)
            torch.manual_seed(rank)  # each rank's own shard
            kv = {}
            for group in worker_config.kv_cache_groups:
                spec = group.kv_cache_spec
                for layer in group.layer_names:
                    kv[layer] = torch.randn(worker_config.num_blocks, spec.num_kv_heads,
                                            spec.block_size, 2 * spec.head_size)
            worker.register_kv_caches(kv)
            self.workers.append(worker)
            self.kv.append(kv)
        self.aggregator = KVOutputAggregator.from_connector(self.scheduler, 2)
        self.undelivered: list = []
        self.stats: list = []  # each step's joined connector stats
        self.events: list = []  # what the scheduler side gave vLLM to publish, step by step

    def step(self, *, finished: set[str] | None = None, deliver: bool = True,
             prefill: tuple[int, float] | None = None):
        """One engine step: the scheduler's metadata to every worker, their loads (before
        the forward) and stores (after it), their outputs joined and handed back to the
        scheduler side; without ``deliver`` they wait (steps still in flight), and the
        next delivering step hands them back first, in order. ``prefill``: (tokens,
        seconds) of a forward computing that many prompt tokens, stood in for by a sleep."""
        from vllm.v1.core.sched.output import SchedulerOutput

        scheduled = SchedulerOutput.make_empty()
        if prefill is not None:
            scheduled.num_scheduled_tokens = {"prompt": prefill[0]}
        meta = self.scheduler.build_connector_meta(scheduled)
        outputs = []
        for worker in self.workers:
            from vllm.v1.outputs import KVConnectorOutput

            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            if prefill is not None:
                time.sleep(prefill[1])
            worker.wait_for_save()
            sending, _ = worker.get_finished(finished or set())
            outputs.append(output_of(KVConnectorOutput(
                finished_sending=sending,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_connector_worker_meta=worker.build_connector_worker_meta())))
            worker.clear_connector_metadata()
        joined = self.aggregator.aggregate(outputs).kv_connector_output
        self.stats.append(joined.kv_connector_stats)
        self.undelivered.append(joined)
        if deliver:
            for output in self.undelivered:
                self.scheduler.update_connector_output(output)
                self.events.append(list(self.scheduler.take_events()))
            self.undelivered.clear()
        return meta, joined

    def block(self, rank: int, block_id: int) -> list[torch.Tensor]:
        return [t[block_id].clone() for t in self.kv[rank].values()]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@functools.cache
def block_hasher(block_size: int):
    """vLLM's own block hashes of a request (sha256, as its engine computes them)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def request(request_id: str, tokens: list[int], **kwargs):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, tokens, SamplingParams(max_tokens=4), None,
                   block_hasher=block_hasher(16), **kwargs)


def blocks_of(ids: list[int]):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(block_id=i) for i in ids],))


def until_sent(d: Deployment, request_id: str, deliver: bool = True,
               timeout: float = 120.0) -> list[str] | None:
    """Step until every rank reports the request's stores done (what they report then), or
    None after ``timeout`` seconds: a loaded machine's disk writes can take seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.05)
        _, joined = d.step(finished={request_id}, deliver=deliver)
        if joined.finished_sending:
            return sorted(joined.finished_sending)
    return None


def connector_checks(model: str) -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory() as disk_dir:
        d = Deployment(model, disk_dir)
        sched = d.scheduler
        bs = d.block_size
        assert bs == 16  # the block hasher above
        a_tokens = list(range(1000, 1000 + 5 * bs + 1))  # 5 full blocks and one token
        b_tokens = list(range(3000, 3000 + 5 * bs + 1))
        out["sleep_mode_supported"] = d.connector_cls.supports_sleep_mode(
            d.config.kv_transfer_config)
        out["before_reports"] = list(sched.get_num_new_matched_tokens(request("a0", a_tokens), 0))
        d.step()  # the workers' first reports: both ranks are up
        out["after_reports"] = list(sched.get_num_new_matched_tokens(request("a0", a_tokens), 0))

        # A's prompt computed (a forward of 256 tokens, at least 0.2 s: the prefill rate),
        # then A finishes on blocks 1..6: its 5 full blocks are stored once for both ranks
        d.step(prefill=(256, 0.2))
        a = request("a", a_tokens)
        a.num_computed_tokens = len(a_tokens)
        originals = {r: {b: d.block(r, b) for b in range(1, 6)} for r in (0, 1)}
        out["a_finished"] = list(sched.request_finished(a, [1, 2, 3, 4, 5, 6]))
        out["a_pending_frees"] = sched.has_pending_block_frees()
        meta, joined = d.step()
        out["a_stores"] = [(j.request_id, j.block_ids) for j in meta.stores]
        out["a_finished_sending"] = until_sent(d, "a")  # both ranks have copied A's blocks
        out["a_pending_frees_after"] = sched.has_pending_block_frees()

        # A again: a hit of every full block but the one of the last prompt token... 5 here
        a2 = request("a2", a_tokens)
        out["a2_matched"] = list(sched.get_num_new_matched_tokens(a2, 0))
        sched.update_state_after_alloc(a2, blocks_of([10, 11, 12, 13, 14, 15]), 5 * bs)
        meta, joined = d.step()
        out["a2_loads"] = [(j.request_id, j.block_ids) for j in meta.loads]
        out["a2_invalid"] = sorted(joined.invalid_block_ids)
        out["a2_bytes_equal"] = all(
            torch.equal(x, y)
            for r in (0, 1) for src, dst in zip(range(1, 6), range(10, 15), strict=True)
            for x, y in zip(originals[r][src], d.block(r, dst), strict=True))
        out["layers_per_rank"] = [len(kv) for kv in d.kv]

        # B finishes: its store fills rank 0's tier (7 blocks), evicting A's oldest blocks
        # there and not on rank 1; the scheduler has not heard of it yet (one step late)
        b = request("b", b_tokens)
        b.num_computed_tokens = len(b_tokens)
        sched.request_finished(b, [20, 21, 22, 23, 24, 25])
        d.step(deliver=False)
        out["b_finished_sending"] = until_sent(d, "b", deliver=False)
        # A's lookup still counts on rank 0's stale report; the load fails on rank 0 only
        a3 = request("a3", a_tokens)
        out["a3_matched_stale"] = list(sched.get_num_new_matched_tokens(a3, 0))
        sched.update_state_after_alloc(a3, blocks_of([26, 27, 28, 29, 30, 31]), 5 * bs)
        meta, joined = d.step()
        out["a3_invalid_joined"] = sorted(joined.invalid_block_ids)
        # now every report is in: A is a hit only as far as both ranks hold it
        out["a4_matched"] = list(sched.get_num_new_matched_tokens(request("a4", a_tokens), 0))
        out["b_matched"] = list(sched.get_num_new_matched_tokens(request("b2", b_tokens), 0))
        # another cache salt never matches blocks stored without it
        out["salted_matched"] = list(sched.get_num_new_matched_tokens(
            request("s", b_tokens, cache_salt="x"), 0))
        for worker in d.workers:
            worker.shutdown()
        out["hashes"] = {name: vllm_hashes(r) for name, r in (("a", a), ("b", b))}
        out["tokens"] = {"a": a_tokens, "b": b_tokens}
        out["figures"] = figures_checks(d)
        out["events"] = events_checks(d)
        out.update(sleep_mode_checks(d))
    return out


def vllm_hashes(req) -> list:
    """vLLM's block hashes of a request as its KV events carry them."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [external(maybe_convert_block_hash(h)) for h in req.block_hashes]


def external(block_hash):
    return block_hash.hex() if isinstance(block_hash, bytes) else block_hash


def figures_checks(d: Deployment) -> dict:
    """The run's connector stats as vLLM's stat loggers get them (serialised as vLLM sends
    scheduler stats from its engine core): vLLM's log line over the run, and the
    Prometheus samples of ``kvmem_offload_*`` and the prefill rate."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    payloads = []
    for stats in d.stats:
        if stats is None:
            continue
        sent = EngineCoreOutputs(scheduler_stats=SchedulerStats(
            kv_connector_stats=stats.to_dict()))
        payloads.append(decoder.decode(encoder.encode(sent)).scheduler_stats.kv_connector_stats)
    logging = KVConnectorLogging(d.config.kv_transfer_config)
    prom = KVConnectorProm(d.config, ["model_name", "engine"], {0: ["contract", "0"]})
    for payload in payloads:
        logging.observe(payload)
        prom.observe(payload, 0)
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    samples = [{"name": s.name, "labels": s.labels, "value": s.value}
               for family in text_string_to_metric_families(generate_latest(REGISTRY).decode())
               for s in family.samples
               if s.name.startswith(("kvmem_offload_", "kvmem_prefill_"))]
    # inside vLLM's MultiConnector (as elastic KV memory runs it), vLLM finds the
    # connector's stats class by its name
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    multi = MultiConnector.build_kv_connector_stats(data={"KvmemConnector": payloads[0]})
    return {"reports": len(payloads), "log": lines, "samples": samples,
            "in_multi": type(multi.data["KvmemConnector"]).__name__}


class EventSubscriber:
    """A KV-event subscriber as a router runs one, for vLLM's ZMQ publisher: a SUB socket
    bound on 127.0.0.1 (vLLM's publisher connects to a host address) and, for what the
    live stream missed while the connection came up, the publisher's replay socket."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str) -> None:
        import zmq

        self.replay_endpoint = replay_endpoint
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.bind(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.live: dict[int, bytes] = {}

    def poll(self, timeout_s: float) -> None:
        """Read the live stream until it is quiet for ``timeout_s``."""
        while self.sub.poll(int(timeout_s * 1000)):
            _topic, seq, payload = self.sub.recv_multipart()
            self.live[int.from_bytes(seq, "big")] = payload

    def batches(self) -> dict[int, Any]:
        """Every batch published so far by sequence number: the live ones, and the rest
        replayed by the publisher (asked from sequence 0, to its end marker)."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.poll(0.5)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        payloads = dict(self.live)
        while dealer.poll(10000):
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == self.END_SEQ:
                break
            payloads.setdefault(int.from_bytes(seq, "big"), payload)
        dealer.close(linger=0)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        return {seq: decoder.decode(payload) for seq, payload in sorted(payloads.items())}

    def close(self) -> None:
        self.sub.close(linger=0)


def describe_events(batches: dict[int, Any]) -> list[dict]:
    """The events of ``batches`` in order, as JSON (hashes as vLLM's events carry them)."""
    out = []
    for batch in batches.values():
        for event in batch.events:
            kind = type(event).__name__
            item = {"kind": kind, "hashes": [external(h) for h in event.block_hashes],
                    "medium": event.medium, "group": event.group_idx}
            if kind == "BlockStored":
                item.update(parent=external(event.parent_block_hash)
                            if event.parent_block_hash is not None else None,
                            tokens=list(event.token_ids), block_size=event.block_size)
            out.append(item)
    return out


def events_checks(d: Deployment) -> dict:
    """The scheduler side's events, published step by step through vLLM's own ZMQ
    publisher (the one its scheduler makes from ``--kv-events-config``) and read back by a
    subscriber on 127.0.0.1."""
    from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch

    config = d.config.kv_events_config
    subscriber = EventSubscriber(config.endpoint, config.replay_endpoint, config.topic)
    publisher = EventPublisherFactory.create(config, 0)
    batches = [events for events in d.events if events]
    for events in batches:
        publisher.publish(KVEventBatch(ts=time.time(), events=events))
    subscriber.poll(2.0)
    received = subscriber.batches()
    publisher.shutdown()
    subscriber.close()
    return {"published_batches": len(batches), "sequence": list(received),
            "events": describe_events(received)}


def sleep_mode_checks(d: Deployment) -> dict:
    """Sleep mode with the connector: vLLM 0.33 asks the connector class and refuses; the
    connector itself refuses it on any version. (vLLM's CPU platform has no sleep mode, so
    the flag is set on a built config.)"""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvmem.errors import ConfigError

    config = copy.deepcopy(d.config)
    object.__setattr__(config.model_config, "enable_sleep_mode", True)
    out: dict = {"vllm_refuses_sleep": None, "connector_refuses_sleep": None}
    if hasattr(config, "_verify_kv_transfer_compat"):
        try:
            config._verify_kv_transfer_compat()
        except ValueError as exc:
            out["vllm_refuses_sleep"] = str(exc)
    try:
        d.connector_cls(config, KVConnectorRole.SCHEDULER, d.scheduler_config)
    except ConfigError as exc:
        out["connector_refuses_sleep"] = str(exc)
    return out


def vllm_check() -> dict:
    """``kvmem vllm-check --json`` as a user runs it in this venv."""
    import subprocess

    run = subprocess.run([sys.executable, "-m", "kvmem", "vllm-check", "--json"],
                         capture_output=True, text=True, timeout=120)
    return {"returncode": run.returncode, "report": json.loads(run.stdout)}


def main() -> None:
    model = sys.argv[1]
    import vllm

    result: dict = {"vllm": vllm.__version__, "vllm_check": vllm_check()}
    cpu_platform()
    for name, checks in (("plugin", plugin_checks), ("connector", connector_checks)):
        try:
            result[name] = checks(model)
        except Exception:  # noqa: BLE001 - reported to the test with its traceback
            result[name] = {"traceback": traceback.format_exc()}
    print("KVMEM_CONTRACT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
