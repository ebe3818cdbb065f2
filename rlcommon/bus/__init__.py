"""Redis Streams bus: producers and consumer-group consumers of wire messages (DESIGN sections 2, 3).

- connection.py: RedisConnection (its `call` retries while Redis is unreachable), BusUnavailableError,
  BusAuthError, redacted_url, stop_waiting_on_redis and the stop watch (cuts off calls to a Redis that no
  longer answers once the process stops).
- groups.py: consumer-group bookkeeping: the consistent snapshot of a stream's groups and counters (queue
  depth, counter healing), trim_acked, ensure_group.
- producer.py: StreamProducer (send, trim, queue_depth, wait_for_room) and the pipelined XADD (`_add_entries`).
- consumer.py: StreamConsumer (read, claim, dead-letter, reject, ack), Delivery, read_count.
- rlcommon/streams.py: the stream, group and key names, re-exported here (stream_key, DATA_FIELD, ...).

No Lua: every step is a plain command, WATCH or MULTI/EXEC, so no service user may run scripts (a script
that loops would make Redis busy for every client; rlcommon/redis_acl.py).

The names below are re-exported for `from rlcommon.bus import X`; patch a name (tests) in the module that
holds it, not here.
"""

from rlcommon.bus.connection import (
    BusAuthError,
    BusUnavailableError,
    RedisConnection,
    redacted_url,
    stop_waiting_on_redis,
)
from rlcommon.bus.consumer import Delivery, StreamConsumer, read_count
from rlcommon.bus.groups import ensure_group, trim_acked
from rlcommon.bus.producer import StreamProducer
from rlcommon.streams import DATA_FIELD, DEADLETTER, OWNED_GROUPS, ROLLOUTS_GROUP, TASKS_GROUP, stream_key

__all__ = [
    "DATA_FIELD",
    "DEADLETTER",
    "OWNED_GROUPS",
    "ROLLOUTS_GROUP",
    "TASKS_GROUP",
    "BusAuthError",
    "BusUnavailableError",
    "Delivery",
    "RedisConnection",
    "StreamConsumer",
    "StreamProducer",
    "read_count",
    "redacted_url",
    "stop_waiting_on_redis",
    "ensure_group",
    "stream_key",
    "trim_acked",
]
