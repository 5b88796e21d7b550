"""The parts of ``KvmemConnector`` that need no vLLM: its settings, and the tier index
changes its workers report (``on_change``), including a disk tier found after a restart."""

from __future__ import annotations

import pytest
import torch

from kvmem.errors import ConfigError
from kvmem.integrations.vllm import kv_transfer_config
from kvmem.integrations.vllm.connector.config import parse_extra_config
from kvmem.memory.storage import SlotShape, TensorKVStorage
from kvmem.tiers import Faults, OffloadConfig, OffloadManager
from kvmem.tiers.blocks import key_name
from kvmem.tiers.config import SettingNames
from kvmem.units import GiB

SHAPE = SlotShape(num_kv=2, block_size=4, num_heads=2, head_dim=8)
BLOCK_NBYTES = 2 * SHAPE.elements_per_block * 4


def test_extra_config_gives_offload_settings_and_faults(tmp_path) -> None:
    config, faults = parse_extra_config({
        "cpu_offload_gib": 0.5, "disk_offload_dir": str(tmp_path), "disk_offload_gib": 2,
        "offload_policy": "seen-twice", "min_load_tokens": 2048,
        "faults": {"store_delay_s": 0.25}})
    key = "KvmemConnector: kv_connector_extra_config[{!r}]".format
    assert config == OffloadConfig(cpu_bytes=GiB // 2, disk_dir=str(tmp_path),
                                   disk_bytes=2 * GiB, policy="seen-twice",
                                   min_load_tokens=2048, names=SettingNames(
                                       key("cpu_offload_gib"), key("disk_offload_dir"),
                                       key("disk_offload_gib"), key("min_load_tokens")))
    assert faults.store_delay_s == 0.25
    assert parse_extra_config({"cpu_offload_gib": 1})[0].disk_bytes == 0
    # a directory that does not exist yet is created by the tier
    new = tmp_path / "a" / "b"
    assert parse_extra_config({"disk_offload_dir": str(new), "disk_offload_gib": 1})[0].disk_dir


@pytest.fixture(scope="module")
def a_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("file") / "not-a-dir"
    path.write_text("x")
    return str(path)


@pytest.mark.parametrize(("extra", "message"), [
    ({}, "both are 0"),
    ({"cpu_offload_gib": -1}, "'cpu_offload_gib'] must be a non-negative number"),
    ({"cpu_offload_gib": "lots"}, "'cpu_offload_gib'] must be a number of GiB"),
    ({"cpu_offload_gib": "4"}, "'cpu_offload_gib'] must be a number of GiB, got '4' (a string"),
    ({"cpu_offload_gib": [4]}, "'cpu_offload_gib'] must be a number of GiB"),
    ({"cpu_offload_gib": float("nan")}, "non-negative number"),
    ({"cpu_offload_gib": True}, "must be a number of GiB"),
    ({"cpu_offload_gib": 1e9}, "'cpu_offload_gib'] 1e+09 exceeds the"),
    ({"cpu_offload_gib": 1, "min_load_tokens": "512"}, "'min_load_tokens'] must be a whole "
                                                       "number of tokens, 0 or more, got '512'"),
    ({"cpu_offload_gib": 1, "min_load_tokens": -1}, "'min_load_tokens'] must be a whole"),
    ({"cpu_offload_gib": 1, "min_load_tokens": True}, "'min_load_tokens'] must be a whole"),
    ({"disk_offload_gib": 1}, "'disk_offload_gib' needs 'disk_offload_dir'"),
    ({"disk_offload_dir": "/x"}, "'disk_offload_dir' needs 'disk_offload_gib'"),
    ({"disk_offload_dir": "FILE", "disk_offload_gib": 1}, "'disk_offload_dir'] 'FILE' is not a "
                                                          "directory"),
    ({"disk_offload_dir": "FILE/x", "disk_offload_gib": 1}, "cannot be created: 'FILE' is not"),
    ({"disk_offload_dir": 7, "disk_offload_gib": 1}, "'disk_offload_dir'] must be a path"),
    ({"disk_offload_dir": "/tmp", "disk_offload_gib": 1e30}, "'disk_offload_gib'] 1e+30 exceeds"),
    ({"cpu_offload_gib": 1, "offload_policy": "mru"}, "'offload_policy'] must be one of lru"),
    ({"cpu_offload_gib": 1, "cpu_gib": 1}, "unknown key 'cpu_gib'"),
    ({"cpu_offload_gib": 1, "faults": {"nope": 1}}, "'faults'] must be an object"),
    ({"cpu_offload_gib": 1, "faults": {"store_delay_s": "1"}}, "['store_delay_s'] must be a float"),
    ({"cpu_offload_gib": 1, "faults": {"disk_full": 1}}, "['disk_full'] must be a bool"),
])
def test_bad_extra_config_is_one_line_error(extra, message, a_file) -> None:
    extra = {k: v.replace("FILE", a_file) if isinstance(v, str) else v for k, v in extra.items()}
    message = message.replace("FILE", a_file)
    with pytest.raises(ConfigError) as info:
        parse_extra_config(extra)
    text = str(info.value)
    assert message in text and "\n" not in text
    assert text.startswith("KvmemConnector: kv_connector_extra_config")


def test_kv_transfer_config_turns_the_connector_on_with_its_settings(tmp_path) -> None:
    config = kv_transfer_config(cpu_offload_gib=0.5, disk_offload_dir=str(tmp_path),
                                disk_offload_gib=2)
    assert config["kv_connector"] == "KvmemConnector"
    assert config["kv_connector_module_path"] == "kvmem.integrations.vllm"
    assert config["kv_load_failure_policy"] == "recompute"
    assert parse_extra_config(config["kv_connector_extra_config"])[0].disk_bytes == 2 * GiB
    with pytest.raises(ConfigError, match="unknown key 'cpu_gib'; known keys: cpu_offload_gib"):
        kv_transfer_config(cpu_gib=1)


def test_settings_are_checked_alone_and_inside_a_multi_connector() -> None:
    """As vLLM's configuration holds them: KvmemConnector alone, or one of MultiConnector's
    connectors (elastic KV memory puts it there)."""
    from types import SimpleNamespace

    from kvmem.integrations.vllm.plugin.config_check import exit_on_bad_settings

    bad = {"cpu_offload_gib": "4"}
    alone = SimpleNamespace(kv_connector="KvmemConnector", kv_connector_extra_config=bad)
    multi = SimpleNamespace(kv_connector="MultiConnector", kv_connector_extra_config={
        "connectors": [{"kv_connector": "KvmemElasticConnector"},
                       {"kv_connector": "KvmemConnector", "kv_connector_extra_config": bad}]})
    for config in (alone, multi):
        with pytest.raises(SystemExit, match=r"\['cpu_offload_gib'\] must be a number"):
            exit_on_bad_settings(config)
    multi.kv_connector_extra_config["connectors"][1]["kv_connector_extra_config"] = {
        "cpu_offload_gib": 0.25}
    exit_on_bad_settings(multi)
    exit_on_bad_settings(SimpleNamespace(kv_connector="OtherConnector",
                                         kv_connector_extra_config=bad))
    exit_on_bad_settings(None)


class Holder:
    def hold(self, block_ids) -> None:
        pass

    def release(self, block_ids) -> None:
        pass


def _manager(tmp_path, events: list, cpu_blocks: int, disk_blocks: int) -> OffloadManager:
    storage = TensorKVStorage(8, 2, SHAPE, torch.float32)
    config = OffloadConfig(cpu_bytes=cpu_blocks * BLOCK_NBYTES,
                           disk_dir=str(tmp_path) if disk_blocks else None,
                           disk_bytes=disk_blocks * (BLOCK_NBYTES + 200))
    return OffloadManager(config, storage, 2, Holder(), model="tiny", layout="l",
                          faults=Faults(), on_change=lambda *e: events.append(e))


def test_tier_index_changes_are_reported_in_order(tmp_path) -> None:
    events: list = []
    mgr = _manager(tmp_path, events, cpu_blocks=2, disk_blocks=0)
    keys = [(0, i.to_bytes(16, "little")) for i in range(3)]
    names = [key_name(k) for k in keys]
    mgr.offer([1, 2], keys[:2])
    mgr.drain()
    mgr.offer([3], keys[2:])
    mgr.drain()
    mgr.shutdown()
    # the third block evicts the least recently stored one from a two-block tier (a
    # later store: a job's own blocks never evict one another)
    assert events == [("cpu", names[0], True), ("cpu", names[1], True),
                      ("cpu", names[0], False), ("cpu", names[2], True)]


def test_disk_blocks_of_an_earlier_process_are_reported_at_start(tmp_path) -> None:
    first: list = []
    mgr = _manager(tmp_path, first, cpu_blocks=0, disk_blocks=4)
    keys = [(0, i.to_bytes(16, "little")) for i in range(2)]
    mgr.offer([1, 2], keys)
    mgr.drain()
    mgr.shutdown()
    assert sorted(first) == sorted(("disk", key_name(k), True) for k in keys)
    again: list = []
    _manager(tmp_path, again, cpu_blocks=0, disk_blocks=4).shutdown()
    assert sorted(again) == sorted(first)


def test_a_read_only_disk_directory_is_accepted_and_one_it_cannot_create_is_not(tmp_path):
    """A volume mounted read-only (filled by other instances) is a disk tier that loads
    and stores nothing (it used to be refused as not writable); a directory that would
    have to be created there is still refused in one line."""
    import subprocess

    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,ro", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        config, _ = parse_extra_config({"disk_offload_dir": str(mount),
                                        "disk_offload_gib": 0.0005})
        assert config.disk_dir == str(mount)
        with pytest.raises(ConfigError, match="cannot be created: .* is not writable"):
            parse_extra_config({"disk_offload_dir": str(mount / "new"),
                                "disk_offload_gib": 0.0005})
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
