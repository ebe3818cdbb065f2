"""`dlcctl`: inspect and steer a running coordinator.

    dlcctl status                    versions, last step, batches, queues, sync in progress, samplers, the
                                     desired sampler count (fleet) and why
    dlcctl samplers                  registered samplers with version and health
    dlcctl syncs [--limit N]         sync history, newest first
    dlcctl plan K                    the plan of batch K (prompt groups, task ids, ledger status)
    dlcctl batches [--status S]      ledger entries (planned / complete / trained)
    dlcctl eval [--set S]            evaluations while training: avg@n, pass@k... per version and eval set
    dlcctl model                     the starting model the coordinator vouches for (its manifest's sha256)
    dlcctl sync --reason TEXT        request a sync: the trainer's next step report answers publish

Tables for people; `--json` prints the reply as JSON for scripts (field names as in
protos/coordinator.proto, enums by name, int64 as numbers). `--address` (env DLC_ADDRESS, default
127.0.0.1:50051), `--token` (better the env DLC_TOKEN, which stays off the process list: with a token set on the
coordinator every command needs one; the read-only DLC_DASHBOARD_TOKEN serves all but `sync`),
`--tls-ca` (env DLC_TLS_CA: CA or server certificate PEM; enables TLS), `--tls-server-name` (env
DLC_TLS_SERVER_NAME: the name to check in the certificate when the address is not in it). Inside a compose service, the
service's DLC_COORDINATOR__ADDRESS / DLC_COORDINATOR__AUTH_TOKEN / DLC_COORDINATOR__TLS_CA serve when those are unset, and each token
variable may be given as NAME_FILE, a file holding it (in a swarm service: `docker exec <coordinator> dlcctl status`).
Exit code 1 on an RPC error, 2 on a usage error. Also runnable as `python -m coordinator.dlcctl`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import grpc
from google.protobuf.message import Message

from protos import coordinator_pb2 as pb
from rlcommon.config import ConfigError, read_secret_file
from rlcommon.rpc import CoordinatorClient

__all__ = ["main", "message_to_dict", "build_parser"]

DEFAULT_ADDRESS = "127.0.0.1:50051"


# ---------------------------------------------------------------------------------------------- JSON


def message_to_dict(msg: Message) -> dict[str, Any]:
    """A protobuf message as plain JSON-able data: every field present (unset messages and optional
    scalars as null), enums by name, int64 as numbers (unlike json_format, which quotes them), NaN and
    infinities as null."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: _value_to_json(value_field, v) for k, v in sorted(value.items())}
        elif field.is_repeated:
            out[field.name] = [_value_to_json(field, v) for v in value]
        elif field.has_presence and not msg.HasField(field.name):
            out[field.name] = None
        else:
            out[field.name] = _value_to_json(field, value)
    return out


def _value_to_json(field: Any, value: Any) -> Any:
    if field.message_type is not None:
        return message_to_dict(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None  # NaN / inf are not JSON
    if field.enum_type is not None:
        return (
            field.enum_type.values_by_number[value].name
            if value in field.enum_type.values_by_number
            else value
        )
    return value


# -------------------------------------------------------------------------------------------- tables


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _ago(timestamp: float, now: float) -> str:
    if not timestamp:
        return "-"
    seconds = max(0.0, now - timestamp)
    if seconds < 120:
        return f"{seconds:.1f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _clock(timestamp: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(timestamp)) if timestamp else "-"


def _enum_label(enum_value: int, enum_type: Any, prefix: str) -> str:
    name = enum_type.Name(enum_value)
    return name.removeprefix(prefix).lower()


def _health(value: int) -> str:
    return _enum_label(value, pb.SamplerHealth, "SAMPLER_")


def _batch_status(value: int) -> str:
    return _enum_label(value, pb.BatchStatus, "BATCH_")


def _sync_state(value: int) -> str:
    return _enum_label(value, pb.SyncState, "SYNC_")


def _samplers_table(samplers: Sequence[pb.SamplerInfo], now: float) -> str:
    if not samplers:
        return "no samplers registered"
    rows = [
        (
            s.sampler_id,
            s.weight_version,
            _health(s.health) + (f" ({s.health_detail})" if s.health_detail else ""),
            _ago(s.last_heartbeat_at, now),
            "yes" if s.subscribed else "no",
            s.num_inflight_tasks,
            s.num_rollouts,
            f"{s.hostname}:{s.pid}" if s.hostname else (str(s.pid) if s.pid else "-"),
        )
        for s in samplers
    ]
    return _table(
        ("SAMPLER", "VERSION", "HEALTH", "HEARTBEAT", "STREAM", "INFLIGHT", "ROLLOUTS", "PROCESS"), rows
    )


def _syncs_table(syncs: Sequence[pb.SyncRecord]) -> str:
    if not syncs:
        return "no syncs yet"
    rows = [
        (
            s.sync_id,
            s.weight_version,
            s.step,
            _sync_state(s.state),
            _clock(s.started_at),
            f"{s.duration_s:.2f} s" if s.ended_at else "-",
            f"{len(s.acked_samplers)}/{len(s.expected_samplers)}",
            ",".join(s.unhealthy_samplers) or "-",
            s.reason,
        )
        for s in syncs
    ]
    return _table(
        ("SYNC", "VERSION", "STEP", "STATE", "STARTED", "DURATION", "ACKED", "UNHEALTHY", "REASON"), rows
    )


def _depth(count: int) -> str:
    return "?" if count < 0 else str(count)  # -1: the coordinator could not read it


def _counts_line(c: pb.BatchCounts) -> str:
    limit = f" of {c.limit}" if c.limit else ""
    return (
        f"{c.total}{limit} planned so far: {c.planned} sampling, {c.complete} complete, {c.trained} trained "
        f"(trained through batch {c.trained_through})"
    )


def _fleet_line(f: pb.FleetSize) -> str:
    """The desired sampler count and why (coordinator/fleet.py); a coordinator that decided nothing yet sends none."""
    if not f.reason:
        return "no decision yet"
    return (f"desired {f.desired} samplers ({f.serving} serving, {f.starting} starting, {f.draining} draining; "
            f"min {f.min}, max {f.max}): {f.reason}")


def _format_status(s: pb.GetStatusResponse, now: float) -> str:
    lines = [
        ("run", s.run_id),
        ("sync policy", f"{s.sync_policy}: {s.sync_policy_detail}"),
        ("published version", f"{s.published_version} (trainer at {s.trainer_version})"),
        ("last ess_lag", f"{s.last_ess_lag:.4f}" if s.HasField("last_ess_lag") else "-"),
    ]
    if s.HasField("last_step"):
        step = s.last_step
        answer = "publish" if step.publish else "keep"
        lines.append(
            (
                "last step",
                f"{step.step} (batch {step.batch_id}, {_ago(step.reported_at, now)}): "
                f"{answer}, {step.reason}",
            )
        )
    else:
        lines.append(("last step", "-"))
    lines.append(("batches", _counts_line(s.batches)))
    lines.append(
        (
            "plan",
            f"B={s.batch_size} groups x G={s.group_size} samples, "
            f"at most {s.max_inflight_batches} batches ahead of the trainer",
        )
    )
    lines.append(
        (
            "queues",
            f"tasks {_depth(s.queues.tasks)}, rollouts {_depth(s.queues.rollouts)}, "
            f"dead letters {_depth(s.queues.deadletter)}",
        )
    )
    if s.slots_reissued:
        lines.append(("re-issued", f"{s.slots_reissued} slots of stalled batches (see `batches`)"))
    if s.HasField("sync_in_progress"):
        sync = s.sync_in_progress
        waiting = [
            x
            for x in sync.expected_samplers
            if x not in sync.acked_samplers and x not in sync.unhealthy_samplers
        ]
        lines.append(
            (
                "sync",
                f"#{sync.sync_id} to version {sync.weight_version} in progress for "
                f"{max(0.0, now - sync.started_at):.1f} s, waiting for {', '.join(waiting) or '-'}",
            )
        )
    else:
        lines.append(("sync", f"none in progress ({s.num_syncs} so far)"))
    if s.pending_manual_triggers:
        lines.append(("manual sync", "pending: " + "; ".join(s.pending_manual_triggers)))
    healthy = sum(1 for x in s.samplers if x.health == pb.SAMPLER_HEALTHY)
    others = [f"{n} {label}" for health, label in ((pb.SAMPLER_DRAINING, "draining"), (pb.SAMPLER_LEFT, "left"))
              if (n := sum(1 for x in s.samplers if x.health == health))]
    lines.append(("samplers", ", ".join([f"{len(s.samplers)} registered", f"{healthy} healthy", *others])))
    lines.append(("fleet", _fleet_line(s.fleet)))
    width = max(len(k) for k, _ in lines)
    head = "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)
    return head + ("\n\n" + _samplers_table(s.samplers, now) if s.samplers else "")


def _format_plan(plan: pb.BatchPlan) -> str:
    summary = plan.summary
    head = (
        f"batch {summary.batch_id}: {_batch_status(summary.status)}, {summary.num_groups} groups x "
        f"{summary.group_size} samples, planned {_clock(summary.planned_at)}"
        + (f", complete {_clock(summary.complete_at)}" if summary.complete_at else "")
        + (
            f", trained {_clock(summary.trained_at)} at step {summary.trained_step}"
            + (f" (rollouts from {_by_sampler(summary.rollouts_by_sampler)})" if summary.rollouts_by_sampler else "")
            if summary.trained_at
            else ""
        )
        + f", weight version hint {plan.weight_version_hint}"
        + (
            f", stalled: {summary.reissued_slots} slots re-issued in {summary.num_reissues} re-issues"
            if summary.num_reissues
            else ""
        )
    )
    rows = [
        (
            g.group_id,
            g.task_id,
            g.prompt_index,
            g.num_prompt_tokens,
            json.dumps(g.prompt),
            " ".join(f"{k}={v}" for k, v in sorted(g.payload.items())),
        )
        for g in plan.groups
    ]
    return head + "\n\n" + _table(("GROUP", "TASK", "PROMPT#", "TOKENS", "PROMPT", "PAYLOAD"), rows)


def _by_sampler(counts) -> str:
    """`id=n ...` of a batch's rollouts per sampler, most first; "-" before it is trained."""
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def _format_batches(reply: pb.ListBatchesResponse) -> str:
    rows = [
        (
            b.batch_id,
            _batch_status(b.status),
            _clock(b.planned_at),
            _clock(b.complete_at),
            _clock(b.trained_at),
            b.trained_step if b.trained_step >= 0 else "-",
            b.reissued_slots or "-",
            _by_sampler(b.rollouts_by_sampler),
        )
        for b in reply.batches
    ]
    headers = ("BATCH", "STATUS", "PLANNED", "COMPLETE", "TRAINED", "STEP", "REISSUED", "SAMPLERS")
    table = _table(headers, rows) if rows else "no batches"
    return f"batches: {_counts_line(reply.counts)}\n\n{table}"


def _format_evals(reply: pb.ListEvalsResponse) -> str:
    if not reply.evals:
        return "no evaluations (config `eval`: every_versions, at_start, at_end)"

    def metric(e: pb.EvalEntry, name: str, digits: int = 3) -> str:
        return f"{e.metrics[name]:.{digits}f}" if name in e.metrics and math.isfinite(e.metrics[name]) else "-"

    rows = [
        (
            e.weight_version,
            e.step,
            e.eval_set,
            "logged" if e.complete else "sampling",
            e.num_problems,
            metric(e, f"avg@{e.n}"),
            metric(e, "pass@1"),
            f"{metric(e, f'pass@{e.n}')} (n={e.n})",
            metric(e, "response_length", 1),
            metric(e, "truncated_frac"),
            "-".join(str(v) for v in sorted(set(e.sampled_versions))) or "-",
            e.reason,
        )
        for e in reply.evals
    ]
    headers = ("VERSION", "STEP", "SET", "STATUS", "PROBLEMS", "AVG@N", "PASS@1", "PASS@N", "LENGTH", "TRUNCATED",
               "SAMPLED BY", "REASON")
    return f"{reply.num_rounds} eval rounds planned\n\n{_table(headers, rows)}"


# ---------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # Accepted before or after the command (SUPPRESS: a later position does not reset an earlier one).
    common.add_argument(
        "--address",
        default=argparse.SUPPRESS,
        help=f"coordinator host:port (env DLC_ADDRESS, default {DEFAULT_ADDRESS})",
    )
    common.add_argument("--token", default=argparse.SUPPRESS, help="shared token (env DLC_TOKEN)")
    common.add_argument(
        "--tls-ca", default=argparse.SUPPRESS, help="CA / server certificate PEM: use TLS (env DLC_TLS_CA)"
    )
    common.add_argument(
        "--tls-server-name", default=argparse.SUPPRESS,
        help="name to verify in the server certificate (env DLC_TLS_SERVER_NAME)",
    )
    common.add_argument(
        "--timeout", type=float, default=argparse.SUPPRESS, help="seconds per call (default 10)"
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON for scripts"
    )

    parser = argparse.ArgumentParser(
        prog="dlcctl", description="Inspect and steer a running coordinator.", parents=[common]
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "status", parents=[common], help="versions, last step, batches, queues, syncs, samplers, desired fleet size"
    )
    commands.add_parser("samplers", parents=[common], help="registered samplers with version and health")
    syncs = commands.add_parser("syncs", parents=[common], help="sync history, newest first")
    syncs.add_argument("--limit", type=int, default=20, help="how many syncs (default 20)")
    plan = commands.add_parser("plan", parents=[common], help="the plan of one batch")
    plan.add_argument("batch_id", type=int, metavar="K", help="batch id")
    batches = commands.add_parser("batches", parents=[common], help="ledger entries of planned batches")
    batches.add_argument("--status", choices=("planned", "complete", "trained"), default=None)
    batches.add_argument("--start", type=int, default=0, help="first batch id")
    batches.add_argument("--limit", type=int, default=100)
    evals = commands.add_parser("eval", parents=[common], help="evaluations while training, newest version first")
    evals.add_argument("--set", dest="eval_set", default="", help="only this eval set")
    evals.add_argument("--limit", type=int, default=100, help="the newest N rounds (default 100)")
    commands.add_parser("model", parents=[common],
                        help="the starting model the coordinator vouches for: its manifest's sha256 (samplers check "
                             "the weight server's against it)")
    sync = commands.add_parser("sync", parents=[common], help="request a sync at the trainer's next step")
    sync.add_argument("--reason", required=True, help="why (recorded in the sync history)")
    return parser


def _env(*names: str) -> str | None:
    """The first of the environment variables that is set and not empty."""
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _secret(*names: str) -> str | None:
    """As `_env`, where each NAME may also be given as NAME_FILE, a file holding it (a swarm secret)."""
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
        if os.environ.get(f"{name}_FILE"):
            try:
                return read_secret_file(f"{name}_FILE", os.environ[f"{name}_FILE"])
            except ConfigError as err:
                raise SystemExit(f"dlcctl: {err}") from None
    return None


_BATCH_STATUS = {"planned": pb.BATCH_PLANNED, "complete": pb.BATCH_COMPLETE, "trained": pb.BATCH_TRAINED}


def _request(args: argparse.Namespace) -> tuple[str, Message]:
    """The RPC of the command and its request."""
    command = args.command
    if command == "status":
        return "GetStatus", pb.GetStatusRequest()
    if command == "samplers":
        return "ListSamplers", pb.ListSamplersRequest()
    if command == "syncs":
        return "ListSyncs", pb.ListSyncsRequest(limit=args.limit)
    if command == "plan":
        return "GetBatchPlan", pb.GetBatchPlanRequest(batch_id=args.batch_id)
    if command == "batches":
        status = _BATCH_STATUS.get(args.status, pb.BATCH_STATUS_UNSPECIFIED)
        return "ListBatches", pb.ListBatchesRequest(status=status, start_batch_id=args.start, limit=args.limit)
    if command == "eval":
        return "ListEvals", pb.ListEvalsRequest(limit=args.limit, eval_set=args.eval_set)
    if command == "model":
        return "GetStartingModel", pb.GetStartingModelRequest()
    if command == "sync":
        return "TriggerSync", pb.TriggerSyncRequest(reason=args.reason)
    raise AssertionError(command)  # argparse restricts the choices


def _format(args: argparse.Namespace, reply: Any, now: float) -> str:
    """The reply of the command as text for people."""
    command = args.command
    if command == "status":
        return _format_status(reply, now)
    if command == "samplers":
        return _samplers_table(reply.samplers, now)
    if command == "syncs":
        more = f"\n({len(reply.syncs)} of {reply.total} shown)" if reply.total > len(reply.syncs) else ""
        return _syncs_table(reply.syncs) + more
    if command == "plan":
        return _format_plan(reply.plan)
    if command == "batches":
        return _format_batches(reply)
    if command == "eval":
        return _format_evals(reply)
    if command == "model":
        return (f"starting model {reply.name_or_path}: {reply.num_files} files, {reply.num_bytes / 1e9:.2f} GB\n"
                f"manifest sha256 {reply.manifest_sha256} (of the weight server's /v1/model/manifest.json as "
                "canonical JSON)")
    if command == "sync":
        return (
            "sync requested: the trainer's next step report answers publish "
            f"(reason 'manual: {args.reason.strip()}')\npending manual syncs: {len(reply.pending_reasons)}"
        )
    raise AssertionError(command)


def _run(args: argparse.Namespace, client: CoordinatorClient, out: TextIO) -> None:
    method, request = _request(args)
    # A command line fails fast (no waiting for the coordinator, no second try): the person decides.
    reply = client.call(method, request, timeout_s=getattr(args, "timeout", 10.0), retry=False)
    if getattr(args, "json", False):
        json.dump(message_to_dict(reply), out, indent=2)
        out.write("\n")
    else:
        out.write(_format(args, reply, time.time()) + "\n")


def main(argv: list[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    address = (
        getattr(args, "address", None) or _env("DLC_ADDRESS", "DLC_COORDINATOR__ADDRESS") or DEFAULT_ADDRESS
    )
    tls_ca = getattr(args, "tls_ca", None) or _env("DLC_TLS_CA", "DLC_COORDINATOR__TLS_CA")
    tls_server_name = getattr(args, "tls_server_name", None) or _env(
        "DLC_TLS_SERVER_NAME", "DLC_COORDINATOR__TLS_SERVER_NAME"
    )
    token = getattr(args, "token", None) or _secret(
        "DLC_TOKEN", "DLC_COORDINATOR__AUTH_TOKEN", "DLC_DASHBOARD_TOKEN", "DLC_COORDINATOR__DASHBOARD_TOKEN"
    )
    try:
        client = CoordinatorClient(
            address, token=token, tls_ca=tls_ca, tls_server_name=tls_server_name, wait_for_ready=False
        )
    except ValueError as error:
        err.write(f"dlcctl: error: {error}\n")
        return 2
    with client:
        try:
            _run(args, client, out)
        except grpc.RpcError as error:
            code = error.code()
            detail = error.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE:
                detail = f"cannot reach the coordinator at {address} ({detail})"
            elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                detail = f"cannot reach the coordinator at {address} (no answer within {getattr(args, 'timeout', 10.0):g} s)"
            elif code == grpc.StatusCode.UNAUTHENTICATED:
                detail += "; pass --token or set DLC_TOKEN (the read-only DLC_DASHBOARD_TOKEN serves the read commands)"
            elif code == grpc.StatusCode.PERMISSION_DENIED:
                detail += "; this command needs the run's write token (DLC_TOKEN), not the read-only one or a role's"
            err.write(f"dlcctl: error: {code.name}: {detail}\n")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
