"""The coordinator's gRPC server (grpc.aio): thin servicers over `service.Coordinator`.

Each RPC validates nothing itself: it calls one method of the plain `Coordinator` on a single worker
thread (coordinator/worker.py: Redis round-trips never block the event loop, the coordinator needs no locks,
and state-changing calls and the tick go before every queued read), converts the result to protobuf, and maps
`CoordinatorError` to a status code: InvalidArgument -> INVALID_ARGUMENT, NotFound -> NOT_FOUND,
FailedPrecondition -> FAILED_PRECONDITION, Redis unreachable -> UNAVAILABLE.

Reads are bounded: at most `coordinator.max_reads_in_flight` read calls at once (more: RESOURCE_EXHAUSTED, which
clients retry with backoff), and equal reads share one answer for `coordinator.read_cache_s`
(coordinator/read_cache.py; any accepted state change makes the next read fresh). With `coordinator.auth_token`
set, every Coordinator method needs a token (coordinator/auth.py), and takes those of the roles `METHOD_ROLES`
gives it: the write token every method, the trainer's token the trainer's calls and the reads, the samplers' token
the samplers' calls, the read-only dashboard token the reads. A sampler call made with the samplers' token must
also carry the session its sampler's registration was given (`RegisterSampler` makes one each time).
The server also runs the standard health service (`grpc.health.v1.Health`, SERVING once the state is
loaded) and server reflection, so stock tools (grpcurl, grpc_health_probe) work.

Lifecycle: `CoordinatorServer(cfg, coordinator)`, `await start()`, `await wait_for_termination()` (or
serve until a signal, see `__main__`), `await stop()`.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator import auth, convert
from coordinator.auth import OPERATOR, SAMPLER, TRAINER, RoleTokens
from coordinator.auth import READ as READ_ROLE
from coordinator.dashboard import DashboardServer
from coordinator.errors import (
    CoordinatorError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from coordinator.read_cache import ReadCache
from coordinator.samplers import LIVE, UNHEALTHY, new_session, session_digest
from coordinator.service import Coordinator
from coordinator.starting_model import ModelUnreadable, NotReady, StartingModel
from coordinator.syncs import WeightBroadcaster
from coordinator.worker import READ, CoordinatorThread
from protos import coordinator_pb2 as pb
from protos import coordinator_pb2_grpc as pb_grpc
from rlcommon.config import RunConfig
from rlcommon.rpc import READS_BUSY

logger = logging.getLogger(__name__)

__all__ = ["METHOD_ROLES", "READ_METHODS", "SAMPLER_METHODS", "SERVICE_NAME", "STATE_CHANGING_METHODS",
           "TRAINER_METHODS", "CoordinatorServicer", "CoordinatorServer"]

T = TypeVar("T")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name


def _full(*names: str) -> frozenset[str]:
    return frozenset(f"/{SERVICE_NAME}/{name}" for name in names)


SAMPLER_METHODS = _full("RegisterSampler", "SubscribeWeightUpdates", "AckWeightVersion", "Heartbeat", "LeaveFleet")
"""The samplers' calls (sampler_svc, rlcommon.coordinator_api.AsyncCoordinator)."""
TRAINER_METHODS = _full("MarkBatchComplete", "ReportBatchProgress", "ReportStep", "AnnouncePublished")
"""The trainer's calls that change the run (trainer_svc, rlcommon.coordinator_api.Coordinator)."""
READ_METHODS = _full("GetStatus", "ListSamplers", "ListSyncs", "GetBatchPlan", "ListBatches", "ListEvals")
"""Methods that only read."""
MODEL_METHODS = _full("GetStartingModel")
"""What every role may ask: the starting model's digest, which a sampler checks the weight server's model against."""
STATE_CHANGING_METHODS = SAMPLER_METHODS | TRAINER_METHODS | _full("TriggerSync")
"""Methods that change the run's state (TriggerSync: the operator's only)."""
METHOD_ROLES: dict[str, frozenset[str]] = {
    **{method: frozenset({OPERATOR, SAMPLER}) for method in SAMPLER_METHODS},
    **{method: frozenset({OPERATOR, TRAINER}) for method in TRAINER_METHODS},
    **{method: frozenset({OPERATOR, TRAINER, READ_ROLE}) for method in READ_METHODS},
    **{method: frozenset({OPERATOR, TRAINER, SAMPLER, READ_ROLE}) for method in MODEL_METHODS},
    f"/{SERVICE_NAME}/TriggerSync": frozenset({OPERATOR}),
}
"""Which roles' tokens each Coordinator method takes (coordinator/auth.py); a method missing here takes the write
token only. The samplers read nothing but the starting model's digest, the trainer reads status and plans."""

_CODES: dict[type[CoordinatorError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """gRPC methods of `Coordinator`; see protos/coordinator.proto for their contracts."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        run: Callable[..., Any],
        broadcaster: WeightBroadcaster,
        submit: Callable[..., Any],
        max_reads_in_flight: int = 16,
        read_cache_s: float = 1.0,
        tokens: RoleTokens | None = None,
        starting_model: StartingModel,
    ) -> None:
        self._core = coordinator
        self._starting_model = starting_model
        self._tokens = tokens
        self._run = run
        self._submit = submit
        self._broadcaster = broadcaster
        self.max_reads_in_flight = max_reads_in_flight
        self.reads_in_flight = 0
        self.reads_refused = 0
        self.reads_served = 0
        self.cache = ReadCache(read_cache_s)

    async def _call(
        self, context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> T:
        """Run `fn` on the coordinator's thread (urgent lane), turning its errors into gRPC status codes; the
        cached read answers are stale afterwards."""
        try:
            return await self._run(fn, *args, **kwargs)
        except BaseException as err:
            await self._abort(context, fn, err)
        finally:
            self.cache.changed()
        raise AssertionError("unreachable: _abort raises")

    async def _read(self, context: grpc.aio.ServicerContext, request: Any, fn: Callable[..., T], *args: Any) -> T:
        """Run the read `fn(*args)` on the coordinator's thread (read lane), shared with equal reads in flight and
        cached for read_cache_s; RESOURCE_EXHAUSTED beyond max_reads_in_flight."""
        if self.reads_in_flight >= self.max_reads_in_flight:
            self.reads_refused += 1
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.reads_in_flight} read calls in flight already ({READS_BUSY} = "
                f"{self.max_reads_in_flight}); retry with backoff",
            )
        self.reads_in_flight += 1
        self.reads_served += 1
        try:
            key = (getattr(fn, "__name__", repr(fn)), type(request).__name__, request.SerializeToString())
            return await self.cache.get(key, lambda: self._run(fn, *args, lane=READ))
        except BaseException as err:
            await self._abort(context, fn, err)
        finally:
            self.reads_in_flight -= 1
        raise AssertionError("unreachable: _abort raises")

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, fn: Callable[..., Any], err: BaseException) -> None:
        """Abort the call with the status code `err` maps to (re-raises cancellation and the like)."""
        from rlcommon.bus import BusUnavailableError

        if not isinstance(err, Exception):
            raise err
        if isinstance(err, CoordinatorError):
            await context.abort(_CODES.get(type(err), grpc.StatusCode.INVALID_ARGUMENT), str(err))
        if isinstance(err, BusUnavailableError):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"coordinator state store unavailable: {err}")
        logger.error("%s failed", getattr(fn, "__name__", fn), exc_info=err)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}")

    # ------------------------------------------------------------------------------------- samplers

    async def _session(self, context: grpc.aio.ServicerContext, request: Any, call: str) -> str | None:
        """The session a sampler call must match: the request's when the call came with the samplers' token
        (PERMISSION_DENIED when it carries none), else None (a call with the write token is not bound)."""
        if self._tokens is None or self._tokens.role_of_call(context.invocation_metadata()) != SAMPLER:
            return None
        if not request.session:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{call}: a call with the samplers' token (role sampler) must carry the session of its sampler's "
                "registration (RegisterSamplerResponse.session): the token is every sampler's, the session one's",
            )
        return request.session

    async def RegisterSampler(
        self, request: pb.RegisterSamplerRequest, context
    ) -> pb.RegisterSamplerResponse:
        session = new_session()
        view, published_version, latest = await self._call(
            context,
            self._core.register_sampler,
            request.sampler_id,
            weight_version=request.weight_version,
            hostname=request.hostname,
            pid=request.pid,
            session_sha256=session_digest(session),
        )
        reply = pb.RegisterSamplerResponse(
            sampler=convert.sampler_pb(view),
            published_version=published_version,
            heartbeat_timeout_s=self._core.ccfg.sampler_heartbeat_timeout_s,
            run_id=self._core.run_id,
            session=session,
        )
        if latest is not None:
            reply.latest.CopyFrom(convert.weight_update_pb(latest))
        return reply

    async def SubscribeWeightUpdates(
        self, request: pb.SubscribeWeightUpdatesRequest, context
    ) -> AsyncIterator[pb.WeightUpdate]:
        session = await self._session(context, request, "SubscribeWeightUpdates")
        await self._call(context, self._core.open_subscription, request.sampler_id, request.weight_version,
                         session=session)
        try:
            async for update in self._broadcaster.updates(after_version=request.weight_version):
                yield convert.weight_update_pb(update)
        finally:
            self._submit(self._core.close_subscription, request.sampler_id)

    async def AckWeightVersion(
        self, request: pb.AckWeightVersionRequest, context
    ) -> pb.AckWeightVersionResponse:
        published, complete = await self._call(
            context,
            self._core.ack_weight_version,
            request.sampler_id,
            weight_version=request.weight_version,
            error=request.error,
            load_s=request.load_s,
            session=await self._session(context, request, "AckWeightVersion"),
        )
        return pb.AckWeightVersionResponse(published_version=published, sync_complete=complete)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        published, health_name = await self._call(
            context,
            self._core.heartbeat,
            request.sampler_id,
            weight_version=request.weight_version,
            num_inflight_tasks=request.num_inflight_tasks,
            num_rollouts=request.num_rollouts,
            num_tokens=request.num_tokens,
            busy_s=request.busy_s,
            session=await self._session(context, request, "Heartbeat"),
        )
        return pb.HeartbeatResponse(published_version=published, health=convert.HEALTH_TO_PB[health_name])

    async def LeaveFleet(self, request: pb.LeaveFleetRequest, context) -> pb.LeaveFleetResponse:
        reissued, health_name = await self._call(
            context, self._core.leave_fleet, request.sampler_id, done=request.done, reason=request.reason,
            session=await self._session(context, request, "LeaveFleet"),
        )
        return pb.LeaveFleetResponse(tasks_reissued=reissued, health=convert.HEALTH_TO_PB[health_name])

    # -------------------------------------------------------------------------------------- trainer

    async def MarkBatchComplete(
        self, request: pb.MarkBatchCompleteRequest, context
    ) -> pb.MarkBatchCompleteResponse:
        record = await self._call(
            context, self._core.mark_batch_complete, request.batch_id, num_rollouts=request.num_rollouts
        )
        return pb.MarkBatchCompleteResponse(batch=convert.batch_summary_pb(record))

    async def ReportBatchProgress(
        self, request: pb.ReportBatchProgressRequest, context
    ) -> pb.ReportBatchProgressResponse:
        answer = await self._call(
            context, self._core.report_batch_progress, request.batch_id, filled_slots=list(request.filled_slots)
        )
        group_size = answer.record.group_size
        return pb.ReportBatchProgressResponse(
            reissued_slots=[group_id * group_size + sample for group_id, sample in answer.reissued_slots],
            stalled_s=answer.stalled_s,
            batch=convert.batch_summary_pb(answer.record),
        )

    async def ReportStep(self, request: pb.ReportStepRequest, context) -> pb.ReportStepResponse:
        answer = await self._call(
            context,
            self._core.report_step,
            step=request.step,
            batch_id=request.batch_id,
            weight_version=request.weight_version,
            stats=dict(request.stats),
            rollouts_by_sampler=dict(request.rollouts_by_sampler),
        )
        return pb.ReportStepResponse(
            publish=answer.decision.publish,
            reason=answer.decision.reason,
            next_weight_version=answer.next_weight_version,
            batches=convert.counts_pb(answer.counts),
            samplers=[convert.sampler_pb(v) for v in answer.samplers],
        )

    async def AnnouncePublished(
        self, request: pb.AnnouncePublishedRequest, context
    ) -> pb.AnnouncePublishedResponse:
        sync, update = await self._call(
            context,
            self._core.announce_published,
            weight_version=request.weight_version,
            path=request.path,
            sha256=request.sha256,
            step=request.step,
            reason=request.reason,
        )
        if update is not None:
            await self._broadcaster.publish(update)
        return pb.AnnouncePublishedResponse(sync=convert.sync_pb(sync))

    # --------------------------------------------------------------------------------------- anyone

    async def GetStartingModel(self, request: pb.GetStartingModelRequest, context) -> pb.GetStartingModelResponse:
        try:
            digest = self._starting_model.digest()
        except NotReady as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        except ModelUnreadable as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return pb.GetStartingModelResponse(name_or_path=digest.name_or_path, manifest_sha256=digest.manifest_sha256,
                                           num_files=digest.num_files, num_bytes=digest.num_bytes)

    async def GetStatus(self, request: pb.GetStatusRequest, context) -> pb.GetStatusResponse:
        return convert.status_pb(await self._read(context, request, self._core.status))

    async def ListSamplers(self, request: pb.ListSamplersRequest, context) -> pb.ListSamplersResponse:
        views = await self._read(context, request, self._core.sampler_views)
        return pb.ListSamplersResponse(samplers=[convert.sampler_pb(v) for v in views])

    async def ListSyncs(self, request: pb.ListSyncsRequest, context) -> pb.ListSyncsResponse:
        records, total = await self._read(context, request, self._core.sync_history, request.limit)
        return pb.ListSyncsResponse(syncs=[convert.sync_pb(r) for r in records], total=total)

    async def GetBatchPlan(self, request: pb.GetBatchPlanRequest, context) -> pb.GetBatchPlanResponse:
        record = await self._read(context, request, self._core.batch_plan, request.batch_id)
        return pb.GetBatchPlanResponse(plan=convert.batch_plan_pb(record))

    async def ListBatches(self, request: pb.ListBatchesRequest, context) -> pb.ListBatchesResponse:
        status = convert.PB_TO_STATUS.get(request.status)
        if request.status and status is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"status: unknown batch status {request.status}"
            )
        records, counts = await self._read(
            context, request, functools.partial(self._core.batches, status=status, start=request.start_batch_id,
                                                limit=request.limit)
        )
        return pb.ListBatchesResponse(
            batches=[convert.batch_summary_pb(r) for r in records], counts=convert.counts_pb(counts)
        )

    async def ListEvals(self, request: pb.ListEvalsRequest, context) -> pb.ListEvalsResponse:
        views, rounds = await self._read(context, request, self._core.evals, request.limit, request.eval_set)
        return pb.ListEvalsResponse(evals=[convert.eval_pb(v) for v in views], num_rounds=rounds)

    async def TriggerSync(self, request: pb.TriggerSyncRequest, context) -> pb.TriggerSyncResponse:
        pending = await self._call(context, self._core.trigger_sync, request.reason)
        return pb.TriggerSyncResponse(pending_reasons=pending)


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1); False for 0.0.0.0, :: and names."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class CoordinatorServer:
    """Serves one `Coordinator` over gRPC, with health, reflection, optional token auth and TLS."""

    def __init__(
        self,
        cfg: RunConfig,
        coordinator: Coordinator,
        *,
        host: str | None = None,
        port: int | None = None,
        metrics: Any | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        starting_model: StartingModel | None = None,
    ) -> None:
        self.cfg = cfg
        self.starting_model = starting_model or StartingModel.from_config(cfg.model, cfg.task)
        """What GetStartingModel vouches for: hashed from its `start()` (`python -m coordinator` calls it at start-up) or
        the first call."""
        self._extra_interceptors = list(interceptors)
        """Run after the token check (tracing, fault injection in tests)."""
        self.coordinator = coordinator
        self.host = cfg.coordinator.host if host is None else host
        self._requested_port = cfg.coordinator.port if port is None else port
        self.port: int | None = None
        self._metrics = metrics
        self._worker: CoordinatorThread | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._broadcaster = WeightBroadcaster()
        self._ticker: asyncio.Task | None = None
        self.servicer: CoordinatorServicer | None = None
        """The gRPC methods, once started (tests read its read counters)."""
        self.dashboard: DashboardServer | None = None
        """The run dashboard, when coordinator.dashboard_port is set (its `port` once started)."""

    @property
    def dial_host(self) -> str:
        """The host clients dial (0.0.0.0 dialed as 127.0.0.1)."""
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]", "") else self.host

    @property
    def address(self) -> str:
        """host:port clients dial."""
        assert self.port is not None, "server not started"
        return f"{self.dial_host}:{self.port}"

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` on the coordinator's thread."""
        assert self._worker is not None, "server not started"
        return await asyncio.wrap_future(self._worker.submit(fn, *args, **kwargs))

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn` on the coordinator's thread without waiting for it."""
        if self._worker is not None:
            self._worker.submit(fn, *args)

    async def start(self) -> None:
        """Load the coordinator's state, bind the port, start serving (health: SERVING). Refuses (ValueError)
        to listen beyond this machine without coordinator.auth_token, and a role token without it (no token
        would be checked: the role would not be the limit its holder thinks)."""
        ccfg = self.cfg.coordinator
        if not ccfg.auth_token and not is_loopback(self.host):
            raise ValueError(
                f"coordinator.host = {self.host!r} listens beyond this machine, and without "
                "coordinator.auth_token anyone who reaches the port could report steps, publish weights and "
                "trigger syncs: set coordinator.auth_token (DLC_COORDINATOR__AUTH_TOKEN; compose: DLC_TOKEN), "
                "or coordinator.host = 127.0.0.1"
            )
        if not ccfg.auth_token and (ccfg.sampler_token or ccfg.trainer_token):
            raise ValueError(
                "coordinator.sampler_token / trainer_token are set but coordinator.auth_token is not: without the "
                "write token the coordinator checks no token at all, so those roles would limit nothing; set "
                "coordinator.auth_token (DLC_COORDINATOR__AUTH_TOKEN; compose: DLC_TOKEN) or unset the role tokens"
            )
        self._worker = CoordinatorThread()
        await self.run(self.coordinator.start)
        try:
            await self._start_grpc(ccfg.auth_token, ccfg.tls_cert, ccfg.tls_key)
        except BaseException:
            await self.run(self.coordinator.stop)
            self._worker.close()
            self._worker = None
            raise
        if ccfg.dashboard_port is not None:
            try:
                self.dashboard = self._start_dashboard()
            except BaseException:
                await self.stop()
                raise
        latest = self.coordinator.latest_update
        if latest is not None:
            await self._broadcaster.publish(latest)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._ticker = asyncio.create_task(self._tick_forever(), name="coordinator-tick")
        logger.info(
            "coordinator of run '%s' serving on %s (%s, %s)",
            self.coordinator.run_id,
            self.address,
            "TLS" if ccfg.tls_cert else "plaintext",
            ("tokens required: " + ", ".join(sorted(RoleTokens.from_config(ccfg).roles))) if ccfg.auth_token
            else "no token",
        )

    def _start_dashboard(self) -> DashboardServer:
        from coordinator.dashboard_data import DashboardData
        from coordinator.planner import tokenizer_for
        from rlcommon.bus import RedisConnection

        cfg, worker = self.cfg, self._worker
        assert worker is not None
        data = DashboardData(
            core=self.coordinator,
            on_coordinator=lambda fn: worker.submit(fn, lane=READ).result(timeout=30),
            conn=RedisConnection.from_config(cfg.redis, url=self.coordinator.redis_url),
            tokenizer=tokenizer_for(cfg.model, cfg.task),
        )
        dashboard = DashboardServer(data, host=self.host, port=cfg.coordinator.dashboard_port,
                                    token=cfg.coordinator.auth_token, read_token=cfg.coordinator.dashboard_token,
                                    hosts=cfg.coordinator.dashboard_hosts, tls_cert=cfg.coordinator.tls_cert,
                                    tls_key=cfg.coordinator.tls_key)
        port = dashboard.start()
        logger.info("dashboard on %s://%s:%d/%s", "https" if cfg.coordinator.tls_cert else "http", self.dial_host, port,
                    " (its API needs a token)" if cfg.coordinator.auth_token or cfg.coordinator.dashboard_token else "")
        return dashboard

    async def _start_grpc(self, token: str | None, tls_cert: str | None, tls_key: str | None) -> None:
        ccfg = self.cfg.coordinator
        tokens = RoleTokens.from_config(ccfg) if token else None
        interceptors = [
            auth.TokenAuthInterceptor(tokens, METHOD_ROLES, service=SERVICE_NAME)
        ] if tokens is not None else []
        interceptors += self._extra_interceptors
        # No SO_REUSEPORT: a second coordinator on a busy port must fail, not share the port's traffic.
        server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
        servicer = CoordinatorServicer(
            self.coordinator, run=self.run, broadcaster=self._broadcaster, submit=self._submit,
            max_reads_in_flight=ccfg.max_reads_in_flight, read_cache_s=ccfg.read_cache_s, tokens=tokens,
            starting_model=self.starting_model,
        )
        self.servicer = servicer
        pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        target = f"{self.host}:{self._requested_port}"
        credentials = auth.server_credentials(tls_cert, tls_key)
        try:
            if credentials is None:
                port = server.add_insecure_port(target)
            else:
                port = server.add_secure_port(target, credentials)
        except RuntimeError as err:
            raise OSError(f"cannot listen on {target}: {err} (port in use, or host not local?)") from None
        if port == 0:
            raise OSError(f"cannot listen on {target} (port in use, or host not local?)")
        await server.start()
        self._server, self.port = server, port

    async def _tick_forever(self) -> None:
        interval = self.coordinator.tick_interval_s
        next_metrics = 0.0
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            try:
                await self.run(self.coordinator.tick)
                if self._metrics is not None and loop.time() >= next_metrics:
                    next_metrics = loop.time() + 2.0
                    self._export_metrics(await self.run(self.coordinator.status, lane=READ))
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("periodic coordinator work failed (retrying)")

    def _export_metrics(self, status: Any) -> None:
        gauges = {
            "published_version": status.published_version,
            "trainer_version": status.trainer_version,
            "batches_trained": status.counts.trained,
            "batches_planned": status.counts.total,
            "samplers_live": sum(1 for s in status.samplers if s.health in LIVE),
            "samplers_unhealthy": sum(1 for s in status.samplers if s.health == UNHEALTHY),
            "syncs": status.num_syncs,
            "tasks_queue_depth": status.tasks_queue_depth,
            "rollouts_queue_depth": status.rollouts_queue_depth,
            "dead_letters": status.deadletter_length,
            "slots_reissued": status.slots_reissued,
            # tasks pending at a sampler served again when it left the fleet / was found lost (coordinator/handback.py)
            "tasks_reissued_left": status.tasks_reissued_left,
            "tasks_reissued_lost": status.tasks_reissued_lost,
        }
        if status.fleet is not None and status.fleet.changed_at > 0:
            # what an orchestrator scales the samplers to (coordinator/fleet.py); not before the coordinator first
            # changed it: until then it only mirrors the samplers registered so far (coordinator.autoscale.acting_count)
            gauges["desired_samplers"] = status.fleet.desired
        if status.last_ess_lag is not None:
            gauges["last_ess_lag"] = status.last_ess_lag
        if self.servicer is not None:  # the read calls' load: answered, computed (the rest shared), refused
            gauges["read_calls"] = self.servicer.reads_served
            gauges["read_calls_computed"] = self.servicer.cache.computed
            gauges["read_calls_refused"] = self.servicer.reads_refused
        for name, value in gauges.items():
            self._metrics.gauge(name, float(value))

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    async def stop(self, grace_s: float = 2.0) -> None:
        """Health NOT_SERVING, end the weight-update streams, stop gRPC, release the run's lock."""
        await self._health.enter_graceful_shutdown()
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
            self._ticker = None
        await self._broadcaster.close()
        if self.dashboard is not None:
            self.dashboard.stop()
            self.dashboard = None
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._worker is not None:
            try:  # releases the run lock; do not hang on an unreachable Redis (the lock expires by itself)
                await asyncio.wait_for(self.run(self.coordinator.stop), timeout=grace_s + 3.0)
            except TimeoutError:
                logger.warning("state store busy or unreachable at shutdown; the run lock expires by itself")
            self._worker.close()
            self._worker = None
        logger.info("coordinator of run '%s' stopped", self.coordinator.run_id)
