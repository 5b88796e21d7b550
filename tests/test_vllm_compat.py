"""``kvmem.integrations.vllm.compat``'s checker and ``kvmem vllm-check``, in kvmem's venv
(no vLLM here). What the checks find in real vLLM 0.32 and 0.33 is checked by
``tests/test_vllm_contract.py``."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

from kvmem.cli import main
from kvmem.errors import ConfigError
from kvmem.integrations.vllm import compat
from kvmem.integrations.vllm.compat import Missing, Need, check_need

FAKE = '''
def get_kv_cache_configs(vllm_config, kv_cache_specs, available_memory,
                         global_kv_cache_groups):
    pass

def renamed(vllm_config, specs, available_memory):
    pass

class Base:
    def hook(self, request, num_computed_tokens):
        pass

    def step(self):
        self.hook(None, 0)

    def grown(self, request, num_computed_tokens, num_lookahead):
        pass

    def start_load_kv(self, forward_context, **kwargs):
        pass
'''


@pytest.fixture
def fake(tmp_path, monkeypatch) -> str:
    (tmp_path / "fakevllm_core.py").write_text(textwrap.dedent(FAKE))
    (tmp_path / "fakevllm_broken.py").write_text("raise RuntimeError('no device found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fakevllm_core"
    for name in ("fakevllm_core", "fakevllm_broken"):
        sys.modules.pop(name, None)


def missing(need: Need) -> str:
    with pytest.raises(Missing) as err:
        check_need(need)
    text = str(err.value)
    assert "\n" not in text
    return text


def test_further_parameters_of_a_wrapped_function_are_accepted(fake):
    check_need(Need(f"{fake}:get_kv_cache_configs",
                    ("vllm_config", "kv_cache_specs", "available_memory")))


def test_a_renamed_or_missing_object_is_named(fake):
    assert missing(Need(f"{fake}:renamed", ("vllm_config", "kv_cache_specs"))) == (
        "fakevllm_core.renamed takes (vllm_config, specs, available_memory), kvmem needs "
        "(vllm_config, kv_cache_specs, ...)")
    assert missing(Need(f"{fake}:gone")) == "fakevllm_core.gone is missing"
    assert missing(Need(f"{fake}:Base.gone", ())) == "fakevllm_core.Base.gone is missing"
    assert missing(Need("fakevllm_broken:x")) == (
        "cannot import fakevllm_broken (RuntimeError: no device found)")


def test_a_hook_must_take_exactly_what_kvmem_implements(fake):
    check_need(Need(f"{fake}:Base.hook", ("request", "num_computed_tokens"), exact=True))
    check_need(Need(f"{fake}:Base.start_load_kv", ("forward_context", "**"), exact=True))
    assert "kvmem needs (request, num_computed_tokens)" in missing(
        Need(f"{fake}:Base.grown", ("request", "num_computed_tokens"), exact=True))


def test_a_call_site_elastic_memory_hooks_into_is_checked(fake):
    assert compat.missing_calls(((f"{fake}:Base.step", "self.hook("),)) == []
    assert compat.missing_calls((
        (f"{fake}:Base.step", ".has_pending_push_work()"),
        (f"{fake}:Base.gone", ".x()"),
        ("builtins:len", ".x()"),
    )) == ["fakevllm_core.Base.step no longer calls .has_pending_push_work()",
           "fakevllm_core.Base.gone is missing",
           "builtins.len has no source to check for .x()"]


def test_every_connector_hook_is_checked():
    from kvmem.integrations.vllm.compat import CONNECTOR_HOOKS, CONNECTOR_NEEDS

    checked = {n.path.rsplit(".", 1)[1] for n in CONNECTOR_NEEDS if n.exact}
    assert set(CONNECTOR_HOOKS) <= checked
    # and the connector implements every hook it is checked for (read from its source:
    # importing it needs vLLM)
    text = (Path(compat.__file__).parent / "connector" / "kvmem_connector.py").read_text()
    for hook in CONNECTOR_HOOKS:
        assert f"    def {hook}(self" in text or f"    def {hook}(cls" in text, hook
    # every vLLM class it derives from is checked before its module is imported
    bases = re.search(r"^class KvmemConnector\((.*)\):", text, re.M).group(1)
    for base in (b.strip() for b in bases.split(",")):
        assert any(f":{base}." in n.path for n in CONNECTOR_NEEDS), base


def test_every_vllm_name_the_connector_imports_is_checked():
    """Each name a connector module imports from vLLM when it loads (type-checking imports
    aside) is one of the connector's needs, checked before the modules are imported."""
    import ast

    checked = {n.path.partition(":")[0] + ":" + n.path.partition(":")[2].split(".")[0]
               for n in compat.CONNECTOR_NEEDS}
    checked |= {f"vllm.distributed.kv_events:{name}" for name in compat.EVENT_FIELDS}
    imported = set()
    for path in (Path(compat.__file__).parent / "connector").glob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                imported |= {f"{node.module}:{alias.name}" for alias in node.names}
    assert "vllm.distributed.kv_events:BlockStored" in imported  # the events are read
    assert imported - checked == set()


def test_require_without_vllm_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ConfigError) as err:
        compat.require("connector")
    assert str(err.value) == ("kvmem's vLLM connector needs vLLM, which cannot be imported "
                              "here (ModuleNotFoundError: import of vllm halted; None in "
                              "sys.modules)")


def test_vllm_check_without_vllm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main(["vllm-check"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("vLLM: cannot be imported here (ModuleNotFoundError: import of vllm "
                          "halted; None in sys.modules); kvmem's integration is tested with "
                          "0.32.x, 0.33.x")
    assert "no   plugin" in out and "no   connector" in out
    assert main(["vllm-check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["vllm"] is None and [f["name"] for f in report["features"] if f["works"]] == [
        "environment"]  # kvmem's own settings are read without vLLM
    assert report["tested"] == ["0.32", "0.33"] and "sleep mode" in report["notes"][-1]


@pytest.mark.parametrize(("init", "says"), [
    ("raise ImportError('libcudart.so.12: cannot open shared object file')",
     "ImportError: libcudart.so.12: cannot open shared object file"),
    ("import sys; sys.exit(3)", "importing vllm called sys.exit(3)"),
])
def test_vllm_check_says_why_vllm_does_not_import(tmp_path, monkeypatch, capsys, init, says):
    """A vLLM whose import fails (a missing CUDA library) or exits (a build that finds no
    device) is reported with its reason; the exit used to end the check with no output."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(init + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert main(["vllm-check"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"vLLM: cannot be imported here ({says}); ")
    assert f"vLLM cannot be imported ({says})" in out
    with pytest.raises(ConfigError, match=re.escape(f"cannot be imported here ({says})")):
        compat.require("connector")


def test_vllm_check_reads_kvmems_settings_as_vllm_would(monkeypatch, capsys):
    """It used to say nothing of KVMEM_VLLM_KV_MEMORY=bogus, which vLLM then refuses."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    for name, value in (("KVMEM_VLLM_KV_MEMORY", "bogus"), ("KVMEM_VLLM_KV_BUDGET", "fair"),
                        ("KVMEM_VLLM_KV_MEMORY_LIMT", "1GiB")):
        monkeypatch.setenv(name, value)
    assert main(["vllm-check", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    env = report["features"][-1]
    assert report["notes"][0].startswith("KVMEM_VLLM_KV_MEMORY_LIMT is set but is not one of "
                                         "kvmem's settings")
    assert env["name"] == "environment" and not env["works"]
    assert env["reasons"] == [
        "KVMEM_VLLM_KV_BUDGET='fair': choose one of uniform, proportional, optimal (or leave "
        "it unset)",
        "KVMEM_VLLM_KV_MEMORY='bogus': the only value is 'elastic' (or leave it unset)"]
    for name in ("KVMEM_VLLM_KV_BUDGET", "KVMEM_VLLM_KV_MEMORY_LIMT"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVMEM_VLLM_KV_MEMORY", "elastic")
    monkeypatch.setenv("KVMEM_VLLM_KV_MEMORY_LIMIT", "1GiB")
    main(["vllm-check"])
    assert re.search(r"yes  environment .*KVMEM_VLLM_KV_MEMORY=elastic, "
                     r"KVMEM_VLLM_KV_MEMORY_LIMIT=1GiB", capsys.readouterr().out)
