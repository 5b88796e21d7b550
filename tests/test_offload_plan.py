"""`kvmem plan` with KV offload tiers: blocks and tokens per tier for the real layout, the
same capacity the stores really have, and weight offload kept apart under its own flag."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvmem.cli import main
from kvmem.memory.storage import SlotShape, TensorKVStorage
from kvmem.tiers import OffloadConfig, OffloadManager
from kvmem.tiers.config import DISK_ENTRY_OVERHEAD_BYTES, tier_capacity
from kvmem.units import GiB

H100 = ["--gpu", "H100"]


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2)])
def test_json_kv_offload_counts_blocks_of_every_rank_share(capsys, tmp_path, tp, pp):
    """A tier stores one row per block holding every rank's share, so a tier holds its
    budget over the ranks' summed bytes_per_block; a disk block also carries its header."""
    out = plan_json(capsys, "qwen3-8b", *H100, "--tp", str(tp), "--pp", str(pp),
                    "--cpu-offload-gib", "3", "--disk-offload-dir", str(tmp_path),
                    "--disk-offload-gib", "10")
    section = out["kv_offload"]
    row = sum(r["bytes_per_block"] for r in out["ranks"])
    # Qwen3-8B: 36 layers, 8 KV heads of 128, bf16: 147,456 bytes per token, 16-token blocks
    assert row == 147_456 * 16
    block_size = out["engine"]["block_size"]
    assert section["block_bytes"] == row and section["policy"] == "lru"
    assert section["cpu"] == {"bytes": 3 * GiB, "block_bytes": row, "blocks": 3 * GiB // row,
                              "tokens": 3 * GiB // row * block_size}
    disk = section["disk"]
    assert disk["dir"] == str(tmp_path) and disk["bytes"] == 10 * GiB
    assert row < disk["block_bytes"] < row + 100
    assert disk["blocks"] == 10 * GiB // disk["block_bytes"] < 10 * GiB // row
    assert disk["tokens"] == disk["blocks"] * block_size


def test_no_offload_flags_no_section_and_weight_offload_is_its_own_flag(capsys):
    base = plan_json(capsys, "qwen3-8b", *H100)
    assert "kv_offload" not in base
    kv_tier = plan_json(capsys, "qwen3-8b", *H100, "--cpu-offload-gib", "8")
    assert kv_tier["ranks"][0]["weights_bytes"] == base["ranks"][0]["weights_bytes"]
    assert kv_tier["settings"]["cpu_offload_bytes"] == 0
    weights = plan_json(capsys, "qwen3-8b", *H100, "--weight-offload-gib", "4")
    assert "kv_offload" not in weights
    assert weights["ranks"][0]["weights_bytes"] == base["ranks"][0]["weights_bytes"] - 4 * GiB


def test_text_and_kvmem_command_show_the_tiers(capsys, tmp_path):
    argv = ["plan", "qwen3-8b", *H100, "--cpu-offload-gib", "2", "--disk-offload-dir",
            str(tmp_path), "--disk-offload-gib", "1", "--offload-policy", "seen-twice"]
    section = plan_json(capsys, *argv[1:])["kv_offload"]
    assert main([*argv, "--engine", "kvmem"]) == 0
    text = capsys.readouterr().out
    assert f"{section['cpu']['blocks']:,} blocks ({section['cpu']['tokens']:,} tokens)" in text
    assert f"{section['disk']['blocks']:,} blocks ({section['disk']['tokens']:,} tokens)" in text
    assert f"--cpu-offload-gib 2 --disk-offload-dir {tmp_path} --disk-offload-gib 1 " \
           "--offload-policy seen-twice" in text
    assert main([*argv, "--engine", "vllm"]) == 0
    text = capsys.readouterr().out
    assert "--disk-offload-gib" not in text and "offload tiers are kvmem's" in text


@pytest.mark.parametrize(("argv", "match"), [
    (["--disk-offload-gib", "1"], "needs --disk-offload-dir"),
    (["--disk-offload-dir", "/tmp/x"], "needs --disk-offload-gib"),
    (["--cpu-offload-gib", "-2"], "--cpu-offload-gib must be a non-negative"),
    (["--weight-offload-gib", "-2"], "--weight-offload-gib must be a non-negative"),
    (["--disk-offload-dir", "/etc/hostname", "--disk-offload-gib", "1"],
     "--disk-offload-dir /etc/hostname is not a directory"),
    (["--disk-offload-dir", "/etc/hostname/kv", "--disk-offload-gib", "1"],
     "--disk-offload-dir /etc/hostname/kv cannot be created: /etc/hostname is not a directory"),
])
def test_bad_offload_input_is_one_line_exit_2(capsys, argv, match):
    assert main(["plan", "qwen3-8b", *H100, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("kvmem: error:") and match in err


def test_plan_with_offload_imports_no_torch(tmp_path):
    code = ("import sys; from kvmem.cli import main; "
            f"main(['plan', 'qwen3-8b', '--gpu', 'H100', '--cpu-offload-gib', '1', "
            f"'--disk-offload-dir', {str(tmp_path)!r}, '--disk-offload-gib', '1', '--json']); "
            "sys.exit(3 if 'torch' in sys.modules else 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr


class _Holder:
    def hold(self, block_ids):
        pass

    def release(self, block_ids):
        pass


def test_capacity_is_what_the_stores_really_hold(tmp_path):
    """Fill both tiers past their budgets: each ends holding exactly tier_capacity's blocks
    (the disk budget is one byte short of a sixth block with its header)."""
    shape = SlotShape(num_kv=2, block_size=4, num_heads=2, head_dim=8)
    storage = TensorKVStorage(40, 3, shape, torch.float32)
    row = 3 * shape.elements_per_block * 4
    config = OffloadConfig(cpu_bytes=7 * row + row - 1, disk_dir=str(tmp_path),
                           disk_bytes=6 * (row + DISK_ENTRY_OVERHEAD_BYTES) - 1)
    capacity = {t.tier: t for t in tier_capacity(config, row, shape.block_size)}
    assert capacity["cpu"].num_blocks == 7 and capacity["disk"].num_blocks == 5
    mgr = OffloadManager(config, storage, 3, _Holder(), model="m", layout="l")
    try:
        ids = list(range(1, 31))
        mgr.offer(ids, [(0, i.to_bytes(16, "little")) for i in ids])
        mgr.drain()
        for name, stats in mgr.stats().items():
            tier = capacity[name]
            assert stats.capacity_bytes <= tier.budget_bytes
            assert stats.used_bytes == tier.num_blocks * tier.block_nbytes, name
    finally:
        mgr.shutdown()
