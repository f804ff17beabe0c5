"""The queue on Redis, in three faces along who uses it:

- :class:`JobStore` (store.py), the API's: records, groups and logs; enqueue, cancel, expire,
  delete. Housekeeping uses it as the API does.
- :class:`Consumer` (consumer.py), a worker's: pick, confirm, wait, reclaim, take over, renew,
  ack, with the delivery types.
- :class:`EventWriter` (writer.py), both's: the fenced writes to a job's token shard (a worker's
  flush, the API's end of a job in place of its worker), with :class:`Outbound`, one event on its
  way out.

Each face is built on one Redis and holds its own writer (base.py: what both hold, and the event
log both read). Every write that must be all-or-nothing is one Lua script (called through its
packer in shared/scripts.py) or one MULTI; every command names keys through
:class:`shared.keys.Keys` only.
"""

from shared.queue.base import Logged, Side
from shared.queue.consumer import Consumer, Delivery, DeliveryState, Held, Picked, Swap
from shared.queue.store import JobStore, level_of
from shared.queue.writer import Ending, EventWriter, Fence, Flushed, Outbound, now_ms

__all__ = ["JobStore", "Consumer", "EventWriter", "Side", "Logged", "Delivery", "DeliveryState", "Held", "Picked",
           "Swap", "Outbound", "Ending", "Flushed", "Fence", "now_ms", "level_of"]
