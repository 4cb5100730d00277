"""gflags spellings for hixl's daemons, and mooncake_master's flags for hixl-master.

Launch scripts start `mooncake_master` with gflags syntax and Mooncake's flag names;
`translate` turns such a command line into the one hixl-master's argparse parser reads,
so those scripts run unchanged:

- every spelling gflags takes: `-flag=value`, `--flag=value`, `-flag value`,
  `--flag value`; booleans as `--flag`, `--flag=true|false` (also t/f, yes/no, y/n, 1/0)
  and `--noflag`; `--flagfile=FILE` (one flag per line, `#` comments);
- every hixl-master flag in dash and underscore spelling (`--fast-port`, `--fast_port`);
- Mooncake's flags: those hixl has a meaning for are hixl-master flags (the parser lists
  them) or are translated here (`-v`, `--ha_backend_*`, `--config_path`); the RDMA, SSD,
  CXL, snapshot, event and task flags are accepted and reported as unused (`UNUSED`);
- an unknown flag is refused naming the closest real one.

hixl-agent reads its command line through the same `translate` with `mooncake=False`:
gflags' and both dash/underscore spellings, `--flagfile`, closest-flag suggestions, and
no mooncake_master names.

The parser stays the single source of what hixl-master means by a flag (its help, types
and config keys); this module only knows Mooncake's names and gflags' syntax.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

#: gflags' words for a boolean value
BOOL_WORDS = {"true": True, "t": True, "yes": True, "y": True, "1": True,
              "false": False, "f": False, "no": False, "n": False, "0": False}
#: --flagfile may name files that name files; this deep at most
MAX_FLAGFILE_DEPTH = 8
#: gflags' own help flags, all answered with hixl-master's --help
HELP_FLAGS = ("help", "helpfull", "helpshort", "h")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_MS = {None: 1, "ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}


class FlagError(ValueError):
    """A command line a daemon cannot take; the message names the flag and the fix."""


def parse_bool(text: str) -> bool:
    """gflags' booleans: true/false, t/f, yes/no, y/n, 1/0 (any case)."""
    word = text.strip().lower()
    if word not in BOOL_WORDS:
        raise argparse.ArgumentTypeError(
            f"expected true or false (or t/f, yes/no, y/n, 1/0), got {text!r}")
    return BOOL_WORDS[word]


def duration_ms(text: str) -> int:
    """Mooncake's durations: raw milliseconds, or a number with ms, s, m or h."""
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"expected milliseconds or a duration like 500ms, 10s, 5m, 1h; got {text!r}")
    return int(round(float(match[1]) * _DURATION_MS[match[2]]))


class BoolFlag(argparse.Action):
    """A boolean flag that also takes a value: `--flag` sets true, `--flag=false` false,
    so a flag can override a true from the config file or the environment."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: bool = False,
                 help: str | None = None, **_: object) -> None:
        super().__init__(option_strings, dest, nargs="?", const=True, default=default,
                         type=parse_bool, metavar="BOOL", help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


@dataclass(frozen=True)
class Unused:
    """A mooncake_master flag hixl-master accepts and does not use: its value's kind
    (checked as gflags would) and why it has no meaning here."""

    kind: str  # "bool", "int", "float", "str" or "duration"
    why: str


def _unused(kind_names: dict[str, Iterable[str]], why: str) -> dict[str, Unused]:
    return {name: Unused(kind, why) for kind, names in kind_names.items() for name in names}


_SSD = "SSD/NoF/file offload: hixl's store keeps values in its clients' host memory"
_SNAPSHOT = ("snapshots: hixl-master keeps committed metadata in --data-dir or on etcd, "
             "always")
#: Mooncake master flags (mooncake_master --helpfull) with no meaning in hixl-master
UNUSED: dict[str, Unused] = {
    **_unused({"bool": ["enable_offload", "enable_disk_eviction", "offload_on_evict",
                        "offload_force_evict", "promotion_on_hit"],
               "int": ["global_file_segment_size", "quota_bytes", "offloading_queue_limit",
                       "nof_heartbeat_failures_threshold", "nof_heartbeat_interval_sec",
                       "nof_heartbeat_probe_timeout_ms", "promotion_admission_threshold",
                       "promotion_max_per_heartbeat", "promotion_queue_limit"],
               "float": ["offload_cap_ratio", "nof_eviction_high_watermark_ratio",
                         "nof_eviction_ratio"],
               "str": ["root_fs_dir"]}, _SSD),
    **_unused({"bool": ["enable_cxl"], "int": ["cxl_size"], "str": ["cxl_path"]},
              "CXL memory: hixl's segments are host memory"),
    **_unused({"bool": ["enable_snapshot", "enable_snapshot_restore"],
               "int": ["snapshot_child_timeout_seconds", "snapshot_interval_seconds",
                       "snapshot_retention_count"],
               "str": ["snapshot_backup_dir", "snapshot_catalog_backend_connstring",
                       "snapshot_catalog_backend_type", "snapshot_catalog_store_connstring",
                       "snapshot_catalog_store_type", "snapshot_object_store_type",
                       "snapshot_payload_backend_type", "snapshot_payload_store_type"]},
              _SNAPSHOT),
    **_unused({"bool": ["enable_oplog"],
               "int": ["oplog_batch_max_entries", "oplog_poll_interval_ms",
                       "batch_oplog_retry_timeout_sec"]},
              "OpLog replication: hixl's standbys load the metadata from etcd when elected"),
    **_unused({"bool": ["enable_kv_events", "kv_events_emit_legacy_compat",
                        "kv_events_emit_object_key"],
               "int": ["kv_events_block_size", "kv_events_dp_rank", "kv_events_queue_capacity"],
               "str": ["kv_events_additional_salt", "kv_events_backend_id",
                       "kv_events_bind_endpoint", "kv_events_lora_name",
                       "kv_events_model_name", "kv_events_tenant_id"]},
              "KV cache events over ZMQ: not published"),
    **_unused({"int": ["max_total_finished_tasks", "max_total_pending_tasks",
                       "max_total_processing_tasks", "pending_task_timeout_sec",
                       "processing_task_timeout_sec", "max_retry_attempts"]},
              "copy/move tasks: not served"),
    **_unused({"float": ["dynamic_replication_admission_qps_threshold"],
               "int": ["dynamic_replication_heat_window_seconds",
                       "dynamic_replication_max_memory_replicas"],
               "str": ["dynamic_replication_mode"]},
              "dynamic replication: replicas are what each put asks for"),
    **_unused({"int": ["max_threads", "rpc_thread_num"]},
              "hixl-master serves calls on one event loop and the store call endpoint's "
              "threads"),
    **_unused({"int": ["rpc_conn_timeout_seconds"], "bool": ["rpc_enable_tcp_no_delay"]},
              "tuning of Mooncake's coro_rpc transport (hixl-master speaks gRPC and its "
              "store call endpoint, always with TCP_NODELAY)"),
    **_unused({"str": ["memory_allocator"]},
              "hixl-master always uses its offset allocator (Mooncake's default)"),
    **_unused({"bool": ["enable_multi_tenants"],
               "str": ["tenant_quota_connector_type", "tenant_quota_connector_uri"]},
              "multi-tenant quotas: not enforced"),
    **_unused({"str": ["pod_name", "pod_namespace"]}, "Kubernetes label routing: not used"),
    **_unused({"bool": ["enable_metadata_cleanup_on_timeout"]},
              "the HTTP metadata server keeps what its clients put until they delete it"),
    **_unused({"bool": ["allow_evict_soft_pinned_objects"]},
              "hixl's eviction takes soft-pinned objects only after all others, always"),
    **_unused({"duration": ["max_kv_soft_pin_ttl"]},
              "a put's soft pin TTL is not capped"),
    **_unused({"bool": ["logtostderr", "alsologtostderr", "colorlogtostderr"],
               "int": ["minloglevel", "stderrthreshold", "logbuflevel", "logbufsecs",
                       "max_log_size"],
               "str": ["log_dir", "vmodule"]},
              "glog's: hixl-master logs to stderr (--log-level, --log-json)"),
}


@dataclass
class Translation:
    """hixl-master's command line (`argv`) and what was accepted but is not used
    (`unused`: one line per flag, for a warning each)."""

    argv: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


def _canonical(name: str) -> str:
    return name.replace("-", "_")


def _flag_table(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every spelling's canonical name (dashes as underscores) -> its argparse action."""
    table: dict[str, argparse.Action] = {}
    for action in parser._actions:
        for option in action.option_strings:
            table.setdefault(_canonical(option.lstrip("-")), action)
    return table


@dataclass(frozen=True)
class _Vocabulary:
    """Whose command line is read: its flags, its program name (for the hint), and
    whether mooncake_master's names are taken too."""

    table: dict[str, argparse.Action]
    prog: str
    mooncake: bool


def _closest(token: str, vocabulary: _Vocabulary) -> str:
    """The nearest real flag, spelt in the token's style (dashes or underscores)."""
    written = token.lstrip("-").partition("=")[0]
    name = _canonical(written)
    names = [*vocabulary.table, "flagfile"]
    if vocabulary.mooncake:
        names += [*UNUSED, "v", "config_path", "ha_backend_type", "ha_backend_connstring"]
    found = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if not found:
        return f" ({vocabulary.prog} --help lists the flags)"
    dashed = "-" in written and "_" not in written
    return f"; did you mean --{found[0].replace('_', '-') if dashed else found[0]}?"


def _check_unused_value(token: str, kind: str, value: str) -> None:
    """Refuse a value gflags would refuse for the flag's type, naming the flag."""
    checks = {"bool": parse_bool, "int": int, "float": float, "duration": duration_ms}
    check = checks.get(kind)
    if check is None:
        return
    try:
        check(value)
    except (ValueError, argparse.ArgumentTypeError):
        raise FlagError(f"{token}: {value!r} is not a valid {kind} value") from None


def _config_file_flags(path: str) -> list[str]:
    """Mooncake's --config_path file (JSON, or YAML: keys are flag names) as flags."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise FlagError(f"--config_path {path}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise FlagError(f"--config_path {path}: not JSON or YAML: {exc}") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise FlagError(f"--config_path {path}: expected an object of flag names to values, "
                        f"got {type(data).__name__}")
    flags = []
    for key, value in data.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (list, tuple)):
            text = ",".join(str(v) for v in value)
        elif isinstance(value, dict) or value is None:
            raise FlagError(f"--config_path {path}: key {key!r} must be a plain value, got "
                            f"{json.dumps(value)}")
        else:
            text = str(value)
        flags.append(f"--{key}={text}")
    return flags


def _flagfile_flags(path: str) -> list[str]:
    """gflags' --flagfile: one flag per line; blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise FlagError(f"--flagfile {path}: cannot read it: {exc.strerror}") from None
    return [line.strip() for line in lines
            if line.strip() and not line.lstrip().startswith("#")]


def translate(parser: argparse.ArgumentParser, argv: Sequence[str],
              mooncake: bool = True) -> Translation:
    """`parser`'s command line for `argv` in any spelling gflags or argparse takes (and
    mooncake_master's flag names when `mooncake`: hixl-master's).

    Known flags come out as `--option=value` (the option's first spelling, so argparse's
    own checks name it); `--config_path` flags come first, so the command line wins.
    FlagError names an unknown flag (and the closest real one) or a missing value.
    """
    vocabulary = _Vocabulary(_flag_table(parser), parser.prog, mooncake)
    result = Translation()
    front: list[str] = []
    _translate(vocabulary, list(argv), result, front, depth=0)
    result.argv = front + result.argv
    return result


class _Tokens:
    """The command line being read, one token at a time (a flag may take the next)."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.next = 0

    def pop(self) -> str | None:
        if self.next >= len(self.argv):
            return None
        self.next += 1
        return self.argv[self.next - 1]

    def rest(self) -> list[str]:
        rest, self.next = self.argv[self.next:], len(self.argv)
        return rest


@dataclass(frozen=True)
class _Flag:
    """One flag token: as written, its canonical name, and its `=value` if it has one."""

    token: str
    name: str
    value: str | None

    def value_or_next(self, tokens: _Tokens) -> str:
        """Its value: after `=`, else the next token (gflags' `--flag value`)."""
        if self.value is not None:
            return self.value
        following = tokens.pop()
        if following is None:
            raise FlagError(f"flag {self.token} needs a value")
        return following


def _translate(vocabulary: _Vocabulary, argv: list[str], result: Translation,
               front: list[str], depth: int) -> None:
    table = vocabulary.table
    out = result.argv
    tokens = _Tokens(argv)
    while (token := tokens.pop()) is not None:
        if token == "--":
            out.extend(tokens.rest())
            return
        if not token.startswith("-") or token == "-" or _is_number(token):
            out.append(token)  # argparse refuses stray words, naming them
            continue
        name, has_value, value = token.lstrip("-").partition("=")
        flag = _Flag(token, _canonical(name), value if has_value else None)
        if flag.name in HELP_FLAGS:
            out.append("--help")
            continue
        action = table.get(flag.name)
        if action is not None:
            if isinstance(action, BoolFlag):
                word = "true" if flag.value is None else flag.value
                out.append(f"{action.option_strings[0]}={word}")
            elif action.nargs == 0:  # --version and the like: a bare flag, or =true
                if flag.value is None or _flag_bool(flag):
                    out.append(action.option_strings[0])
            else:
                out.append(f"{action.option_strings[0]}={flag.value_or_next(tokens)}")
            continue
        if not (_negation(vocabulary, flag, result)
                or _mooncake_only(vocabulary, flag, tokens, result, front, depth)):
            raise FlagError(f"unknown flag {token}{_closest(token, vocabulary)}")


def _flag_bool(flag: _Flag) -> bool:
    try:
        return parse_bool(flag.value or "")
    except argparse.ArgumentTypeError as exc:
        raise FlagError(f"{flag.token}: {exc}") from None


def _negation(vocabulary: _Vocabulary, flag: _Flag, result: Translation) -> bool:
    """gflags' `--noflag` (also `--no-flag`) for a boolean flag: ours set false, or an
    unused mooncake_master one noted."""
    table = vocabulary.table
    negated = flag.name[2:].lstrip("_") if flag.name.startswith("no") else ""
    if not negated or flag.value is not None:
        return False
    target = table.get(negated)
    if isinstance(target, BoolFlag):
        result.argv.append(f"{target.option_strings[0]}=false")
        return True
    unused = UNUSED.get(negated) if vocabulary.mooncake else None
    if unused is not None and unused.kind == "bool":
        result.unused.append(f"--{negated}: accepted, not used: {unused.why}")
        return True
    return False


def _mooncake_only(vocabulary: _Vocabulary, flag: _Flag, tokens: _Tokens,
                   result: Translation, front: list[str], depth: int) -> bool:
    """A gflags or mooncake_master flag with no flag of its name in the parser:
    translated into ours (True), noted as unused (True), or not known (False)."""
    table = vocabulary.table
    out = result.argv
    if flag.name == "flagfile" or vocabulary.mooncake and flag.name == "config_path":
        path = flag.value_or_next(tokens)
        if depth >= MAX_FLAGFILE_DEPTH:
            raise FlagError(f"{flag.token}: files naming files more than "
                            f"{MAX_FLAGFILE_DEPTH} deep")
        if flag.name == "config_path":  # lowest precedence: in front of the command line
            nested = Translation()
            _translate(vocabulary, _config_file_flags(path), nested, front, depth + 1)
            front.extend(nested.argv)
            result.unused.extend(nested.unused)
        else:  # gflags reads a flagfile in place
            _translate(vocabulary, _flagfile_flags(path), result, front, depth + 1)
        return True
    if not vocabulary.mooncake:
        return False
    if flag.name == "v":  # glog verbosity: any level above 0 is hixl's DEBUG
        level = flag.value_or_next(tokens)
        try:
            verbose = int(level)
        except ValueError:
            raise FlagError(f"{flag.token}: glog verbosity must be an integer, got "
                            f"{level!r}") from None
        if verbose > 0:
            out.append("--log-level=DEBUG")
        return True
    if flag.name == "ha_backend_type":
        backend = flag.value_or_next(tokens)
        if backend.strip().lower() != "etcd":
            raise FlagError(f"{flag.token}: hixl-master's high availability runs on etcd "
                            f"only; got {backend!r} (use --ha_backend_type=etcd with "
                            "--etcd_endpoints)")
        return True
    if flag.name == "ha_backend_connstring":
        out.append(f"{table['etcd_endpoints'].option_strings[0]}="
                   f"{flag.value_or_next(tokens)}")
        return True
    unused = UNUSED.get(flag.name)
    if unused is None:
        return False
    if unused.kind != "bool":
        _check_unused_value(flag.token, unused.kind, flag.value_or_next(tokens))
    elif flag.value is not None:
        _check_unused_value(flag.token, "bool", flag.value)
    result.unused.append(f"--{flag.name}: accepted, not used: {unused.why}")
    return True


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


__all__ = ["BOOL_WORDS", "UNUSED", "BoolFlag", "FlagError", "Translation", "duration_ms",
           "parse_bool", "translate"]
