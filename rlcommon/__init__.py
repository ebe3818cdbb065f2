"""The shared package: the contracts every service speaks, and nothing else.

Config (`config`), the bus's wire format and streams (`wire`, `bus`, `redis_acl`, `embedded_redis`), the names
of plan slots (`plan_ids`), published weight versions and their verification (`weight_store`), the one
coordinator client (`rpc`), models and tokenizers (`models`: resolution, presets, builder, `tokenizer`),
tasks and rewards, metrics, logging and the services' entry-point runner (`entrypoint`). The three services
(coordinator, sampler_svc, trainer_svc) import only this package and `protos`, never each other
(tests/unit/test_layers.py). Imports no torch at package level.
"""
