"""Every Redis key and channel name the gateway uses, in one place.

Python builds names with the functions below; the Redis function library gets the same
templates as a generated Lua prelude (`lua_prelude`), so no other file spells a key.
Per-queue keys carry the queue name in a hash tag (`{name}`) so that one queue's keys share
a Redis Cluster slot; queue names may therefore not contain braces (see `queues.py`).
"""

from __future__ import annotations

PREFIX = "gw"
PARTITION_PREFIX = "#P/"  # hidden child queues of partitioned queues: "#P/<index>/<parent>"
PRIORITY_PREFIX = "#R/"  # hidden child queues of priority queues: "#R/<priority>/<parent>"
PRIORITY_LEVELS = 10  # priorities 0-9
GROUP = "g"  # the one consumer group of every queue stream
RETURNED_CONSUMER = "~r"  # parks requeued entries until a flow claims them
HOLDING_CONSUMER = "~g"  # message-group queues: entries wait here until their group is free
TIMED_CONSUMER = "~t"  # messages held until their delivery time

# name -> template; "{q}" is a queue name, "{n}" a node id, "{c}" a client id (hex),
# "{s}" a sink name (hex), "{m}" a sink's partition marker (hex).
TEMPLATES: dict[str, str] = {
    "queues": f"{PREFIX}:queues",
    "seq": f"{PREFIX}:seq",
    "nodes": f"{PREFIX}:nodes",
    "events": f"{PREFIX}:ev",
    "sub_version": f"{PREFIX}:subver",
    # queue -> the subscription version that last changed its routes (a sorted set, of the
    # last 10,000 queues changed); and a hash: 'floor' -> the newest version dropped from
    # it, 'generation' -> made with the first, names this Redis's data (gw_routes_since)
    "route_changes": f"{PREFIX}:subchanges",
    "route_changes_state": f"{PREFIX}:subchanges:state",
    "last_created": f"{PREFIX}:lastcreated",  # the latest created_ms a queue was given
    "queue_config": f"{PREFIX}:q:{{{{q}}}}:cfg",
    "queue_stream": f"{PREFIX}:q:{{{{q}}}}:s",
    "queue_stats": f"{PREFIX}:q:{{{{q}}}}:st",
    "queue_subs": f"{PREFIX}:q:{{{{q}}}}:subs",
    "queue_flows": f"{PREFIX}:q:{{{{q}}}}:flows",
    "queue_lease": f"{PREFIX}:q:{{{{q}}}}:lease",
    "queue_wake": f"{PREFIX}:wake:{{{{q}}}}",
    "queue_readers": f"{PREFIX}:q:{{{{q}}}}:readers",
    "queue_reader_baselines": f"{PREFIX}:q:{{{{q}}}}:rbase",
    "queue_kept": f"{PREFIX}:q:{{{{q}}}}:kept",
    "queue_parts": f"{PREFIX}:q:{{{{q}}}}:parts",
    "queue_groups": f"{PREFIX}:q:{{{{q}}}}:groups",
    "queue_last_values": f"{PREFIX}:q:{{{{q}}}}:lvq",
    "queue_timed": f"{PREFIX}:q:{{{{q}}}}:timed",
    # queues holding messages until a delivery time, scored by the earliest (a sorted set)
    "timed_queues": f"{PREFIX}:timedz",
    # queues that stored messages with an expiry, scored by when the expiry sweep should
    # next look at them (a sorted set; +inf: once another is stored or one comes back)
    "expiring_queues": f"{PREFIX}:expz",
    # the same as plain sets, as the release before kept them: adopted by the sweep
    "earlier_timed_queues": f"{PREFIX}:timedq",
    "earlier_expiring_queues": f"{PREFIX}:expq",
    # the expiry sweep's place in each list of a queue's waiting entries: list -> the id of
    # the last entry it read; 'soonest' -> the earliest expiry ahead it read on the way;
    # 'again' -> entries came back to wait since it began reading the lists
    "queue_expiry_cursor": f"{PREFIX}:q:{{{{q}}}}:xcur",
    "queue_group_held": f"{PREFIX}:q:{{{{q}}}}:gheld",
    "queue_sorted": f"{PREFIX}:q:{{{{q}}}}:sorted",
    "queue_members": f"{PREFIX}:q:{{{{q}}}}:members",
    "queue_owner_nodes": f"{PREFIX}:q:{{{{q}}}}:owners",
    "queue_flow_held": f"{PREFIX}:q:{{{{q}}}}:fcheld",
    # entry id -> the flows it must not reach again (AMQP undeliverable-here), space-separated
    "queue_avoid": f"{PREFIX}:q:{{{{q}}}}:avoid",
    "read_queues": f"{PREFIX}:readq",
    "spool_usage": f"{PREFIX}:spool:usage",
    "spool_limits": f"{PREFIX}:spool:limits",
    "spool_alarms": f"{PREFIX}:spool:alarms",
    "spool_alarm_counts": f"{PREFIX}:spool:alarmcounts",
    "spool_events": f"{PREFIX}:spool:ev",
    "spool_notify": f"{PREFIX}:spool:notify",
    "retained": f"{PREFIX}:retained",
    # a topic's retained messages held by a delivery delay (a sorted set by the epoch ms
    # they fall due), and the topics that have some
    "retained_held": f"{PREFIX}:retained:held:{{t}}",
    "retained_held_topics": f"{PREFIX}:retained:heldtopics",
    "direct_nodes": f"{PREFIX}:directnodes",
    "direct_channel": f"{PREFIX}:direct",
    "node_alive": f"{PREFIX}:node:{{n}}",
    # the last heartbeat of any node: "t" (epoch ms) and that node's "ttl" (ms)
    "liveness": f"{PREFIX}:nodes:liveness",
    "liveness_grace": f"{PREFIX}:nodes:grace",  # while it lives, no node is presumed dead
    "node_queues": f"{PREFIX}:node:{{n}}:queues",
    "node_queue_flows": f"{PREFIX}:node:{{n}}:qflows",  # queue -> the node's flows on it
    # parting messages (an MQTT will): the records a node's connections hold, and those
    # whose node died or whose connection ended, by the epoch ms they go (see parting.py)
    "node_parting": f"{PREFIX}:node:{{n}}:parting",
    # a node's connected sessions with a finite expiry: client id (hex) -> expiry (s)
    "node_sessions": f"{PREFIX}:node:{{n}}:sessions",
    "parting_due": f"{PREFIX}:parting:due",
    "sink_batches": f"{PREFIX}:sink:{{s}}:batches",
    "sink_marks": f"{PREFIX}:sink:{{s}}:marks",
    "sink_progress": f"{PREFIX}:sink:{{s}}:progress",
    "sink_progress_times": f"{PREFIX}:sink:{{s}}:progress:at",
    "sink_stored": f"{PREFIX}:sink:{{s}}:stored:{{m}}",
    "client_state": f"{PREFIX}:client:{{c}}",
    "client_received": f"{PREFIX}:client:{{c}}:received",
    "client_claims": f"{PREFIX}:client:{{c}}:claims",
    "client_parting": f"{PREFIX}:client:{{c}}:parting",
}


def _queue_key(name: str, q: str) -> str:
    return TEMPLATES[name].replace("{{q}}", "{" + q + "}")


def _node_key(name: str, n: str) -> str:
    return TEMPLATES[name].replace("{n}", n)


queues = TEMPLATES["queues"]
seq = TEMPLATES["seq"]
nodes = TEMPLATES["nodes"]
liveness = TEMPLATES["liveness"]
liveness_grace = TEMPLATES["liveness_grace"]
events = TEMPLATES["events"]
sub_version = TEMPLATES["sub_version"]
route_changes = TEMPLATES["route_changes"]
route_changes_state = TEMPLATES["route_changes_state"]
last_created = TEMPLATES["last_created"]
retained = TEMPLATES["retained"]
retained_held_topics = TEMPLATES["retained_held_topics"]
direct_nodes = TEMPLATES["direct_nodes"]  # nodes with direct (not spooled) subscribers
direct_channel = TEMPLATES["direct_channel"]  # topic messages for other nodes' direct subscribers
read_queues = TEMPLATES["read_queues"]
timed_queues = TEMPLATES["timed_queues"]
# Spool accounting (gateway/engine/spool_usage.py): byte totals "broker" and "v:<vpn>"
# (with a "format" marker once rebuilt from the queues' own counters);
# quotas "broker", "v:<vpn>" and threshold percents "set" / "clear"; raised threshold
# alarms by scope ("broker", "vpn:<name>", "queue:<name>") and "<set|clear>:<scope>" event
# counts; the stream of threshold events (one consumer group: each event is logged once)
# and the channel that says one was added.
spool_usage = TEMPLATES["spool_usage"]
spool_limits = TEMPLATES["spool_limits"]
spool_alarms = TEMPLATES["spool_alarms"]
spool_alarm_counts = TEMPLATES["spool_alarm_counts"]
spool_events = TEMPLATES["spool_events"]
spool_notify = TEMPLATES["spool_notify"]


def queue_config(q: str) -> str:
    return _queue_key("queue_config", q)


def queue_stream(q: str) -> str:
    return _queue_key("queue_stream", q)


def queue_expiry_cursor(q: str) -> str:
    return _queue_key("queue_expiry_cursor", q)


def queue_stats(q: str) -> str:
    return _queue_key("queue_stats", q)


def queue_subs(q: str) -> str:
    return _queue_key("queue_subs", q)


def queue_flows(q: str) -> str:
    return _queue_key("queue_flows", q)


def queue_lease(q: str) -> str:
    return _queue_key("queue_lease", q)


def queue_wake(q: str) -> str:
    return _queue_key("queue_wake", q)


def queue_readers(q: str) -> str:
    return _queue_key("queue_readers", q)


def queue_reader_baselines(q: str) -> str:
    """Stream reader -> the stream's max-deleted-entry-id when the reader registered from
    where its query began: entries deleted up to it were never the reader's to read."""
    return _queue_key("queue_reader_baselines", q)


def queue_kept(q: str) -> str:
    """Once a queue's last stream reader went: the last delivered entry id then, up to
    which acked entries the readers kept may still stand in the stream."""
    return _queue_key("queue_kept", q)


def queue_parts(q: str) -> str:
    """Partition assignment of a partitioned queue: t:<i> target flow, o:<i> owner flow,
    d:<i> handoff deadline (epoch ms)."""
    return _queue_key("queue_parts", q)


def queue_groups(q: str) -> str:
    """Message groups: group -> the flow that holds it."""
    return _queue_key("queue_groups", q)


def queue_last_values(q: str) -> str:
    """Last value queues: key value -> the entry holding its latest message."""
    return _queue_key("queue_last_values", q)


def queue_timed(q: str) -> str:
    """Messages held until their delivery time: entry id scored by that time (epoch ms)."""
    return _queue_key("queue_timed", q)


def queue_group_held(q: str) -> str:
    """Shared-groups mode: group -> unsettled messages its holder has."""
    return _queue_key("queue_group_held", q)


def queue_sorted(q: str) -> str:
    """Sorted queues: the waiting entries, each a member "<flag><key>\\0<padded id>" of score
    0, so that lexical order is key order, then arrival order (see functions.lua)."""
    return _queue_key("queue_sorted", q)


def queue_members(q: str) -> str:
    """Members of a queue that lives while it has any (an MQTT shared subscription group):
    member -> the epoch ms its membership lasts until (inf: for ever)."""
    return _queue_key("queue_members", q)


def queue_owner_nodes(q: str) -> str:
    """A non-durable queue's other owners: the nodes that declared it while another node
    owned it (one started again after a crash, nodes sharing a config file). The queue
    lives while one of them does: the reaper of its owner hands it to a live one."""
    return _queue_key("queue_owner_nodes", q)


def queue_flow_held(q: str) -> str:
    """Producer flow control: node id -> when (epoch s) the queue last held back one of that
    node's messages; the node's later messages are held too until it offers them again."""
    return _queue_key("queue_flow_held", q)


def queue_avoid(q: str) -> str:
    """Entry id -> the flows it must not reach again (AMQP modified, undeliverable-here)."""
    return _queue_key("queue_avoid", q)


def partition_queue(parent: str, index: int) -> str:
    """Name of the child queue (and so of its keys) holding one partition."""
    return f"{PARTITION_PREFIX}{index}/{parent}"


def priority_queue(parent: str, priority: int) -> str:
    """Name of the child queue holding one priority level of a priority queue."""
    return f"{PRIORITY_PREFIX}{priority}/{parent}"


def node_alive(n: str) -> str:
    return _node_key("node_alive", n)


def node_queue_flows(n: str) -> str:
    return _node_key("node_queue_flows", n)


def node_queues(n: str) -> str:
    return _node_key("node_queues", n)


def node_parting(n: str) -> str:
    return _node_key("node_parting", n)


def node_sessions(n: str) -> str:
    return _node_key("node_sessions", n)


def client_hex(c: str) -> str:
    """A client id as its keys (and the Lua functions that name them) spell it: client ids
    may hold any character, hex keeps the key unambiguous."""
    return c.encode().hex()


def _client_key(name: str, c: str) -> str:
    return TEMPLATES[name].replace("{c}", client_hex(c))


def sink_batches(s: str) -> str:
    """Batches a Spark sink wrote before its markers were timed (a set, expiring a week
    after its last write): read, never written."""
    return TEMPLATES["sink_batches"].replace("{s}", s.encode().hex())


def sink_marks(s: str) -> str:
    """Batches (and batch partitions) a Spark sink already wrote: marker -> the epoch ms it
    was written (idempotent replays)."""
    return TEMPLATES["sink_marks"].replace("{s}", s.encode().hex())


def sink_progress(s: str) -> str:
    """Partition marker -> which of its messages a Spark sink spooled before it failed."""
    return TEMPLATES["sink_progress"].replace("{s}", s.encode().hex())


def sink_stored(s: str, m: str) -> str:
    """Row indexes of partition marker `m` the spool stored since its progress was last
    noted: recorded in the same step as each message, so a replay after a task died in
    between stores none of them again."""
    return (
        TEMPLATES["sink_stored"].replace("{s}", s.encode().hex()).replace("{m}", m.encode().hex())
    )


def sink_progress_times(s: str) -> str:
    """Partition marker -> the epoch ms its progress was last noted (it goes MARK_TTL_S
    after)."""
    return TEMPLATES["sink_progress_times"].replace("{s}", s.encode().hex())


def retained_held(t: str) -> str:
    return TEMPLATES["retained_held"].replace("{t}", t.encode().hex())


def client_state(c: str) -> str:
    return _client_key("client_state", c)


def client_received(c: str) -> str:
    return _client_key("client_received", c)


def client_claims(c: str) -> str:
    """Which connection holds a client ('holder': node and claim) and the latest claim that
    read its state ('loaded')."""
    return _client_key("client_claims", c)


def client_parting(c: str) -> str:
    """The message a client's connection leaves should it end without a word (an MQTT
    will): 'node' and 'claim' of that connection, 'delay' (ms), 'due' (epoch ms, once the
    connection ended), 'message'."""
    return _client_key("client_parting", c)


def lua_prelude() -> str:
    """Lua definitions of the same names, prepended to functions.lua at load time."""
    lines = [
        f"local GROUP = '{GROUP}'",
        f"local RETURNED = '{RETURNED_CONSUMER}'",
        f"local HOLDING = '{HOLDING_CONSUMER}'",
        f"local TIMED = '{TIMED_CONSUMER}'",
        f"local function partition_queue(p, i) return '{PARTITION_PREFIX}' .. i .. '/' .. p end",
        f"local function priority_queue(p, i) return '{PRIORITY_PREFIX}' .. i .. '/' .. p end",
        f"local PRIORITY_LEVELS = {PRIORITY_LEVELS}",
    ]
    for name, template in TEMPLATES.items():
        if "{{q}}" in template:
            head, tail = template.split("{{q}}")
            lines.append(f"local function k_{name}(q) return '{head}{{' .. q .. '}}{tail}' end")
        elif "{c}" in template:  # a client id in hex, as Python names them
            head, tail = template.split("{c}")
            lines.append(f"local function k_{name}(c) return '{head}' .. c .. '{tail}' end")
        elif "{s}" in template or "{t}" in template:
            continue  # sink and held-retained keys are named from Python only
        elif "{n}" in template:
            head, tail = template.split("{n}")
            lines.append(f"local function k_{name}(n) return '{head}' .. n .. '{tail}' end")
        else:
            lines.append(f"local K_{name.upper()} = '{template}'")
    return "\n".join(lines) + "\n"
