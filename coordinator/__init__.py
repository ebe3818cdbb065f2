"""The coordinator service: batch plan and ledger, weight versions, sync policy, samplers (gRPC).

Files: `planner.py` (batch plan + ledger), `sync_policy.py` (when to publish), `syncs.py` (sync records,
weight-update broadcast), `samplers.py` (sampler registry and health), `state.py` (Redis persistence),
`service.py` (the plain `Coordinator` composing them), `server.py` (grpc.aio servicers), `auth.py`
(token and TLS), `dlcctl.py` (command line client). Run: `python -m coordinator --config FILE`.
"""
