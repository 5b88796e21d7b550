"""A URL's query string as `kvmem plan`'s flags, read by the CLI's own parser.

Keys are the flags' names as argparse stores them (``tp``, ``layer_partition``,
``kv_cache_memory_bytes``), values as typed after the flag; a key may repeat where the flag
does (``gpu``), a switch takes ``true`` or ``false``, an empty value is the flag's default.
``model`` is a catalog name and ``config`` a pasted config.json (then ``model``, if given,
is the name the engine command uses). The page is the output, so `--json` and `--check`
are not taken, nor any flag that reads or writes a file on this machine (`--profile`,
`--plot`): a page may be served to other machines, and a query string must not reach the
server's files.

Every error is the CLI's one line, with the field it is about where it names one. The
page's own bounds on a request (``kvmem.ui.limits``) come first: a value's length, the
layout's ranks, each count a flag takes.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import parse_qsl

from kvmem.errors import KvmemError, UnknownModelError
from kvmem.plan import invocation
from kvmem.spec import ModelSpec
from kvmem.ui import limits

CONFIG = "config"  # the pasted config.json: the one key that is no flag
_OUTPUT = frozenset({"json", "check", "help"})  # what the page itself shows
_FILES = frozenset({"profile", "plot", "from_vllm_log"})  # read or write this machine's files
_TRUE, _FALSE = ("true", "1", "on", "yes"), ("false", "0", "off", "no")
# names the planner gives settings in its errors -> the flag that sets them
_SETTINGS = {
    "tensor_parallel_size": "tp", "pipeline_parallel_size": "pp",
    "layer partition": "layer_partition", "unknown dtype": "kv_cache_dtype",
    "unknown GPU": "gpu", "GPUs": "gpu", "GPU memory": "gpu_memory",
    "cpu_offload_bytes": "weight_offload_gib", "KV budget policy": "kv_budget",
    "unknown model": "model",
}


class QueryError(KvmemError):
    """A query the planner refuses: the CLI's one-line message and the field it names."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # the CLI prints this line; the page shows it
        raise QueryError(message, blame(message))


@cache
def plan_parser() -> argparse.ArgumentParser:
    """`kvmem plan`'s parser: the flags, types, choices and checks of the command line."""
    parser = _Parser(prog="kvmem plan", add_help=False)
    invocation.add_arguments(parser)
    # a disk tier's directory is a name in the plan: never looked up on this server
    parser.set_defaults(check_disk_dir=False)
    return parser


def offered(action: argparse.Action) -> bool:
    """Whether the page takes this flag (not output switches, not this machine's files)."""
    names_a_file = "FILE" in str(action.metavar or "")
    return not (action.dest in _OUTPUT or action.dest in _FILES or names_a_file)


@cache
def _actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in plan_parser()._actions if offered(a)}


def is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0  # store_true: a flag without a value


def repeats(action: argparse.Action) -> bool:
    return isinstance(action, argparse._AppendAction)


@cache
def _blame_patterns() -> tuple[tuple[re.Pattern, str], ...]:
    names: dict[str, str] = dict(_SETTINGS)
    for dest, action in _actions().items():
        names.update({option: dest for option in action.option_strings})
        if "_" in dest:  # a setting's own name (max_model_len); short ones are common words
            names[dest] = dest
    return tuple((re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])"), dest)
                 for name, dest in names.items())


def blame(message: str) -> str | None:
    """The field an error is about: the flag or setting it names first."""
    found = [(m.start(), -len(m.group()), dest)
             for pattern, dest in _blame_patterns() if (m := pattern.search(message))]
    return min(found)[2] if found else None


@dataclass
class Query:
    """A parsed query: the CLI's namespace and the model it plans."""

    args: argparse.Namespace
    spec: ModelSpec


def _spec(model: str, config: str) -> tuple[ModelSpec, str]:
    """The model from the catalog or the Hub, or from the pasted config.json (never from a
    file), and its name in the engine commands: its hub id, as `kvmem plan` names it,
    or the name given with the config (else its ``_name_or_path``, else ``MODEL``)."""
    from kvmem.spec import spec_from_config
    from kvmem.spec.catalog import named_spec

    if config.strip():
        try:
            cfg = json.loads(config)
        except json.JSONDecodeError as e:
            raise QueryError(f"config.json: not valid JSON ({e.msg} at line {e.lineno})",
                             CONFIG) from None
        except (ValueError, RecursionError) as e:  # a number of 4,300+ digits, deep nesting
            raise QueryError(f"config.json: not valid JSON ({e})", CONFIG) from None
        label = model or (cfg.get("_name_or_path") if isinstance(cfg, dict) else None)
        try:
            return spec_from_config(cfg, name=str(label or "config.json")), str(label or "MODEL")
        except KvmemError as e:
            raise QueryError(str(e), CONFIG) from None
    if not model:
        raise QueryError("give a model: a catalog name (see `kvmem models`) or a pasted "
                         "config.json", "model")
    try:
        # the catalog's, else the Hub's, asked anonymously: the page serves others, who must
        # not read private or gated repos with this server's HF_TOKEN
        spec = named_spec(model, hub_token=False)
        return spec, spec.name
    except KvmemError as e:
        raise QueryError(str(e), "model") from None


def _flag_argv(action: argparse.Action, key: str, value: str) -> list[str]:
    if is_switch(action):
        if value.lower() in _TRUE:
            return [action.option_strings[0]]
        if value.lower() in _FALSE:
            return []
        raise QueryError(f"argument {'/'.join(action.option_strings)}: give true or false, "
                         f"got {value!r}", key)
    return [f"{action.option_strings[0]}={value}"]  # '=': a value may start with '-'


def _short(text: str, most: int = 80) -> str:
    """``text`` as an error quotes it: cut when long (a message stays one short line)."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}... ({len(text):,} characters)"


def _check_value(key: str, value: str) -> None:
    if key != CONFIG and len(value) > limits.MAX_VALUE_CHARS:
        raise QueryError(f"{_short(key)} is {len(value):,} characters long; the page takes "
                         f"at most {limits.MAX_VALUE_CHARS:,}",
                         key if key in _actions() else None)


def _flag_name(dest: str) -> str:
    return _actions()[dest].option_strings[0]


def _check_flags(args: argparse.Namespace) -> None:
    """The page's bounds on the parsed flags (``limits.FLAG_BOUNDS``, the ranks)."""
    for dest, bound in limits.FLAG_BOUNDS.items():
        value = getattr(args, dest, None)
        if isinstance(value, int) and value > bound:
            raise QueryError(f"argument {_flag_name(dest)}: at most {bound:,} on this page, "
                             f"got {value:,}", dest)
    ranks = args.tp * args.pp
    if ranks > limits.MAX_WORLD:
        raise QueryError(f"argument --tp: tp x pp is {ranks:,} ranks; the page plans at most "
                         f"{limits.MAX_WORLD:,}", "tp")
    if getattr(args, "speculative_config", None) is not None:
        _check_draft(args.speculative_config)


def _check_draft(text: str) -> None:
    """A speculative draft named by ``model`` is read as MODEL is: a catalog name or a Hub
    repo id, never a path on this machine (`kvmem plan` reads a path first)."""
    from kvmem.spec.catalog import find_entry
    from kvmem.spec.hub import is_repo_id

    field = "speculative_config"
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        return  # the command's own line says where
    except (ValueError, RecursionError) as e:
        raise QueryError(f"argument --speculative-config: not valid JSON ({e})", field) from None
    draft = config.get("model") if isinstance(config, dict) else None
    if not isinstance(draft, str):
        return
    try:
        named = find_entry(draft) is not None
    except UnknownModelError:
        named = is_repo_id(draft)
    try:
        on_disk = named and Path(draft).expanduser().exists()
    except (OSError, ValueError):
        on_disk = True
    if not named or on_disk:
        raise QueryError(f"--speculative-config: field 'model' {_short(draft)} is no catalog "
                         "name or Hub repo id; the page reads no file of the server", field)


def parse_query(query: str) -> Query:
    """The plan a query string asks for, checked as `kvmem plan` checks its flags."""
    actions = _actions()
    try:
        pairs = parse_qsl(query, keep_blank_values=True, max_num_fields=200)
    except ValueError as e:
        raise QueryError(f"cannot read the query string ({e})") from None
    argv: list[str] = []
    model = config = ""
    for key, value in pairs:
        _check_value(key, value)
        action = actions.get(key)
        if key == CONFIG:
            config = value
        elif action is None:
            known = any(a.dest == key for a in plan_parser()._actions)
            raise QueryError(f"{_short(key)} " + (
                "is for the command line (`kvmem plan`), not the page" if known
                else "is no flag of `kvmem plan`"))
        elif not action.option_strings:
            model = value.strip()
        elif value != "":
            argv += _flag_argv(action, key, value)
    spec, served = _spec(model, config)
    args = plan_parser().parse_args([*argv, "--", served])
    _check_flags(args)
    return Query(args, spec)


def run_query(query: str) -> tuple[argparse.Namespace, invocation.PlanRun]:
    """The flags a query string gives and the `kvmem plan` run they ask for."""
    parsed = parse_query(query)
    try:
        return parsed.args, invocation.build(parsed.args, parsed.spec)
    except KvmemError as e:
        raise QueryError(str(e), blame(str(e))) from None


_MODEL_HELP = ("a catalog name or alias (`kvmem models` lists them; type to search), or a "
               "Hugging Face Hub repo id, org/name")


def _field(action: argparse.Action) -> dict:
    default = action.default if action.default not in (None, False) else None
    flag = action.option_strings[0] if action.option_strings else None
    return {"name": action.dest, "flag": flag,
            "help": (action.help or "") if flag else _MODEL_HELP, "metavar": action.metavar,
            "kind": "switch" if is_switch(action) else "choice" if action.choices else "text",
            "choices": list(action.choices) if action.choices else None,
            "default": None if default is None else str(default), "repeats": repeats(action)}


def form() -> dict:
    """What the page builds its form from: `kvmem plan`'s flags by group (those the page
    takes), the catalog's models and GPUs, the KV dtypes."""
    from kvmem.plan.gpus import GPU_MEMORY_GIB
    from kvmem.spec import KV_DTYPE_CHOICES, catalog

    groups = []
    for group in plan_parser()._action_groups:
        fields = [_field(a) for a in group._group_actions if offered(a)]
        if fields:
            groups.append({"title": "model" if fields[0]["flag"] is None else group.title,
                           "fields": fields})
    return {"groups": groups,
            "models": [{"id": e.hf_id, "aliases": list(e.aliases)} for e in catalog()],
            "gpus": [{"name": name, "gib": gib} for name, gib in GPU_MEMORY_GIB.items()],
            "kv_dtypes": list(KV_DTYPE_CHOICES)}
