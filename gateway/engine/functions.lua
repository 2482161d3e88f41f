#!lua name=gw
-- The gateway's Redis function library: every multi-step change of queue state is one
-- call here, so it is atomic and one round trip. Key names come from the generated
-- prelude (gateway/engine/keys.py), inserted below at load time.
-- {{PRELUDE}}

-- While Redis is over its maxmemory it refuses a function call whole, before it runs,
-- unless the function has the allow-oom flag. Only gw_spool, which stores messages, goes
-- without it: its publishers are refused (NACKed). Every other function frees memory or
-- writes a few bytes of bookkeeping and must go on running, so consumers can drain a full
-- Redis, nodes keep their heartbeats and operators can still change queues and quotas.
-- One that only reads is also flagged 'no-writes' (`reads_only`): it runs while Redis refuses
-- writes for now (a replica during a failover, a failing disk), so the admin API and the
-- metrics still report.
local function register_always(name, fn, reads_only)
  local flags = reads_only and { 'no-writes', 'allow-oom' } or { 'allow-oom' }
  redis.register_function { function_name = name, callback = fn, flags = flags }
end

local OK, NO_SUBSCRIBERS, NOT_FOUND, INGRESS_DISABLED = 0, 1, 2, 3
local TOO_LARGE, QUOTA_EXCEEDED, QUEUE_FULL, FLOW_CONTROLLED = 4, 5, 6, 7

local function node_of(flow)
  return string.match(flow, '^([^.]+)%.')
end

-- A get's flow (the admin API's get, as RabbitMQ's basic.get) takes messages but is no
-- consumer: its id is node.gN (a consumer's node.N). An auto-delete queue goes when its
-- last consumer does, never because of gets.
local function consumer_flow(flow)
  return not string.find(flow, '.g', 1, true)
end

-- Stream ids compare as integer (ms, seq) pairs, never as strings.
local function id_less(x, y)
  local xm, xs = string.match(x, '^(%d+)-(%d+)$')
  local ym, ys = string.match(y, '^(%d+)-(%d+)$')
  xm, ym = tonumber(xm), tonumber(ym)
  return xm < ym or (xm == ym and tonumber(xs) < tonumber(ys))
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The id of the last entry the consumer group handed out: later ones are undelivered.
local function last_delivered(s)
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', s)) do
    for i = 1, #g, 2 do
      if g[i] == 'last-delivered-id' then return g[i + 1] end
    end
  end
  return '0-0'
end

-- Lua's unpack is bounded by its C stack (about 8,000 values): commands that take a list of
-- entry ids get them this many at a time.
local IDS_PER_CALL = 1000

-- XACK (cmd 'XACK') or XDEL of ids[first..last] on stream s, IDS_PER_CALL ids a call;
-- returns how many the calls acked or deleted.
local function ids_call(cmd, s, ids, first, last)
  local done = 0
  for from = first, last, IDS_PER_CALL do
    local to = math.min(last, from + IDS_PER_CALL - 1)
    if cmd == 'XACK' then
      done = done + redis.call('XACK', s, GROUP, unpack(ids, from, to))
    else
      done = done + redis.call('XDEL', s, unpack(ids, from, to))
    end
  end
  return done
end

-- Delete ids[first..last] of queue q's stream s, entries acked for good (no stream readers
-- keep them). XTRIM MINID below the oldest entry still pending or undelivered drops whole
-- listpack nodes, where XDEL seeks and rewrites each entry (~1.4 µs a message more in
-- Redis, AMQP 100 B). When the trim did not take exactly as many entries, some of these are
-- above the oldest pending one (another consumer still holds it): deleted by id. So are
-- they all while acked entries that former stream readers kept (k_queue_kept) may stand
-- above it: the trim's count could match while some of these stay.
local function drop_acked(q, s, ids, first, last)
  local floor = last_delivered(s)  -- later entries are undelivered
  local oldest = redis.call('XPENDING', s, GROUP)[2]
  local dropped, pending = nil, oldest and not id_less(floor, oldest)
  if pending then
    dropped = redis.call('XTRIM', s, 'MINID', oldest)
  else  -- nothing pending up to the last delivered entry: that one goes too
    dropped = redis.call('XTRIM', s, 'MINID', floor) + redis.call('XDEL', s, floor)
  end
  local kept = redis.call('GET', k_queue_kept(q))
  if kept then
    if pending and not id_less(kept, oldest) then
      ids_call('XDEL', s, ids, first, last)
      return
    end
    redis.call('DEL', k_queue_kept(q))  -- the trim took all the readers kept
  end
  if dropped ~= last - first + 1 then ids_call('XDEL', s, ids, first, last) end
end

-- XCLAIM ... JUSTID: moves entries between consumers without bumping the delivery count.
local function claim_justid(s, consumer, ids)
  for from = 1, #ids, IDS_PER_CALL do
    local args = { 'XCLAIM', s, GROUP, consumer, 0 }
    for i = from, math.min(#ids, from + IDS_PER_CALL - 1) do args[#args + 1] = ids[i] end
    args[#args + 1] = 'JUSTID'
    redis.call(unpack(args))
  end
end

local function entry_field(fields, name)
  if not fields then return false end
  for i = 1, #fields, 2 do
    if fields[i] == name then return fields[i + 1] end
  end
  return false
end

local function entry_blob(fields)
  return entry_field(fields, 'm')
end

-- Spool accounting. Every change of the messages a queue stores goes through account():
-- the queue's counters, the broker-wide and per-VPN byte totals and the usage threshold
-- alarms of those three scopes change in the same call, so they never drift apart.

-- Quotas and threshold percents (gateway/engine/spool_usage.py writes them).
local function spool_limits(vpn)
  local l = redis.call('HMGET', K_SPOOL_LIMITS, 'broker', 'v:' .. vpn, 'set', 'clear')
  return tonumber(l[1]) or 0, tonumber(l[2]) or 0, tonumber(l[3]) or 80, tonumber(l[4]) or 60
end

-- A threshold event: counted, and queued for exactly one node to log (a consumer group).
local function spool_event(kind, scope, used, quota)
  if redis.call('EXISTS', K_SPOOL_EVENTS) == 0 then
    redis.call('XGROUP', 'CREATE', K_SPOOL_EVENTS, GROUP, '$', 'MKSTREAM')
  end
  redis.call('XADD', K_SPOOL_EVENTS, 'MAXLEN', '~', 1000, '*',
    'e', kind, 's', scope, 'b', used, 'q', quota)
  redis.call('HINCRBY', K_SPOOL_ALARM_COUNTS, kind .. ':' .. scope, 1)
  redis.call('PUBLISH', K_SPOOL_NOTIFY, kind)
end

-- Raise the alarm of a scope when its usage reaches set% of its quota, clear it below clear%
-- (or when the quota is gone). `raised`: the alarm's current state.
local function spool_threshold(scope, used, quota, set_pct, clear_pct, raised)
  if not raised and quota > 0 and used * 100 >= quota * set_pct then
    redis.call('HSET', K_SPOOL_ALARMS, scope, 1)
    spool_event('set', scope, used, quota)
  elseif raised and (quota <= 0 or used * 100 < quota * clear_pct) then
    redis.call('HDEL', K_SPOOL_ALARMS, scope)
    spool_event('clear', scope, used, quota)
  end
end

local family_usage -- forward declaration: a partitioned or priority queue's usage

-- Queue q gained (or lost, when negative) `msgs` messages of `bytes` bytes. `vpn`,
-- `maxbytes` and `parent` (its config) are read when `vpn` is not given. A partition's or
-- priority level's queue-scope alarm is its parent's, on the whole family's usage, as the
-- parent's max_spool_bytes bounds them all.
local function account(q, msgs, bytes, vpn, maxbytes, parent)
  local st = k_queue_stats(q)
  if msgs ~= 0 then redis.call('HINCRBY', st, 'msgs', msgs) end
  if bytes == 0 then return end
  local used = redis.call('HINCRBY', st, 'bytes', bytes)
  if not vpn then
    local c = redis.call('HMGET', k_queue_config(q), 'vpn', 'max_spool_bytes', 'parent')
    vpn, maxbytes, parent = c[1] or 'default', tonumber(c[2]) or 0, c[3]
  end
  local total = redis.call('HINCRBY', K_SPOOL_USAGE, 'broker', bytes)
  local in_vpn = redis.call('HINCRBY', K_SPOOL_USAGE, 'v:' .. vpn, bytes)
  local bq, vq, set_pct, clear_pct = spool_limits(vpn)
  -- Below the clear level before and after this change, a scope's alarm cannot change
  -- (quota or percent changes re-evaluate alarms themselves): the alarms are not read.
  local low = math.min(set_pct, clear_pct)
  local scopes, n = {}, 0
  local function near(scope, used, quota)
    if quota > 0 and math.max(used, used - bytes) * 100 >= quota * low then
      n = n + 1
      scopes[n] = { scope, used, quota }
    end
  end
  near('broker', total, bq)
  near('vpn:' .. vpn, in_vpn, vq)
  if not parent then
    near('queue:' .. q, used, maxbytes or 0)
  elseif (maxbytes or 0) > 0 then
    near('queue:' .. parent, family_usage(parent).bytes, maxbytes)
  end
  if n == 0 then return end
  local fields = {}
  for i = 1, n do fields[i] = scopes[i][1] end
  local a = redis.call('HMGET', K_SPOOL_ALARMS, unpack(fields))
  for i = 1, n do
    local sc = scopes[i]
    spool_threshold(sc[1], sc[2], sc[3], set_pct, clear_pct, a[i])
  end
end

-- Take a queue's messages out of the accounting (before its stats are reset or deleted).
local function unaccount_all(q)
  local st = redis.call('HMGET', k_queue_stats(q), 'msgs', 'bytes')
  local msgs, bytes = tonumber(st[1]) or 0, tonumber(st[2]) or 0
  if msgs ~= 0 or bytes ~= 0 then account(q, -msgs, -bytes) end
end

local rebalance -- forward declaration: release_flow and rebalance call each other
local delete_queue -- forward declaration: release_flow deletes auto-delete queues

local function partition_count(q)
  return tonumber(redis.call('HGET', k_queue_config(q), 'partition_count') or '0') or 0
end

-- The hidden child queues that hold a queue's messages: its partitions, or its priority
-- levels (highest first). Empty for a plain queue.
local function children(q)
  local c = redis.call('HMGET', k_queue_config(q), 'partition_count', 'priorities')
  local out = {}
  for i = 0, (tonumber(c[1]) or 0) - 1 do out[#out + 1] = partition_queue(q, i) end
  if c[2] == '1' then
    for p = PRIORITY_LEVELS - 1, 0, -1 do out[#out + 1] = priority_queue(q, p) end
  end
  return out
end

-- What queue q stores, in bytes: its partitions' or priority levels' if it has some.
local function queue_bytes(q)
  if #children(q) > 0 then return family_usage(q).bytes end
  return tonumber(redis.call('HGET', k_queue_stats(q), 'bytes') or '0') or 0
end

-- Re-evaluate the queue-scope threshold alarm of queue q against its current usage, quota
-- and the stored percents (after one of those changed). An alarm an earlier release kept
-- for one of its hidden children is taken down.
local function queue_alarms(q)
  local _, _, set_pct, clear_pct = spool_limits('default')
  local quota = tonumber(redis.call('HGET', k_queue_config(q), 'max_spool_bytes') or '0')
  spool_threshold('queue:' .. q, queue_bytes(q), quota or 0, set_pct, clear_pct,
    redis.call('HEXISTS', K_SPOOL_ALARMS, 'queue:' .. q) == 1)
  for _, child in ipairs(children(q)) do
    redis.call('HDEL', K_SPOOL_ALARMS, 'queue:' .. child)
  end
end

-- Message-group mode of a queue: false, 'default' or 'shared'.
local function group_mode(q)
  local m = redis.call('HGET', k_queue_config(q), 'message_groups')
  return m and m ~= '' and m or false
end

-- Where unsettled entries go back to: the holding consumer on message-group, selective and
-- sorted queues (whose fetches pick entries by group, selector or key), the returned
-- consumer elsewhere.
local function park_consumer(q)
  local c = redis.call('HMGET', k_queue_config(q), 'selective', 'sort_key')
  if group_mode(q) or c[1] == '1' or (c[2] and c[2] ~= '') then
    return HOLDING
  end
  return RETURNED
end

-- Sorted queues (Qpid Broker-J's): the entries waiting for a consumer sit in the holding
-- consumer and are members of an index (k_queue_sorted) of score 0: "1<key>\0<id>", or
-- "0\0<id>" for a message without the sort key property, the id's parts zero-padded. So
-- lexical order is Broker-J's order: messages without the key first, then by the key's
-- value (byte-wise string comparison), then by arrival. A fetch takes the lowest members.
local function sort_key(q)
  local k = redis.call('HGET', k_queue_config(q), 'sort_key')
  return k and k ~= '' and k or false
end

local function sort_member(id, key)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  local pos = string.rep('0', 20 - #ms) .. ms .. '-' .. string.rep('0', 20 - #seq) .. seq
  if key then return '1' .. key .. '\0' .. pos end
  return '0\0' .. pos
end

local function member_id(m)
  local ms, seq = string.sub(m, -41, -22), string.sub(m, -20)
  return string.gsub(ms, '^0+(%d)', '%1') .. '-' .. string.gsub(seq, '^0+(%d)', '%1')
end

-- Index the entries of a sorted queue's stream that nobody has read yet: they move to the
-- holding consumer (delivery count 0: holding is no delivery) and join the index.
local function admit_sorted(q)
  local s, idx = k_queue_stream(q), k_queue_sorted(q)
  while true do
    local r = redis.call('XREADGROUP', 'GROUP', GROUP, HOLDING, 'COUNT', 500, 'STREAMS', s, '>')
    if not r or #r[1][2] == 0 then return end
    local claim, zadd = { 'XCLAIM', s, GROUP, HOLDING, 0 }, { 'ZADD', idx }
    for _, e in ipairs(r[1][2]) do
      claim[#claim + 1] = e[1]
      zadd[#zadd + 1] = 0
      zadd[#zadd + 1] = sort_member(e[1], entry_field(e[2], 'sk'))
    end
    claim[#claim + 1] = 'RETRYCOUNT'
    claim[#claim + 1] = 0
    claim[#claim + 1] = 'JUSTID'
    redis.call(unpack(claim))
    redis.call(unpack(zadd))
    if #r[1][2] < 500 then return end
  end
end

-- Entries leaving a sorted queue's index other than by a sorted fetch (a selector's take).
local function unindex(q, id, fields)
  if sort_key(q) then
    redis.call('ZREM', k_queue_sorted(q), sort_member(id, entry_field(fields, 'sk')))
  end
end

-- A last value queue's entries name their slot ('lv'). One given back after a newer value
-- of its slot came is deleted, not parked: the queue never hands out a value older than
-- its slot's latest (Qpid's LVQ discards such a released entry). A slot its index no longer
-- names had a newer value settled for good (forget_last_value). Returns the ids to park.
local function drop_superseded(q, s, ids)
  local latest = k_queue_last_values(q)
  if redis.call('EXISTS', latest) == 0 then  -- every key left it, or no last value queue
    local c = redis.call('HMGET', k_queue_config(q), 'lvq_key', 'max_spool_bytes')
    if not ((c[1] and c[1] ~= '') or c[2] == '0') then return ids end
  end
  local keep, gone, bytes = {}, 0, 0
  local avoiding = redis.call('EXISTS', k_queue_avoid(q)) == 1
  for _, id in ipairs(ids) do
    local e = redis.call('XRANGE', s, id, id)
    local slot = #e > 0 and entry_field(e[1][2], 'lv')
    local newest = slot and redis.call('HGET', latest, slot)
    if slot and newest ~= id then
      redis.call('XACK', s, GROUP, id)
      redis.call('XDEL', s, id)
      if avoiding then redis.call('HDEL', k_queue_avoid(q), id) end
      gone = gone + 1
      bytes = bytes + #(entry_blob(e[1][2]) or '')
    else
      keep[#keep + 1] = id
    end
  end
  if gone > 0 then
    account(q, -gone, -bytes)
    redis.call('HINCRBY', k_queue_stats(q), 'replaced', gone)
  end
  return keep
end

-- A last value queue forgets the slot of a value settled for good (acked, dead-lettered)
-- while the slot still names it: its index kept every key ever seen (replaceable finds no
-- value to replace either way).
local function forget_last_value(q, id, fields)
  local slot = entry_field(fields, 'lv')
  if not slot then return end
  local latest = k_queue_last_values(q)
  if redis.call('HGET', latest, slot) == id then redis.call('HDEL', latest, slot) end
end

local function forget_last_values(q, s, ids, first, last)
  if redis.call('EXISTS', k_queue_last_values(q)) == 0 then return end
  for i = first, last do
    local e = redis.call('XRANGE', s, ids[i], ids[i])
    if #e > 0 then forget_last_value(q, ids[i], e[1][2]) end
  end
end

-- A delivery count of ACQUIRED or more marks an entry a flow acquired before without the
-- delivery counting (an AMQP release, §3.4.4): its next delivery says so (first-acquirer
-- false, §3.2.1) with the count it had. The mark is added to the count in the entry's
-- pending entry, so XCLAIM's increments keep it and it goes with the entry (gw_fetch and
-- gw_peek reply with it; the node splits it off). 2^40: a Lua number holds it exactly.
local ACQUIRED = 1099511627776

local function deliveries(count)
  return count % ACQUIRED
end

-- Entries went back to wait on q, maybe behind where the expiry sweep reads its lists: if
-- q stores expiring messages, the sweep looks at it soon, and reads them all once more
-- before it waits for the earliest expiry it read (expire_waiting).
local function waiting_again(q)
  if redis.call('ZSCORE', K_EXPIRING_QUEUES, q) then
    redis.call('ZADD', K_EXPIRING_QUEUES, 'LT', now_ms(), q)
    redis.call('HSET', k_queue_expiry_cursor(q), 'again', 1)
  end
end

-- Unsettled entries go back to wait for a flow; on a sorted queue, into their sorted place.
-- `uncount`: the delivery did not count, and its delivery count goes back: 'release' (an
-- AMQP release) marks it ACQUIRED; 'unsent' (it never left the node) keeps it as it was.
local function park(q, s, ids, uncount)
  ids = drop_superseded(q, s, ids)
  local consumer = park_consumer(q)
  if uncount then
    for _, id in ipairs(ids) do
      local p = redis.call('XPENDING', s, GROUP, id, id, 1)
      if #p == 1 then
        local count = p[1][4]
        local mark = (uncount == 'release' or count >= ACQUIRED) and ACQUIRED or 0
        redis.call('XCLAIM', s, GROUP, consumer, 0, id,
          'RETRYCOUNT', math.max(deliveries(count) - 1, 0) + mark, 'JUSTID')
      end
    end
  else
    claim_justid(s, consumer, ids)
  end
  waiting_again(q)
  if not sort_key(q) then return end
  for _, id in ipairs(ids) do
    local e = redis.call('XRANGE', s, id, id)
    if #e > 0 then
      redis.call('ZADD', k_queue_sorted(q), 0, sort_member(id, entry_field(e[1][2], 'sk')))
    end
  end
end

-- Entries a flow must not get again (AMQP modified with undeliverable-here, §3.4.5): other
-- flows take them. `avoid_key` gives the queue's list when it has one (one EXISTS a fetch).
local function avoid(q, ids, flow)
  local h = k_queue_avoid(q)
  for _, id in ipairs(ids) do
    local v = redis.call('HGET', h, id)
    redis.call('HSET', h, id, v and (v .. ' ' .. flow) or flow)
  end
end

local function avoid_key(q)
  local h = k_queue_avoid(q)
  return redis.call('EXISTS', h) == 1 and h
end

local function avoided(avoiding, id, flow)
  if not avoiding then return false end
  local v = redis.call('HGET', avoiding, id)
  return v and string.find(' ' .. v .. ' ', ' ' .. flow .. ' ', 1, true) ~= nil
end

-- The message group of a stream entry (nil: ungrouped).
local function entry_group(s, id, mode, default_group)
  local e = redis.call('XRANGE', s, id, id)
  if #e == 0 then return nil end
  local f = e[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'k' then return f[i + 1] end
  end
  if mode == 'shared' then return default_group end
  return nil
end

-- Flows bind to a partitioned queue's parent, so its partitions wake the parent's channel.
local function wake(q, payload)
  local parent = redis.call('HGET', k_queue_config(q), 'parent')
  redis.call('PUBLISH', k_queue_wake(parent or q), payload or '')
end

-- Move every pending entry of `flow` to the returned consumer (no delivery-count bump:
-- the count grows when a flow claims it again), forget the consumer, free its lease.
-- On a partitioned queue the flow is released from every partition and the partitions
-- are rebalanced among the remaining flows (unless `no_rebalance`). `keep`: the queue
-- stays even if it is auto-delete and this was its last consumer.
-- The node's index of the queues it has flows on (or owns) is for its reaper: the queue
-- leaves it once the node has neither, or every temporary queue and every queue a flow of
-- the node ever bound stayed there, and a reap walked them all in one call.
-- A count of the node's flows on each queue (count_flow) tells when the last goes without
-- reading the queue's flows (a reap of many flows on one queue would read them once a
-- flow). Flows bound before the counts were kept, on a queue the node binds nothing on
-- since, go below 0: then they are read.
-- A flow bound (`added`: not bound already, as a bind run again after a lost reply is):
-- the node's count of its flows on the queue starts from those there, so that flows bound
-- before the counts were kept count too.
local function count_flow(q, n, added)
  local counts = k_node_queue_flows(n)
  if redis.call('HEXISTS', counts, q) == 1 then
    if added then redis.call('HINCRBY', counts, q, 1) end
    return
  end
  local mine = 0
  for _, other in ipairs(redis.call('ZRANGE', k_queue_flows(q), 0, -1)) do
    if node_of(other) == n then mine = mine + 1 end
  end
  redis.call('HSET', counts, q, mine)
end

local function unindex_flow(q, n)
  local counts = k_node_queue_flows(n)
  local left = redis.call('HINCRBY', counts, q, -1)
  if left > 0 then return end
  redis.call('HDEL', counts, q)
  if left < 0 then
    for _, other in ipairs(redis.call('ZRANGE', k_queue_flows(q), 0, -1)) do
      if node_of(other) == n then return end
    end
  end
  if redis.call('HGET', k_queue_config(q), 'owner_node') ~= n
    and redis.call('SISMEMBER', k_queue_owner_nodes(q), n) == 0 then
    redis.call('SREM', k_node_queues(n), q)
  end
end

local function release_flow(q, flow, no_rebalance, keep)
  local s = k_queue_stream(q)
  local moved = 0
  if redis.call('EXISTS', s) == 1 then
    while true do
      local p = redis.call('XPENDING', s, GROUP, '-', '+', 500, flow)
      if #p == 0 then break end
      local ids = {}
      for i, e in ipairs(p) do ids[i] = e[1] end
      park(q, s, ids)
      moved = moved + #ids
      if #p < 500 then break end
    end
    pcall(redis.call, 'XGROUP', 'DELCONSUMER', s, GROUP, flow)
  end
  local freed = false
  if group_mode(q) then  -- its groups are free for other consumers now
    local groups = redis.call('HGETALL', k_queue_groups(q))
    for i = 1, #groups, 2 do
      if groups[i + 1] == flow then
        redis.call('HDEL', k_queue_groups(q), groups[i])
        redis.call('HDEL', k_queue_group_held(q), groups[i])
        freed = true
      end
    end
  end
  redis.call('ZREM', k_queue_flows(q), flow)
  if redis.call('HEXISTS', k_queue_config(q), 'parent') == 0 then  -- a child is not indexed
    unindex_flow(q, node_of(flow))
  end
  local lease = k_queue_lease(q)
  if redis.call('HGET', lease, 'flow') == flow then
    redis.call('DEL', lease)
    redis.call('PUBLISH', K_EVENTS, 'lease ' .. q)
  end
  if moved > 0 or freed then wake(q) end  -- what waited for its groups may go now
  for _, child in ipairs(children(q)) do
    moved = moved + release_flow(child, flow, true)
  end
  if partition_count(q) > 0 and not no_rebalance then rebalance(q, now_ms()) end
  local c = redis.call('HMGET', k_queue_config(q), 'auto_delete', 'parent')
  if c[1] == '1' and not c[2] and not keep and consumer_flow(flow) then
    for _, other in ipairs(redis.call('ZRANGE', k_queue_flows(q), 0, -1)) do
      if consumer_flow(other) then return moved end
    end
    delete_queue(q)  -- its last consumer went (RabbitMQ auto-delete)
  end
  return moved
end

-- A partition or a priority level: part of its parent, never a queue clients name. Every
-- function a client's request reaches by a queue's name treats it as missing.
local function hidden(q)
  return redis.call('HEXISTS', k_queue_config(q), 'parent') == 1
end

-- What routes messages to q changed (its subscriptions, its key property or selector; it
-- was made or deleted): a new subscription version, which nodes load from the last one
-- they loaded by reading only the queues changed since (gw_routes_since). The changes of
-- the last ROUTE_CHANGES_KEPT queues are kept; a node further behind loads every route.
local function routes_changed(q)
  local ROUTE_CHANGES_KEPT = 10000
  local v = redis.call('INCR', K_SUB_VERSION)
  redis.call('ZADD', K_ROUTE_CHANGES, v, q)
  if redis.call('ZCARD', K_ROUTE_CHANGES) > ROUTE_CHANGES_KEPT then
    redis.call('HSET', K_ROUTE_CHANGES_STATE, 'floor', redis.call('ZPOPMIN', K_ROUTE_CHANGES)[2])
  end
  redis.call('PUBLISH', K_EVENTS, 'sub ' .. v)
end

delete_queue = function(q)
  if redis.call('EXISTS', k_queue_config(q)) == 0 then return 0 end
  for _, child in ipairs(children(q)) do delete_queue(child) end
  for _, flow in ipairs(redis.call('ZRANGE', k_queue_flows(q), 0, -1)) do
    local n = node_of(flow)
    redis.call('SREM', k_node_queues(n), q)
    redis.call('HDEL', k_node_queue_flows(n), q)
  end
  local owner_node = redis.call('HGET', k_queue_config(q), 'owner_node')
  if owner_node then redis.call('SREM', k_node_queues(owner_node), q) end
  for _, n in ipairs(redis.call('SMEMBERS', k_queue_owner_nodes(q))) do
    redis.call('SREM', k_node_queues(n), q)
  end
  unaccount_all(q)
  redis.call('HDEL', K_SPOOL_ALARMS, 'queue:' .. q)
  redis.call('HDEL', K_SPOOL_ALARM_COUNTS, 'set:queue:' .. q, 'clear:queue:' .. q)
  redis.call('DEL', k_queue_parts(q), k_queue_groups(q), k_queue_group_held(q),
    k_queue_last_values(q), k_queue_timed(q), k_queue_config(q), k_queue_stream(q), k_queue_stats(q), k_queue_subs(q),
    k_queue_flows(q), k_queue_lease(q), k_queue_readers(q), k_queue_sorted(q),
    k_queue_members(q), k_queue_owner_nodes(q), k_queue_flow_held(q), k_queue_avoid(q), k_queue_kept(q),
    k_queue_reader_baselines(q), k_queue_expiry_cursor(q))
  redis.call('SREM', K_QUEUES, q)
  redis.call('SREM', K_READ_QUEUES, q)
  redis.call('ZREM', K_EXPIRING_QUEUES, q)
  redis.call('ZREM', K_TIMED_QUEUES, q)
  redis.call('PUBLISH', K_EVENTS, 'qdel ' .. q)
  routes_changed(q)
  return 1
end

-- Whether node n counts as alive: its liveness key lives, or liveness cannot be judged now.
-- When no node beat for longer than a TTL, Redis itself was out of touch (restarted: the
-- keys expired meanwhile; stalled; refusing writes; unreachable), or every node stopped:
-- every live node lost its key alike, so each gets two TTLs from the first beat after that
-- to beat again (gw_node_up; its connections to Redis may take a few beats to come back).
-- A node that really died is presumed dead that much later.
local function node_alive(n)
  if redis.call('EXISTS', k_node_alive(n)) == 1 then return true end
  if redis.call('EXISTS', K_LIVENESS_GRACE) == 1 then return true end
  local last = redis.call('HMGET', K_LIVENESS, 't', 'ttl')
  return last[1] ~= false and now_ms() - tonumber(last[1]) > tonumber(last[2])
end

-- The parting messages of a node's connections fall due: each when its connection's delay
-- from now ends, or when it was due already (its connection ended first).
local function release_partings(n)
  local now = now_ms()
  for _, m in ipairs(redis.call('SMEMBERS', k_node_parting(n))) do
    local c, k = string.match(m, '^(%d+) (.+)$')
    local r = redis.call('HMGET', k, c .. ':node', c .. ':delay', c .. ':due')
    if r[1] == n and not redis.call('ZSCORE', K_PARTING_DUE, m) then
      local due = tonumber(r[3])
      redis.call('ZADD', K_PARTING_DUE, due > 0 and due or now + tonumber(r[2]), m)
    end
  end
  redis.call('DEL', k_node_parting(n))
end

-- The sessions a node's connections held: each expires its expiry from now (a connected
-- session's state outlives its node by a lease, see gw_client_expire), unless a newer
-- connection claimed it since (its own expiry holds).
local function release_sessions(n)
  local held = redis.call('HGETALL', k_node_sessions(n))
  for i = 1, #held, 2 do
    local c = held[i]
    local claim, expiry = string.match(held[i + 1], '^(%d+) (%d+)$')
    local last = tonumber(redis.call('HGET', k_client_claims(c), 'last')) or 0
    expiry = tonumber(expiry)
    if last <= tonumber(claim) then
      for _, key in ipairs({ k_client_state(c), k_client_received(c) }) do
        if redis.call('TTL', key) > expiry then redis.call('EXPIRE', key, expiry) end
      end
    end
  end
  redis.call('DEL', k_node_sessions(n))
end

-- Forget a node: return its flows' messages, delete the temporary queues it owned.
-- A non-durable queue lives while a node that declared it lives (gw_queue_create): its
-- owner `n` is gone, so a live one of its other owners takes it; false if none is left.
local function next_owner(q, n)
  local owners = k_queue_owner_nodes(q)
  for _, m in ipairs(redis.call('SMEMBERS', owners)) do
    redis.call('SREM', owners, m)
    if m ~= n and node_alive(m) then
      redis.call('HSET', k_queue_config(q), 'owner_node', m)
      redis.call('SADD', k_node_queues(m), q)
      return true
    end
  end
  return false
end

local function reap_node(n)
  local released = 0
  for _, q in ipairs(redis.call('SMEMBERS', k_node_queues(n))) do
    for _, flow in ipairs(redis.call('ZRANGE', k_queue_flows(q), 0, -1)) do
      if node_of(flow) == n then
        release_flow(q, flow)
        released = released + 1
      end
    end
    if redis.call('HGET', k_queue_config(q), 'owner_node') == n then
      if not next_owner(q, n) then delete_queue(q) end
    else
      redis.call('SREM', k_queue_owner_nodes(q), n)
    end
  end
  release_partings(n)
  release_sessions(n)
  redis.call('DEL', k_node_queues(n), k_node_queue_flows(n), k_node_alive(n))
  redis.call('SREM', K_NODES, n)
  if redis.call('SREM', K_DIRECT_NODES, n) == 1 then redis.call('PUBLISH', K_EVENTS, 'direct ' .. n) end
  return released
end

-- Live flows of a queue in bind order; flows of dead nodes are released on the way.
local function live_flows(q)
  local out = {}
  for _, flow in ipairs(redis.call('ZRANGE', k_queue_flows(q), 0, -1)) do
    if node_alive(node_of(flow)) then
      out[#out + 1] = flow
    else
      release_flow(q, flow, true)
    end
  end
  return out
end

-- Start dispatch of partition i to `flow`: register it on the child, new lease and fence.
local function grant_partition(q, i, child, flow)
  local seq = redis.call('INCR', K_SEQ)
  redis.call('ZADD', k_queue_flows(child), seq, flow)
  redis.call('HSET', k_queue_lease(child), 'flow', flow, 'fence', seq)
  redis.call('HSET', k_queue_parts(q), 'o:' .. i, flow)
  redis.call('HDEL', k_queue_parts(q), 'd:' .. i)
end

-- Assign every partition to one live flow, as evenly as possible, keeping assignments where
-- balance allows; flows beyond the partition count get none (inactive). A partition moving
-- away from a live flow is handed off: the old owner stops dispatching at once, the new
-- owner starts once the old one has settled what it holds, or when the handoff timeout
-- returns those messages to the partition (they come first, in order, to the new owner).
-- Returns true if any ownership changed.
rebalance = function(q, now)
  local n = partition_count(q)
  if n == 0 then return false end
  local parts = k_queue_parts(q)
  local flows = live_flows(q)
  -- an auto-delete queue goes with its last consumer, on a dead node too
  if redis.call('EXISTS', k_queue_config(q)) == 0 then return false end
  local nf = #flows
  local cap = {}
  for idx, f in ipairs(flows) do
    cap[f] = math.floor(n / nf) + ((idx <= n % nf) and 1 or 0)
  end
  local state = {}
  local raw = redis.call('HGETALL', parts)
  for j = 1, #raw, 2 do state[raw[j]] = raw[j + 1] end
  local target = {}
  for i = 0, n - 1 do
    local t = state['t:' .. i]
    if t and cap[t] and cap[t] > 0 then
      target[i] = t
      cap[t] = cap[t] - 1
    end
  end
  local fi = 1
  for i = 0, n - 1 do
    if not target[i] then
      while fi <= nf and cap[flows[fi]] == 0 do fi = fi + 1 end
      if fi <= nf then
        target[i] = flows[fi]
        cap[flows[fi]] = cap[flows[fi]] - 1
      end
    end
  end
  local handoff_ms = tonumber(
    redis.call('HGET', k_queue_config(q), 'partition_handoff_timeout_ms') or '3000') or 3000
  local changed = false
  for i = 0, n - 1 do
    local child = partition_queue(q, i)
    local t, o = target[i], state['o:' .. i]
    if t then
      redis.call('HSET', parts, 't:' .. i, t)
    else
      redis.call('HDEL', parts, 't:' .. i)
    end
    if o and not redis.call('ZSCORE', k_queue_flows(child), o) then o = nil end
    if o and o == t then
      if t and redis.call('HGET', k_queue_lease(child), 'flow') ~= t then
        grant_partition(q, i, child, t)
        changed = true
      end
    elseif not o then
      redis.call('HDEL', parts, 'o:' .. i, 'd:' .. i)
      if redis.call('DEL', k_queue_lease(child)) == 1 then changed = true end
      if t then
        grant_partition(q, i, child, t)
        changed = true
      end
    else
      if redis.call('DEL', k_queue_lease(child)) == 1 then changed = true end
      local deadline = tonumber(state['d:' .. i])
      if not deadline then
        deadline = now + handoff_ms
        redis.call('HSET', parts, 'd:' .. i, deadline)
      end
      local held = redis.call('XPENDING', k_queue_stream(child), GROUP, '-', '+', 1, o)
      if #held == 0 or now >= deadline then
        release_flow(child, o, true)
        redis.call('HDEL', parts, 'o:' .. i, 'd:' .. i)
        if t then grant_partition(q, i, child, t) end
        changed = true
      end
    end
  end
  if changed then redis.call('PUBLISH', K_EVENTS, 'parts ' .. q) end
  return changed
end

-- A message's blob is a msgpack array (see gateway/model.py); Redis 7.0's cmsgpack cannot
-- read msgpack bin values (the payload), so the fields dead-lettering needs are found by
-- skipping: version, payload bin, destination, id, flags, priority, partition key.

-- A big-endian unsigned number of n bytes at `at`; 0 past the end (the next read fails).
local function be(blob, at, n)
  local v = 0
  for i = 0, n - 1 do v = v * 256 + (string.byte(blob, at + i) or 0) end
  return v
end

-- Where the msgpack value at `pos` ends (one past it), and where its data starts; nil for
-- a kind a message's first fields never have, or past the end.
local function msgpack_value(blob, pos)
  local b = string.byte(blob, pos)
  if not b then return nil end
  if b < 0x80 or b >= 0xe0 or b == 0xc0 or b == 0xc2 or b == 0xc3 then return pos + 1, pos end
  if b >= 0xa0 and b <= 0xbf then return pos + 1 + (b - 0xa0), pos + 1 end  -- fixstr
  if b == 0xc4 or b == 0xd9 then return pos + 2 + be(blob, pos + 1, 1), pos + 2 end
  if b == 0xc5 or b == 0xda then return pos + 3 + be(blob, pos + 1, 2), pos + 3 end
  if b == 0xc6 or b == 0xdb then return pos + 5 + be(blob, pos + 1, 4), pos + 5 end
  local width = ({ [0xcc] = 1, [0xd0] = 1, [0xcd] = 2, [0xd1] = 2, [0xce] = 4, [0xd2] = 4,
    [0xca] = 4, [0xcf] = 8, [0xd3] = 8, [0xcb] = 8 })[b]
  if width then return pos + 1 + width, pos + 1 end
  return nil
end

-- Where the msgpack value at `pos` ends, arrays and maps too (a message's user properties,
-- annotations, publisher); nil for another kind, past the end or nested too deep.
local function msgpack_skip(blob, pos, depth)
  local after = msgpack_value(blob, pos)
  if after then return after end
  local b = string.byte(blob, pos)
  if not b or depth > 8 then return nil end
  local n, head
  if b >= 0x90 and b <= 0x9f then n, head = b - 0x90, 1
  elseif b >= 0x80 and b <= 0x8f then n, head = 2 * (b - 0x80), 1
  elseif b == 0xdc or b == 0xde then n, head = be(blob, pos + 1, 2), 3
  elseif b == 0xdd or b == 0xdf then n, head = be(blob, pos + 1, 4), 5
  else return nil end
  if b >= 0xde then n = 2 * n end
  pos = pos + head
  for _ = 1, n do
    pos = msgpack_skip(blob, pos, depth + 1)
    if not pos then return nil end
  end
  return pos
end

-- Flags (bit 16: DMQ eligibility set, bit 2 its value), priority (default 4), the
-- payload's size (what a queue's max_message_size limits: gw_spool's `size`) and the
-- partition key (nil without one) of a message's blob.
local function message_fields(blob)
  local pos = 1
  local b = string.byte(blob, pos)
  if b and b >= 0x90 and b <= 0x9f then pos = pos + 1 elseif b == 0xdc then pos = pos + 3
  elseif b == 0xdd then pos = pos + 5 else return 0, 4, #blob, nil end
  local starts = {}
  for field = 1, 19 do  -- ... 18: the AMQP bare message, 19: where the payload starts in it
    local after = msgpack_skip(blob, pos, 0)
    if not after then break end
    starts[field], pos = pos, after
    starts[field + 1] = after
  end
  local function data(field)  -- where the field's bytes start (after its header)
    local _, at = msgpack_value(blob, starts[field])
    return at
  end
  local flags = starts[5] and string.byte(blob, starts[5]) or 0
  local priority = starts[6] and string.byte(blob, starts[6])
  local payload = starts[3] and starts[3] - data(2) or #blob
  local pib = starts[20] and string.byte(blob, starts[19])
  if payload == 0 and pib and pib ~= 0xc0 then  -- kept whole: the payload is the bare's tail
    local at = data(19)
    local offset = pib < 0x80 and pib or be(blob, at, starts[20] - at)
    payload = starts[19] - data(18) - offset
  end
  local key = nil
  local kb = starts[7] and string.byte(blob, starts[7])
  if kb and kb ~= 0xc0 then key = string.sub(blob, data(7), starts[8] - 1) end
  return flags < 0x80 and flags or 0, (priority and priority < 10) and priority or 4, payload,
    key
end

-- DMQ eligibility: the publisher's flag when it set one, else the queue's default.
local function dmq_eligible(blob, default)
  local flags = message_fields(blob)
  if bit.band(flags, 16) ~= 0 then return bit.band(flags, 2) ~= 0 end
  return default
end

-- A property's value from the string the spooler passes along (only the properties some
-- queue's lvq_key or sort_key names): "\0" then "name\0size\0value..." (size: the value's
-- bytes, as it may hold a NUL), or, from a node or Spark executor of an older release,
-- "name\0value\0..." (no name is empty, so the first byte tells them apart).
local function property_value(props, name)
  if string.byte(props, 1) ~= 0 then
    local pos = 1
    while pos <= #props do
      local z1 = string.find(props, '\0', pos, true)
      if not z1 then return nil end
      local z2 = string.find(props, '\0', z1 + 1, true) or (#props + 1)
      if string.sub(props, pos, z1 - 1) == name then return string.sub(props, z1 + 1, z2 - 1) end
      pos = z2 + 1
    end
    return nil
  end
  local pos = 2
  while pos <= #props do
    local z1 = string.find(props, '\0', pos, true)
    if not z1 then return nil end
    local z2 = string.find(props, '\0', z1 + 1, true)
    local size = z2 and tonumber(string.sub(props, z1 + 1, z2 - 1))
    if not size then return nil end
    if string.sub(props, pos, z1 - 1) == name then return string.sub(props, z2 + 1, z2 + size) end
    pos = z2 + size + 1
  end
  return nil
end

-- Count `n` messages of `bytes` more (fewer when negative) on queue q during a gw_spool
-- call, and on its family's usage when its limits bound the family (spool_target).
local function add_usage(q, n, bytes)
  q.count = q.count + n
  q.bytes = q.bytes + bytes
  local u = q.usage
  if u ~= q then
    u.count = u.count + n
    u.bytes = u.bytes + bytes
  end
end

-- Last value queues: a new message replaces the previous one of its slot if that one has
-- not been delivered yet (a delivered one stays with its consumer).

-- The entry id, size and fields of the value a new message of `slot` would replace, and
-- the consumer it waits in: one waiting for a consumer (never delivered, or in the
-- returned, holding or timed consumer), not one a consumer holds. Else nil.
local function replaceable(q, slot)
  local old = redis.call('HGET', k_queue_last_values(q.name), slot)
  if not old then return nil end
  local e = redis.call('XRANGE', q.stream, old, old)
  if #e == 0 then return nil end
  local p = redis.call('XPENDING', q.stream, GROUP, old, old, 1)
  local consumer = p[1] and p[1][2]
  if consumer then
    if consumer ~= RETURNED and consumer ~= HOLDING and consumer ~= TIMED then return nil end
  else
    q.delivered_upto = q.delivered_upto or last_delivered(q.stream)
    if not id_less(q.delivered_upto, old) then return nil end
  end
  return old, #(entry_blob(e[1][2]) or ''), e[1][2], consumer
end

local function replace_last_value(q, slot, id)
  local old, size, fields, consumer = replaceable(q, slot)
  redis.call('HSET', k_queue_last_values(q.name), slot, id)
  if old then
    redis.call('XACK', q.stream, GROUP, old)  -- when it waited in a consumer's PEL
    unindex(q.name, old, fields)
    if consumer == TIMED then redis.call('ZREM', k_queue_timed(q.name), old) end
    if consumer then redis.call('HDEL', k_queue_avoid(q.name), old) end  -- given back
    redis.call('XDEL', q.stream, old)
    add_usage(q, -1, -size)
    q.added = q.added - 1  -- counters are applied at the end of the call
    q.added_bytes = q.added_bytes - size
    q.replaced = (q.replaced or 0) + 1
  end
end

-- What a partitioned or priority queue holds in all its children: its limits bound the
-- whole queue, as a queue's limits do on Solace, RabbitMQ and Qpid.
family_usage = function(parent)
  local u = { count = 0, bytes = 0 }
  for _, child in ipairs(children(parent)) do
    local st = redis.call('HMGET', k_queue_stats(child), 'msgs', 'bytes')
    u.count = u.count + (tonumber(st[1]) or 0)
    u.bytes = u.bytes + (tonumber(st[2]) or 0)
  end
  return u
end

-- Spool state of one queue during a gw_spool call (config and counters read once).
-- `families` (optional): the parents' usage already read in this call, by parent name,
-- shared by the children so each message stored in one counts for all.
local function spool_target(name, families)
  local c = redis.call('HMGET', k_queue_config(name), 'ingress', 'max_message_size',
    'max_spool_bytes', 'max_messages', 'partition_count', 'parent', 'message_groups',
    'max_ttl_ms', 'lvq_key', 'priorities', 'overflow', 'resume_percent', 'vpn', 'sort_key',
    'selective', 'created_ms')
  local info = { name = name, added = 0, added_bytes = 0, dropped = 0, dropped_bytes = 0,
    wake = c[6] or name, hidden = c[6] ~= false, parent = c[6] or false, created = c[16] }
  if not c[1] then
    info.missing = true
    return info
  end
  info.vpn = c[13] or 'default'
  info.vpn_field = 'v:' .. info.vpn  -- its usage and quota fields (K_SPOOL_USAGE, K_SPOOL_LIMITS)
  info.stream = k_queue_stream(name)
  info.ingress = c[1] == '1'
  info.maxsize = tonumber(c[2]) or 0
  info.maxbytes = tonumber(c[3]) or 0
  info.maxmsgs = tonumber(c[4]) or 0
  info.partitions = tonumber(c[5]) or 0
  info.prioritised = c[10] == '1'
  info.grouped = c[7] and c[7] ~= ''
  info.max_ttl = tonumber(c[8]) or 0
  -- a sorted queue: its entries keep the key's value ('sk')
  info.sort_key = c[14] and c[14] ~= '' and c[14] or false
  info.holding = info.grouped or info.sort_key or c[15] == '1'  -- see park_consumer
  -- last value queues: Solace's (max_spool_bytes 0: one slot) or Qpid's (by a property)
  if c[3] == '0' then
    info.lvq = true
  elseif c[9] and c[9] ~= '' then
    info.lvq, info.lvq_key = true, c[9]
  end
  -- a message in the short form to it alone needs only the checks of spool_plainly
  info.plain = not info.hidden and info.partitions == 0 and not info.prioritised
    and info.ingress and not info.lvq and not info.sort_key and info.max_ttl == 0
  local st = redis.call('HMGET', k_queue_stats(name), 'bytes', 'msgs', 'blocked', 'flow_held')
  info.bytes = tonumber(st[1]) or 0
  info.count = tonumber(st[2]) or 0
  info.held_marks = st[4] == '1'  -- see flow_held_mark
  info.usage = info  -- what its limits bound: the queue, or its parent's whole family
  if c[6] and (info.maxmsgs > 0 or info.maxbytes > 0) then
    local u = families and families[c[6]]
    if not u then
      u = family_usage(c[6])
      if families then families[c[6]] = u end
    end
    info.usage = u
  end
  info.overflow = c[11] or 'reject'
  -- producer flow control: blocked until below the resume level (or another overflow
  -- policy is set: publishers get its answer at once). A partition or priority level is
  -- blocked with its whole queue (the mark is the parent's: a child's own is an earlier
  -- release's, which held only the publishers of the level that crossed the limit)
  local blocked = st[3]
  info.blocked_stats = k_queue_stats(name)
  if info.partitions > 0 or info.prioritised then
    blocked = false  -- the parent a publish names: its partition or level judges the mark
  elseif c[6] then
    if blocked then redis.call('HDEL', info.blocked_stats, 'blocked') end
    info.blocked_stats = k_queue_stats(c[6])
    blocked = redis.call('HGET', info.blocked_stats, 'blocked')
  end
  if blocked == '1' then
    local resume = (tonumber(c[12]) or 80) / 100
    local u = info.usage
    if info.overflow == 'flow_control' and ((info.maxmsgs > 0 and u.count >= info.maxmsgs * resume)
        or (info.maxbytes > 0 and u.bytes >= info.maxbytes * resume)) then
      info.blocked = true
    else
      redis.call('HDEL', info.blocked_stats, 'blocked')
    end
  end
  return info
end

local function over_quota(q, size)
  local u = q.usage or q
  return (q.maxbytes > 0 and u.bytes + size > q.maxbytes)
    or (q.maxmsgs > 0 and u.count + 1 > q.maxmsgs)
end

-- A last value queue at its limits still takes a new value of a slot whose waiting value
-- it replaces: the queue does not grow (Qpid's LVQ).
-- The waiting value (id, size) a new message with `props` replaces in last value queue q.
local function replaced_value(q, props)
  local slot = ''
  if q.lvq_key then slot = property_value(props, q.lvq_key) end
  if not slot then return nil end
  local old, old_size = replaceable(q, slot)
  return old, old_size
end

-- What a ring queue's new message replaces: nothing unless it is a last value queue.
local function ring_replaced(q, props)
  if not q.lvq then return nil end
  return replaced_value(q, props)
end

local function fits_replacing(q, props, size)
  local old, old_size = replaced_value(q, props)
  if not old then return false end
  local u = q.usage
  return not over_quota({ maxbytes = q.maxbytes, maxmsgs = q.maxmsgs,
    bytes = u.bytes - old_size, count = u.count - 1 }, size)
end

-- The broker-wide and per-VPN quotas during one gw_spool call: the limits and the stored
-- totals are read once; what the call added so far is its queues' net change.
-- `any`: some quota is set (else no message needs the check).
local function spool_quotas()
  local raw = redis.call('HGETALL', K_SPOOL_LIMITS)
  local limits, any = {}, false
  for i = 1, #raw, 2 do
    local v = tonumber(raw[i + 1]) or 0
    limits[raw[i]] = v
    if v > 0 and (raw[i] == 'broker' or string.sub(raw[i], 1, 2) == 'v:') then any = true end
  end
  -- added: the call's net bytes so far, by usage field (kept by spool_added)
  return { limits = limits, base = {}, added = {}, any = any }
end

-- What storing `size` bytes in target t adds to the spool: less what its ring plan drops
-- for it, and the waiting value it replaces in a last value queue (`t.frees`, set per
-- message by frees_for).
local function net_added(t, size)
  local plan = t.plan
  if not plan then return size - (t.frees or 0) end
  -- a ring plan that drops the replaced value counts it in its bytes already
  return size - plan.bytes - (plan.replaced and 0 or (t.frees or 0))
end

-- Each last value target's `frees` for the message with `props`: the size of the waiting
-- value it replaces (a replacement does not grow the spool, so a full quota takes it).
local function frees_for(targets, nt, props)
  for i = 1, nt do
    local t = targets[i]
    local _, size = nil, nil
    if t.lvq then _, size = replaced_value(t, props) end
    t.frees = size or 0
  end
end

-- True when storing `size` more bytes in each of `targets` would pass the broker's quota or
-- the quota of one of their VPNs; `nt`: the number of targets.
local function over_spool_quota(sq, targets, nt, size)
  local limits, need, any = sq.limits, {}, false
  for i = 1, nt do  -- what the message adds, less what it drops or replaces
    local t = targets[i]
    local n = net_added(t, size)
    if (limits.broker or 0) > 0 then
      need.broker, any = (need.broker or 0) + n, true
    end
    if (limits[t.vpn_field] or 0) > 0 then
      need[t.vpn_field], any = (need[t.vpn_field] or 0) + n, true
    end
  end
  if not any then return false end
  local added = sq.added
  for f, n in pairs(need) do
    local base = sq.base[f]
    if not base then
      base = tonumber(redis.call('HGET', K_SPOOL_USAGE, f) or '0') or 0
      sq.base[f] = base
    end
    if base + (added[f] or 0) + n > limits[f] then return true end
  end
  return false
end

-- Count a stored copy of `size` bytes (less what its ring queue dropped for it) in the
-- call's running totals of the broker and its VPN.
local function spool_added(sq, q, size)
  local added = sq.added
  added.broker = (added.broker or 0) + size
  added[q.vpn_field] = (added[q.vpn_field] or 0) + size
end

-- Ring overflow. What one queue (`m`, a spool target) would drop, oldest first, is
-- m.drop: waiting entries, parked in a consumer of the group (returned by a consumer that
-- went away; held for a group, selector or sort order; held until a delivery time), then
-- never read ones (every parked entry was read before those).
local function start_drop(m)
  m.delivered_upto = m.delivered_upto or last_delivered(m.stream)
  local parked = { { consumer = RETURNED, from = '-' }, { consumer = TIMED, from = '-' } }
  if m.holding then parked[3] = { consumer = HOLDING, from = '-' } end
  m.drop = { ids = {}, bytes = 0, after = m.delivered_upto, parked = {}, sources = parked }
end

-- The id of m's oldest waiting entry not yet in m.drop and the parked source it comes
-- from (false: never read); nil when none is left.
local function next_waiting(m)
  local d, oldest = m.drop, nil
  for _, c in ipairs(d.sources) do
    if c.next == nil then
      local p = redis.call('XPENDING', m.stream, GROUP, c.from, '+', 1, c.consumer)
      c.next = p[1] and p[1][1] or false
    end
    if c.next and (not oldest or id_less(c.next, oldest.next)) then oldest = c end
  end
  if oldest then return oldest.next, oldest end
  if d.unread == nil then
    local e = redis.call('XRANGE', m.stream, '(' .. d.after, '+', 'COUNT', 1)
    d.unread = e[1] or false
  end
  if d.unread then return d.unread[1], false end
end

-- Add entry `id` (from `source`, see next_waiting) to m.drop; returns its size.
local function add_to_drop(m, id, source)
  local d, fields = m.drop, nil
  if source then
    source.from, source.next = '(' .. id, nil
    local e = redis.call('XRANGE', m.stream, id, id)
    fields = e[1] and e[1][2] or {}
    d.parked[#d.parked + 1] = { id, fields, source.consumer }
  else
    fields = d.unread[2]
    d.after, d.unread = id, nil
  end
  local n = #(entry_blob(fields) or '')
  d.ids[#d.ids + 1] = id
  d.bytes = d.bytes + n
  return n
end

-- First step: the waiting messages that would have to go for `size` more to fit in q,
-- chosen without deleting anything (the message may still be refused by a later check).
-- Sets q.plan. Delivered (unsettled) messages are not dropped: when only they are left, the
-- message is taken over the limit (a ring never refuses a publisher; RabbitMQ's drop-head
-- counts only ready messages), and the limit bounds the waiting ones until they settle. The
-- limits of a partitioned or priority queue bound its family, so with `sibling` (gw_spool's
-- spool target of another child) it drops from the family: a priority queue from its
-- lowest level first, a partitioned one its oldest entries whatever their partition.
local function plan_drop(q, size, sibling, replaced, replaced_size)
  local members, by_level = { q }, false
  if sibling and q.parent and q.usage ~= q then
    members = {}
    local kids = children(q.parent)  -- levels come highest first
    for i = #kids, 1, -1 do members[#members + 1] = kids[i] == q.name and q or sibling(kids[i]) end
    by_level = redis.call('HGET', k_queue_config(q.parent), 'priorities') == '1'
  end
  for _, m in ipairs(members) do start_drop(m) end
  local plan = { bytes = 0, members = members }
  q.plan = plan
  local u = q.usage
  local probe = { maxbytes = q.maxbytes, maxmsgs = q.maxmsgs, bytes = u.bytes, count = u.count }
  if replaced then  -- a last value queue's new value: its slot's waiting one goes anyway
    probe.bytes, probe.count = probe.bytes - replaced_size, probe.count - 1
  end
  while over_quota(probe, size) do
    local best, best_id, best_source
    for _, m in ipairs(members) do
      local id, source = next_waiting(m)
      if id and (not best or id_less(id, best_id)) then best, best_id, best_source = m, id, source end
      if best and by_level then break end
    end
    if not best then break end
    local n = add_to_drop(best, best_id, best_source)
    plan.bytes = plan.bytes + n
    if best_id ~= replaced then  -- that one was counted out above
      probe.count = probe.count - 1
      probe.bytes = probe.bytes - n
    else  -- the oldest is the one replaced: it goes with the drop, counted as replaced
      plan.replaced = { m = best, bytes = n }
    end
  end
end

-- Second step, once the message is stored: delete what plan_drop chose.
local function commit_drop(q)
  local plan = q.plan
  if not plan then return end
  q.plan = nil
  for _, m in ipairs(plan.members) do
    local d = m.drop
    m.drop = nil
    local n = #d.ids
    if n > 0 then
      local avoiding = #d.parked > 0 and avoid_key(m.name)
      for _, e in ipairs(d.parked) do  -- out of its consumer (and a sorted or timed index)
        redis.call('XACK', m.stream, GROUP, e[1])
        unindex(m.name, e[1], e[2])
        if e[3] == TIMED then redis.call('ZREM', k_queue_timed(m.name), e[1]) end
        if avoiding then redis.call('HDEL', avoiding, e[1]) end
      end
      if m.lvq then forget_last_values(m.name, m.stream, d.ids, 1, n) end
      ids_call('XDEL', m.stream, d.ids, 1, n)
      m.delivered_upto = d.after
      add_usage(m, -n, -d.bytes)
      m.dropped = m.dropped + n
      m.dropped_bytes = m.dropped_bytes + d.bytes
    end
  end
  local r = plan.replaced
  if r then
    r.m.dropped, r.m.dropped_bytes = r.m.dropped - 1, r.m.dropped_bytes - r.bytes
    r.m.added, r.m.added_bytes = r.m.added - 1, r.m.added_bytes - r.bytes  -- as a replace
    r.m.replaced = (r.m.replaced or 0) + 1
  end
end

-- Whether a dead message of `size` bytes stored (`payload` of them its payload, what
-- max_message_size limits) finds no room in dead message queue `dmq`: shut (ingress
-- disabled), too large, or past its quota (a ring DMQ drops its oldest instead),
-- the broker's or its VPN's.
local function dmq_full(dmq, size, payload)
  local families, by_name = {}, {}
  local function target(name)  -- a ring DMQ with partitions or levels drops from them all
    by_name[name] = by_name[name] or spool_target(name, families)
    return by_name[name]
  end
  local t = target(dmq)
  if t.missing or not t.ingress or (t.maxsize > 0 and payload > t.maxsize)
      or (t.maxbytes > 0 and size > t.maxbytes) then
    return true
  end
  local freed = 0
  if over_quota(t, size) then
    if t.overflow ~= 'ring' then return true end
    plan_drop(t, size, target)
    freed = t.plan.bytes
  end
  local broker, in_vpn = spool_limits(t.vpn)
  local u = redis.call('HMGET', K_SPOOL_USAGE, 'broker', 'v:' .. t.vpn)
  if (broker > 0 and (tonumber(u[1]) or 0) - freed + size > broker)
      or (in_vpn > 0 and (tonumber(u[2]) or 0) - freed + size > in_vpn) then
    return true
  end
  commit_drop(t)
  for name, m in pairs(by_name) do
    if m.dropped > 0 then
      account(name, -m.dropped, -m.dropped_bytes, m.vpn, m.maxbytes, m.parent)
      redis.call('HINCRBY', k_queue_stats(name), 'dropped', m.dropped)
    end
  end
  return false
end

-- Take an entry off its queue for good (`reason`: expired, max_redelivered, rejected): to
-- the queue's dead message queue when `to_dmq`, the message is eligible and that queue
-- exists and has room, with its origin and reason as entry fields, else discarded. Counted
-- either way ('dmq_failed' too when the DMQ was full, as Solace counts "to DMQ failed";
-- 'dmq_cycle' when it expired round a cycle of them).
local function dead_letter(q, s, id, blob, reason, to_dmq)
  local c = redis.call('HMGET', k_queue_config(q), 'dead_message_queue', 'dmq_eligible_default')
  local e = redis.call('XRANGE', s, id, id)
  local kh = #e > 0 and entry_field(e[1][2], 'kh')
  if #e > 0 then forget_last_value(q, id, e[1][2]) end
  redis.call('XACK', s, GROUP, id)
  if redis.call('EXISTS', k_queue_readers(q)) == 0 then redis.call('XDEL', s, id) end
  redis.call('HDEL', k_queue_avoid(q), id)  -- gone for good: no flow to avoid any more
  local st = k_queue_stats(q)
  account(q, -1, -#blob)
  redis.call('HINCRBY', st, reason, 1)
  local dmq = c[1]
  -- a partition or priority level dead-letters as its queue: never into that queue itself
  local origin = redis.call('HGET', k_queue_config(q), 'parent') or q
  -- 'v': the queues the message expired from since a consumer last refused it. One that
  -- expired round a cycle of dead message queues is dropped, as RabbitMQ does, not passed
  -- round for ever
  local expired_from = reason == 'expired' and (#e > 0 and entry_field(e[1][2], 'v') or '')
  local goes = to_dmq and dmq and dmq ~= origin and dmq_eligible(blob, c[2] == '1')
    and redis.call('EXISTS', k_queue_config(dmq)) == 1
  -- counted only when the cycle is why it goes nowhere
  if goes and expired_from
      and string.find('\0' .. expired_from .. '\0', '\0' .. dmq .. '\0', 1, true) then
    redis.call('HINCRBY', st, 'dmq_cycle', 1)
    goes = false
  end
  if goes then
    local d = redis.call('HMGET', k_queue_config(dmq), 'partition_count', 'priorities',
      'message_groups')
    local np = tonumber(d[1]) or 0
    if np > 0 then  -- by the key's hash, like the spool; partition 0 without a key
      local index = 0
      if kh then
        local hi, lo = string.match(kh, '^(%d+):(%d+)$')
        index = ((tonumber(hi) % np) * (4294967296 % np) + tonumber(lo) % np) % np
      end
      dmq = partition_queue(dmq, index)
    end
    local _, priority, payload, key = message_fields(blob)
    if np == 0 and d[2] == '1' then dmq = priority_queue(dmq, priority) end
    -- a sorted dead message queue sorts by the key the entry kept if it sorts by the same
    -- property as its origin; else the message counts as one without the key
    if dmq_full(dmq, #blob, payload) then
      redis.call('HINCRBY', st, 'discarded', 1)
      redis.call('HINCRBY', st, 'dmq_failed', 1)
      return
    end
    local dsk = sort_key(dmq)
    local sk = dsk and dsk == sort_key(q) and #e > 0 and entry_field(e[1][2], 'sk')
    local add = { 'XADD', k_queue_stream(dmq), '*', 'm', blob, 'o', origin, 'r', reason }
    if sk then
      add[#add + 1] = 'sk'
      add[#add + 1] = sk
    end
    -- its message group in a dead message queue with groups (as entry_args stores it)
    if key and key ~= '' and d[3] and d[3] ~= '' then  -- an empty one is no group
      add[#add + 1] = 'k'
      add[#add + 1] = key
    end
    if kh then
      add[#add + 1] = 'kh'
      add[#add + 1] = kh
    end
    if expired_from then
      add[#add + 1] = 'v'
      add[#add + 1] = expired_from == '' and origin or expired_from .. '\0' .. origin
    end
    -- the dead message queue's own max_ttl_ms applies from now (the message's expiry,
    -- passed or not, stays behind: a message expired to the DMQ is kept there)
    local ttl = tonumber(redis.call('HGET', k_queue_config(dmq), 'max_ttl_ms')) or 0
    if ttl > 0 then
      add[#add + 1] = 'x'
      add[#add + 1] = now_ms() + ttl
      redis.call('ZADD', K_EXPIRING_QUEUES, 'LT', now_ms() + ttl, dmq)
    end
    redis.call(unpack(add))
    if dsk then admit_sorted(dmq) end
    account(dmq, 1, #blob)
    redis.call('HINCRBY', k_queue_stats(dmq), 'spooled', 1)
    wake(dmq)
    redis.call('HINCRBY', st, 'dead_lettered', 1)
  else
    redis.call('HINCRBY', st, 'discarded', 1)
  end
end

-- XADD arguments of a message with extra fields: its key (message groups; 'kh' places it
-- in a partitioned dead message queue), expiry 'x' (the smaller of the publisher's and the
-- queue's TTL), delivery time 'h' (held invisible until then) and sort key value 'sk'.
local function entry_args(q, blob, key, hi, lo, expires, not_before, sk, slot)
  local args = { 'XADD', q.stream, '*', 'm', blob }
  if sk then
    args[#args + 1] = 'sk'
    args[#args + 1] = sk
  end
  if slot then
    args[#args + 1] = 'lv'
    args[#args + 1] = slot
  end
  if key ~= '' then
    if q.grouped then
      args[#args + 1] = 'k'
      args[#args + 1] = key
    end
    args[#args + 1] = 'kh'
    args[#args + 1] = hi .. ':' .. lo
  end
  local x = expires
  if q.max_ttl > 0 then
    local now = now_ms()
    if x == 0 or now + q.max_ttl < x then x = now + q.max_ttl end
  end
  if x > 0 then
    args[#args + 1] = 'x'
    args[#args + 1] = x
    q.soonest = math.min(q.soonest or x, x)  -- when the sweep looks at it (expire_waiting)
  end
  if not_before > 0 then
    args[#args + 1] = 'h'
    args[#args + 1] = not_before
  end
  return args
end

-- Producer flow control keeps each publisher's order. Once a queue holds back a message of
-- a node, it holds back that node's later messages too (even when it has room again by
-- then), until the node offers the held messages again: it clears its marks on their
-- queues (gw_flow_held_clear), then sends them, oldest first, ahead of any newer one (one
-- held again marks its queue again). A node that stopped before its retry leaves a mark that
-- lapses after FLOW_HELD_LAPSE seconds. The marks hold under any overflow policy: one set
-- to the queue since holds its publishers no more, but what was held is stored first. While
-- marks exist, the queue's stats say so ('flow_held'), so a queue without them costs no read.
local FLOW_HELD_LAPSE = 60

local function clear_flow_held(q, node)
  redis.call('HDEL', q.flow_held_key, node)
  if redis.call('EXISTS', q.flow_held_key) == 0 then
    redis.call('HDEL', k_queue_stats(q.name), 'flow_held')
  end
end

local function flow_held_mark(q, node)
  q.flow_held_key, q.flow_held_node = k_queue_flow_held(q.name), node
  local since = redis.call('HGET', q.flow_held_key, node)
  if not since then return end
  if tonumber(redis.call('TIME')[1]) - tonumber(since) > FLOW_HELD_LAPSE then
    clear_flow_held(q, node)
  else
    q.flow_held = true
  end
end

local function hold_for_node(q)
  if q.flow_held_key and not q.flow_held_marked then
    q.flow_held, q.flow_held_marked = true, true
    redis.call('HSET', q.flow_held_key, q.flow_held_node, redis.call('TIME')[1])
    redis.call('HSET', k_queue_stats(q.name), 'flow_held', '1')
  end
  return FLOW_CONTROLLED
end

-- ARGV: node, nq, queue names (one a topic subscription routed to: "name created_ms", the
-- queue it was routed to; a queue made again since under its name is missing to it, so it
-- takes nothing its former self's subscriptions attracted)..., then per message: k, queue
-- indexes (k)..., direct,
-- payload size (checked against max_message_size), key hash high and low 32 bits (picks
-- the partition of a partitioned queue: xxh3_64(key) % partition_count), the key itself
-- ('' for none; kept as field 'k' on message-group queues), the publisher's expiry (epoch
-- ms, 0: none; kept as field 'x', shortened to the queue's max_ttl_ms), the properties LVQ
-- keys name (see property_value), priority (0-9: the level of a priority queue), the
-- delivery time (epoch ms, 0: now; kept as field 'h'), blob.
-- A message without key, expiry, properties or delivery time may come in the short form:
-- two arguments, a binary head and the blob. The head (big-endian): a 0 byte (a full-form
-- k never starts with one), k and the k queue indexes (4 bytes each), direct (1 byte), the
-- payload size and the key hash low 32 bits (4 bytes each; the high ones are 0), priority
-- (1 byte). Fewer arguments: each costs Redis and Lua a string object.
-- Spooled bytes count the stored blob. A message that would pass the broker-wide quota or
-- the quota of one of its queues' VPNs (gw_spool_limits) is refused with QUOTA_EXCEEDED.
-- Returns one outcome code per message; a message is stored in all its queues or in none.
local NAMED_HIDDEN = { missing = true }

-- The common message, stored by gw_spool in one step: the short form, to one plain queue
-- (spool_target) with room, no quota of the broker or its VPN set. False when it needs the
-- general path (its checks then give the same answer for it as they would here).
-- ~1 µs a message less in Redis than the general path (AMQP or MQTT, 100 B).
local function spool_plainly(q, sq, size, blob)
  local bytes = #blob
  if not q.plain or q.blocked or q.flow_held or (q.maxsize > 0 and size > q.maxsize)
      or over_quota(q, bytes) or sq.any then
    return false
  end
  redis.call('XADD', q.stream, '*', 'm', blob)
  add_usage(q, 1, bytes)
  q.added = q.added + 1
  q.added_bytes = q.added_bytes + bytes
  return true
end

-- `marks` (gw_spool_marked): by a message's place in the call, the set and member that
-- say it was stored before (an MQTT QoS 2 publish: its client's received ids), and the
-- claims hash and claim of the connection that sent it.
local function spool(a, marks)
  local nq = tonumber(a[2])
  local qs, by_name, families = {}, {}, {}
  local function target(name)
    local t = by_name[name]
    if not t then
      local routed_to, created = string.match(name, '^(%S+) (%d+)$')
      if routed_to then
        t = target(routed_to)
        if t.created ~= created then t = NAMED_HIDDEN end
      else
        t = spool_target(name, families)
        if t.overflow == 'flow_control' or t.held_marks then flow_held_mark(t, a[1]) end
        qs[#qs + 1] = t
      end
      by_name[name] = t
    end
    return t
  end
  local named = {}  -- by the index as sent: a decimal string (full form) or a number
  for i = 1, nq do
    named[tostring(i)] = a[2 + i]
    named[i] = a[2 + i]
  end
  local unpack_head = struct.unpack
  local sq  -- broker and VPN quotas, read at the first message that has a queue
  local out, nout = {}, 0
  local targets, nt = {}, 0  -- the queues one message goes to, reused by every message
  local names = {}  -- the queue names one message goes to (its first k entries)
  local pos = 3 + nq
  local n = #a
  while pos <= n do
    local head = a[pos]
    local k, direct, size, hi, lo, key, expires, props, priority, not_before, blob
    local one  -- the short form to one queue: its index
    if #head == 19 and string.byte(head, 1) == 0 then  -- one unpack
      k, one, direct, size, lo, priority = unpack_head('>I4I4BI4I4B', head, 2)
      sq = sq or spool_quotas()
    end
    local mark = marks and marks[nout + 1]
    if mark and tonumber(mark[4]) < tonumber(redis.call('HGET', mark[3], 'fresh') or 0) then
      mark = nil  -- a newer connection started a new session (its ids cleared): stored as
      -- it would be unmarked, so it swallows none of the new session's messages
    end
    if one and not mark and spool_plainly(target(named[one]), sq, size, a[pos + 1]) then
      pos = pos + 2
      nout = nout + 1
      out[nout] = OK
    else
      if string.byte(head, 1) == 0 then  -- the short form
        if one then
          names[1] = named[one]
        else
          local at, i
          k, at = unpack_head('>I4', head, 2)
          for j = 1, k do
            i, at = unpack_head('>I4', head, at)
            names[j] = named[i]
          end
          direct, size, lo, priority = unpack_head('>BI4I4B', head, at)
        end
        direct = direct == 1
        hi, key, expires, props, not_before, blob = 0, '', 0, '', 0, a[pos + 1]
        pos = pos + 2
      else
        k = head == '1' and 1 or tonumber(head)
        for j = 1, k do names[j] = named[a[pos + j]] end
        local m = pos + k  -- the message's fields follow its queue indexes
        direct = a[m + 1] == '1'
        size = tonumber(a[m + 2])
        hi, lo, key, expires, props, priority, not_before, blob =
          a[m + 3], a[m + 4], a[m + 5], a[m + 6], a[m + 7], a[m + 8], a[m + 9], a[m + 10]
        expires = expires == '0' and 0 or tonumber(expires)
        not_before = not_before == '0' and 0 or tonumber(not_before)
        pos = m + 11
      end
      local bytes = #blob
      local code, shut = OK, false  -- shut: the names of its shut queues, if any
      nt = 0
      -- a resend of a message stored before: stored once (its queues count as none)
      local resent = mark and redis.call('SISMEMBER', mark[1], mark[2]) == 1
      if resent then k = 0 end
      for j = 1, k do
        local q = target(names[j])
        if q.hidden then q = NAMED_HIDDEN end  -- a partition or level named by a message
        if not q.missing and q.partitions > 0 then
          local np = q.partitions
          local h, l = tonumber(hi), tonumber(lo)
          q = target(partition_queue(q.name, ((h % np) * (4294967296 % np) + l % np) % np))
        elseif not q.missing and q.prioritised then
          q = target(priority_queue(q.name, tonumber(priority)))
        end
        q.plan = nil
        if q.missing then
          if direct then code = NOT_FOUND end
        elseif not q.ingress then  -- a topic's other queues still take it (Solace's
          -- when-queue-enabled: a shut queue discards without a NACK); one named is refused
          if direct then
            code = INGRESS_DISABLED
          else
            shut = shut or {}
            shut[#shut + 1] = q.name
          end
        elseif q.maxsize > 0 and size > q.maxsize then code = TOO_LARGE
        elseif q.maxbytes > 0 and bytes > q.maxbytes then code = QUOTA_EXCEEDED  -- fits never:
          -- held (flow_control), it held back the node's later messages to the queue for good
        elseif q.flow_held or (q.blocked and not (q.lvq and fits_replacing(q, props, bytes)))
        then  -- a value replacing a waiting one does not grow a blocked last value queue
          code = hold_for_node(q)  -- (unless this node holds some: order per publisher,
          -- or an older value it holds would replace it once stored)
        elseif over_quota(q, bytes) and not (q.lvq and fits_replacing(q, props, bytes)) then
          if q.overflow == 'ring' then
            plan_drop(q, bytes, target, ring_replaced(q, props))
            nt = nt + 1
            targets[nt] = q
          elseif q.overflow == 'flow_control' then
            code = hold_for_node(q)
            q.blocked = true
            redis.call('HSET', q.blocked_stats, 'blocked', '1')
          elseif q.maxbytes > 0 and q.usage.bytes + bytes > q.maxbytes then code = QUOTA_EXCEEDED
          else code = QUEUE_FULL end
        else
          nt = nt + 1
          targets[nt] = q
        end
        if code ~= OK then break end
      end
      if code == OK and nt > 0 then  -- the broker's and the VPNs' quotas: all or none
        sq = sq or spool_quotas()
        if sq.any then
          frees_for(targets, nt, props)
          if over_spool_quota(sq, targets, nt, bytes) then code = QUOTA_EXCEEDED end
        end
      end
      if code == OK then
        if nt == 0 then
          code = direct and NOT_FOUND or (shut and OK or NO_SUBSCRIBERS)
        else
          local plain = key == '' and expires == 0 and not_before == 0
          for i = 1, nt do
            local q = targets[i]
            if sq.any then spool_added(sq, q, net_added(q, bytes)) end
            commit_drop(q)
            local id
            local sk = q.sort_key and property_value(props, q.sort_key)
            local slot = q.lvq and (not q.lvq_key and '' or property_value(props, q.lvq_key))
            if plain and q.max_ttl == 0 and not sk and not slot then
              id = redis.call('XADD', q.stream, '*', 'm', blob)  -- the common, plain message
            else
              id = redis.call(unpack(
                entry_args(q, blob, key, hi, lo, expires, not_before, sk, slot)))
            end
            if slot then replace_last_value(q, slot, id) end
            add_usage(q, 1, bytes)
            q.added = q.added + 1
            q.added_bytes = q.added_bytes + bytes
          end
        end
        -- counted once the message is taken: not at each retry of one producer flow
        -- control held, nor for one another queue refused (its publisher sends it again)
        if shut then
          for _, name in ipairs(shut) do
            redis.call('HINCRBY', k_queue_stats(name), 'discarded_shut', 1)
          end
        end
      end
      if resent then
        code = OK
      elseif mark and (code == OK or code == NO_SUBSCRIBERS) and (
          redis.call('HEXISTS', mark[3], 'holder') == 1 or redis.call('EXISTS', mark[5]) == 1) then
        redis.call('SADD', mark[1], mark[2])  -- while the session lasts: held or stored
      end
      nout = nout + 1
      out[nout] = code
    end
  end
  local woken = {}
  for _, q in ipairs(qs) do
    if q.added > 0 or q.replaced or q.dropped > 0 then
      local st = k_queue_stats(q.name)
      account(q.name, q.added - q.dropped, q.added_bytes - q.dropped_bytes, q.vpn, q.maxbytes,
        q.parent)
      if q.dropped > 0 then redis.call('HINCRBY', st, 'dropped', q.dropped) end
      redis.call('HINCRBY', st, 'spooled', q.added + (q.replaced or 0))
      if q.replaced then redis.call('HINCRBY', st, 'replaced', q.replaced) end
      if q.sort_key then admit_sorted(q.name) end
      if q.soonest then redis.call('ZADD', K_EXPIRING_QUEUES, 'LT', q.soonest, q.name) end
      if not woken[q.wake] then
        woken[q.wake] = true
        redis.call('PUBLISH', k_queue_wake(q.wake), a[1])
      end
    end
  end
  return out
end

redis.register_function('gw_spool', function(_, a) return spool(a) end)

-- ARGV: node, queue names. The node is about to offer again the messages producer flow
-- control held of it for these queues: its marks on them go (on their partitions and
-- priority levels too, where a message's mark is), so the batches that follow judge its
-- held messages afresh, in order (see flow_held_mark).
register_always('gw_flow_held_clear', function(_, a)
  for i = 2, #a do
    local names = children(a[i])
    names[#names + 1] = a[i]
    for _, name in ipairs(names) do
      clear_flow_held({ name = name, flow_held_key = k_queue_flow_held(name) }, a[1])
    end
  end
  return 'OK'
end)

-- KEYS: per marked message, a set, its client's claims hash and state. ARGV: the marked
-- messages' places in the call, each with its member and its connection's claim ("1 17 5
-- 4 230 5": message 1, member 17; message 4, member 230; both of claim 5), then gw_spool's
-- arguments. A marked message is recorded in its set in the same step as it is stored, and
-- one already recorded is not stored again: a publisher's resend after a lost answer is no
-- duplicate. Marks count until a later connection starts a new session (gw_client_fresh).
redis.register_function('gw_spool_marked', function(k, a)
  local marks, i = {}, 0
  for place, member, claim in string.gmatch(table.remove(a, 1), '(%d+) (%S+) (%d+)') do
    marks[tonumber(place)] = { k[i + 1], member, k[i + 2], claim, k[i + 3] }
    i = i + 3
  end
  return spool(a, marks)
end)

-- ARGV: queue, flow, count, fence. Returns {'ok', dead-lettered, then per entry: id,
-- delivery count (ACQUIRED added: acquired before), blob, meta}, or {'noflow'} / {'notowner'} / {'egress'} / {'noqueue'}. Entries that expired or
-- passed max_redelivery are dead-lettered instead of delivered (and counted in the reply).
-- Requeued entries (oldest first) are served before new ones, so order survives failover.
-- Meta of an entry: '' for a plain one, else "expiry\norigin queue\nreason": the stored
-- expiry 'x' (the queue's max_ttl_ms may have shortened the publisher's: consumers are told
-- the effective one) and, for a dead-lettered entry, where it came from and why.
local function entry_meta(fields)
  local x, o = entry_field(fields, 'x'), entry_field(fields, 'o')
  if not x and not o then return '' end
  return (x or '') .. '\n' .. (o or '') .. '\n' .. (entry_field(fields, 'r') or '')
end

-- Limits a fetch applies to each entry before handing it out, from the queue's config
-- fields max_redelivery and respect_ttl. The clock is read once, when an entry first needs
-- it (lim_now).
local function fetch_limits(max_redelivery, respect_ttl)
  return { max_redelivery = tonumber(max_redelivery) or 0, respect_ttl = respect_ttl == '1' }
end

local function lim_now(lim)
  if not lim.now then lim.now = now_ms() end
  return lim.now
end

-- The blob of an entry about to be delivered for the `count`-th time, or false when it is
-- held until a later delivery time (parked in the timed consumer), expired (never
-- delivered) or was already delivered max_redelivery + 1 times: then it is dead-lettered
-- here, atomically with the fetch.
local function deliverable(q, s, id, fields, count, lim)
  local blob = entry_blob(fields)
  if not blob then return false end
  local h = tonumber(entry_field(fields, 'h'))
  if h and h > lim_now(lim) then  -- not due yet: park it, undelivered, until the sweep returns it
    redis.call('XCLAIM', s, GROUP, TIMED, 0, id, 'RETRYCOUNT', count - 1, 'JUSTID')
    redis.call('ZADD', k_queue_timed(q), h, id)
    redis.call('ZADD', K_TIMED_QUEUES, 'LT', h, q)
    waiting_again(q)  -- in the timed list now, maybe behind where the expiry sweep reads it
    return false
  end
  local x = tonumber(entry_field(fields, 'x'))
  if x and x <= lim_now(lim) then
    dead_letter(q, s, id, blob, 'expired', lim.respect_ttl)
    return false
  end
  if lim.max_redelivery > 0 and deliveries(count) > lim.max_redelivery + 1 then
    dead_letter(q, s, id, blob, 'max_redelivered', true)
    return false
  end
  return blob
end

-- Message-group queues: new entries first move to the holding consumer (delivery count 0);
-- a flow then takes, oldest first, held entries that are ungrouped or whose group is free or
-- already its own, so one group never reaches two consumers at once and groups never block
-- each other. Default mode: a group stays with its consumer while that consumer lives.
-- Shared mode: a group is free again once its holder settled all its messages.
-- The oldest `scan` entries waiting in the holding consumer, after moving new entries in
-- (with their delivery count set to 0: holding is no delivery).
local function held_entries(s, scan)
  local held = redis.call('XPENDING', s, GROUP, '-', '+', scan, HOLDING)
  if #held < scan then
    local r = redis.call('XREADGROUP', 'GROUP', GROUP, HOLDING, 'COUNT', scan - #held,
      'STREAMS', s, '>')
    if r then
      local args = { 'XCLAIM', s, GROUP, HOLDING, 0 }
      for _, e in ipairs(r[1][2]) do args[#args + 1] = e[1] end
      args[#args + 1] = 'RETRYCOUNT'
      args[#args + 1] = 0
      args[#args + 1] = 'JUSTID'
      redis.call(unpack(args))
      held = redis.call('XPENDING', s, GROUP, '-', '+', scan, HOLDING)
    end
  end
  return held
end

-- Whether `flow` holds (delivered, unsettled) an entry of message group `g`.
local function holds_group(s, flow, g, mode, default_group)
  local from = '-'
  while true do
    local page = redis.call('XPENDING', s, GROUP, from, '+', IDS_PER_CALL, flow)
    for _, p in ipairs(page) do
      if entry_group(s, p[1], mode, default_group) == g then return true end
    end
    if #page < IDS_PER_CALL then return false end
    from = '(' .. page[#page][1]
  end
end

-- Default mode: a group stays with its consumer while it lives, unless that consumer
-- cannot take one of its messages (undeliverable-here): once it holds none of the group,
-- the group is free for another (wake: its consumers fetch).
local function free_avoided_group(q, s, flow, g)
  local groups = k_queue_groups(q)
  if redis.call('HGET', groups, g) == flow and not holds_group(s, flow, g, 'default') then
    redis.call('HDEL', groups, g)
    wake(q)
  end
end

-- Default mode: the groups `flow` let go of with undeliverable-here are free once it holds
-- none of them (free_avoided_group); checked as it settles, as it may fetch no more.
local function free_groups_avoided_by(q, s, flow)
  local avoiding = avoid_key(q)
  if not avoiding then return end
  local all, seen = redis.call('HGETALL', avoiding), {}
  for i = 1, #all, 2 do
    if string.find(' ' .. all[i + 1] .. ' ', ' ' .. flow .. ' ', 1, true) then
      local g = entry_group(s, all[i], 'default')
      if g and not seen[g] then
        seen[g] = true
        free_avoided_group(q, s, flow, g)
      end
    end
  end
end

local function fetch_grouped(q, s, flow, count, mode, default_group, lim, out)
  local avoiding = avoid_key(q)  -- entries this flow must not get: looked past
  local scan = math.max(count * 4, 64) + (avoiding and redis.call('HLEN', avoiding) or 0)
  local held = held_entries(s, scan)
  local groups, gheld = k_queue_groups(q), k_queue_group_held(q)
  local taken = 0
  local blocked = {}  -- groups with an entry this flow avoids: their later ones wait too
  for _, e in ipairs(held) do
    if taken >= count then break end
    local id = e[1]
    local g = mode and entry_group(s, id, mode, default_group)
    if g and blocked[g] then
      -- it waits, in its group's order, behind an entry another flow is to take
    elseif avoided(avoiding, id, flow) then
      if g then
        blocked[g] = true
        if mode == 'default' then free_avoided_group(q, s, flow, g) end
      end
    else
      local owner = g and redis.call('HGET', groups, g)
      if not g or not owner or owner == flow then
        local c = redis.call('XCLAIM', s, GROUP, flow, 0, id, 'RETRYCOUNT', e[4] + 1)
        local blob = c[1] and deliverable(q, s, id, c[1][2], e[4] + 1, lim)
        if c[1] and not blob then out[2] = out[2] + 1 end
        if blob then
          if g then
            redis.call('HSET', groups, g, flow)
            if mode == 'shared' then redis.call('HINCRBY', gheld, g, 1) end
          end
          out[#out + 1] = id
          out[#out + 1] = e[4] + 1
          out[#out + 1] = blob
          out[#out + 1] = entry_meta(c[1][2])
          taken = taken + 1
        end
      end
    end
  end
  -- every entry looked at is another's, and more wait: the flow looks again soon (see
  -- flows.py), as one of its own may come in reach as the others take theirs or expire
  if taken == 0 and #held == scan and out[2] == 0 then out[1] = 'starved' end
end

-- Take entry `id` for `flow` if it waits in the holding consumer (else another flow took it
-- or it is gone): into `out` as gw_fetch replies, or dead-lettered (counted in out[2]).
-- Returns the entry's fields when it was taken.
local function take_held(q, s, flow, id, lim, out, avoiding)
  if avoided(avoiding, id, flow) then return false end
  local p = redis.call('XPENDING', s, GROUP, id, id, 1, HOLDING)
  if #p == 0 then return false end
  local n = p[1][4] + 1
  local c = redis.call('XCLAIM', s, GROUP, flow, 0, id, 'RETRYCOUNT', n)
  if not c[1] then return false end
  local blob = deliverable(q, s, id, c[1][2], n, lim)
  if blob then
    out[#out + 1] = id
    out[#out + 1] = n
    out[#out + 1] = blob
    out[#out + 1] = entry_meta(c[1][2])
  else
    out[2] = out[2] + 1
  end
  return c[1][2]
end

-- Sorted queues: the lowest waiting entries in the index, taken for `flow` (O(log n) each).
local function fetch_sorted(q, s, flow, count, lim, out)
  admit_sorted(q)  -- entries another writer added since the last spool
  local idx = k_queue_sorted(q)
  local avoiding, avoided_members = avoid_key(q), {}
  local want = count
  while want > 0 do
    local members = redis.call('ZRANGE', idx, '-', '+', 'BYLEX', 'LIMIT', 0, want)
    if #members == 0 then break end
    redis.call('ZREM', idx, unpack(members))
    for _, m in ipairs(members) do
      if avoided(avoiding, member_id(m), flow) then
        avoided_members[#avoided_members + 1] = m  -- back in the index below, for others
      else
        take_held(q, s, flow, member_id(m), lim, out)
      end
    end
    want = count - (#out - 2) / 4 - out[2]
  end
  for _, m in ipairs(avoided_members) do redis.call('ZADD', idx, 0, m) end
end

-- Returned entries (oldest first) and then new ones of one stream, into `out`; each id is
-- prefixed with `prefix` (a priority queue's level) so the settlement finds its stream.
-- A plain entry (only its blob, 'm') on a queue without max_redelivery needs no checks.
local function fetch_stream(q, s, flow, count, lim, out, prefix)
  local o = #out
  local unlimited = lim.max_redelivery == 0
  local function add(id, n, fields)
    if fields and fields[3] == nil and fields[1] == 'm' and (unlimited or n == 1) then
      out[o + 1] = prefix == '' and id or prefix .. id
      out[o + 2] = n
      out[o + 3] = fields[2]
      out[o + 4] = ''
      o = o + 4
      return
    end
    local blob = deliverable(q, s, id, fields, n, lim)
    if blob then
      out[o + 1] = prefix == '' and id or prefix .. id
      out[o + 2] = n
      out[o + 3] = blob
      out[o + 4] = entry_meta(fields)
      o = o + 4
    else
      out[2] = out[2] + 1
    end
  end
  local avoiding = avoid_key(q)  -- returned entries this flow must not get: left for others
  local scan = avoiding and count + redis.call('HLEN', avoiding) or count
  local ids, counts = {}, {}
  for _, e in ipairs(redis.call('XPENDING', s, GROUP, '-', '+', scan, RETURNED)) do
    if #ids < count and not avoided(avoiding, e[1], flow) then
      ids[#ids + 1] = e[1]
      counts[e[1]] = e[4]
    end
  end
  if #ids > 0 then
    for _, e in ipairs(redis.call('XCLAIM', s, GROUP, flow, 0, unpack(ids))) do
      if e then add(e[1], counts[e[1]] + 1, e[2]) end
    end
  end
  local want = count - #ids
  if want > 0 then
    local r = redis.call('XREADGROUP', 'GROUP', GROUP, flow, 'COUNT', want, 'STREAMS', s, '>')
    if r then
      for _, e in ipairs(r[1][2]) do add(e[1], 1, e[2]) end
    end
  end
end

register_always('gw_fetch', function(_, a)
  local q, flow, count, fence = a[1], a[2], tonumber(a[3]), a[4]
  local c = redis.call('HMGET', k_queue_config(q), 'egress', 'access', 'message_groups',
    'default_group', 'selective', 'priorities', 'sort_key', 'max_redelivery', 'respect_ttl')
  if not c[1] then return { 'noqueue' } end
  if c[1] ~= '1' then return { 'egress' } end
  if not redis.call('ZSCORE', k_queue_flows(q), flow) then return { 'noflow' } end
  if c[2] == 'exclusive' then
    local l = redis.call('HMGET', k_queue_lease(q), 'flow', 'fence')
    if l[1] ~= flow or l[2] ~= fence then return { 'notowner' } end
  end
  local s = k_queue_stream(q)
  local lim = fetch_limits(c[8], c[9])
  local out = { 'ok', 0 }
  if c[7] and c[7] ~= '' then
    fetch_sorted(q, s, flow, count, lim, out)
    return out
  end
  if (c[3] and c[3] ~= '') or c[5] == '1' then
    fetch_grouped(q, s, flow, count, c[3] ~= '' and c[3], c[4], lim, out)
    return out
  end
  if c[6] == '1' then  -- a priority queue: highest level first, FIFO within a level
    for p = PRIORITY_LEVELS - 1, 0, -1 do
      local want = count - (#out - 2) / 4 - out[2]
      if want <= 0 then break end
      local child = priority_queue(q, p)
      fetch_stream(child, k_queue_stream(child), flow, want, lim, out, p .. '/')
    end
    return out
  end
  fetch_stream(q, s, flow, count, lim, out, '')
  return out
end)

-- ARGV: queue (a partition's, or a priority queue's parent), flow, then the entry ids its
-- node knows the flow holds (a priority level's as 'level/id'; the node sends this after
-- every settlement it sent before, so what it settled is gone). Everything
-- else the flow holds there, as gw_fetch answers and in its order (a sorted queue's: by
-- key): what a fetch took whose answer was lost with its connection, so the node hands it
-- out instead of unbinding the flow (which would redeliver its unsettled messages to other
-- consumers and give up its lease or partitions). Dead-lettering was the fetch's: only
-- what it handed out is here.
register_always('gw_recover', function(_, a)
  local q, flow = a[1], a[2]
  local c = redis.call('HMGET', k_queue_config(q), 'egress', 'priorities', 'sort_key')
  if not c[1] then return { 'noqueue' } end
  if not redis.call('ZSCORE', k_queue_flows(q), flow) then return { 'noflow' } end
  local known = {}
  for i = 3, #a do known[a[i]] = true end
  local found = {}  -- {id as answered, delivery count, entry fields, order}
  local function held(s, prefix)
    local start = '-'
    while true do
      local page = redis.call('XPENDING', s, GROUP, start, '+', 1000, flow)
      for _, e in ipairs(page) do
        local id = prefix .. e[1]
        if not known[id] then
          local r = redis.call('XRANGE', s, e[1], e[1])
          if r[1] and entry_blob(r[1][2]) then
            local order = c[3] and c[3] ~= '' and sort_member(e[1], entry_field(r[1][2], 'sk'))
            found[#found + 1] = { id, e[4], r[1][2], order or #found }
          end
        end
      end
      if #page < 1000 then return end
      start = '(' .. page[#page][1]
    end
  end
  if c[2] == '1' then
    for p = PRIORITY_LEVELS - 1, 0, -1 do held(k_queue_stream(priority_queue(q, p)), p .. '/') end
  else
    held(k_queue_stream(q), '')
  end
  if c[3] and c[3] ~= '' then
    table.sort(found, function(x, y) return x[4] < y[4] end)
  end
  local out = { 'ok', 0 }
  for _, f in ipairs(found) do
    local o = #out
    out[o + 1], out[o + 2], out[o + 3], out[o + 4] = f[1], f[2], entry_blob(f[3]), entry_meta(f[3])
  end
  return out
end)

-- A sorted queue's `scan` lowest waiting entries, as held_entries gives them.
local function sorted_waiting(q, s, scan)
  admit_sorted(q)
  local idx = k_queue_sorted(q)
  local out = {}
  for _, m in ipairs(redis.call('ZRANGE', idx, '-', '+', 'BYLEX', 'LIMIT', 0, scan)) do
    local id = member_id(m)
    local p = redis.call('XPENDING', s, GROUP, id, id, 1, HOLDING)
    if #p == 1 then out[#out + 1] = p[1] else redis.call('ZREM', idx, m) end
  end
  return out
end

-- ARGV: queue, flow, scan, then "id count" of entries the flow judged at that delivery
-- count. The oldest `scan` messages waiting for a selector flow (on a sorted queue, the
-- lowest): {'ok', id, delivery count so far (as gw_fetch's), blob, ...}, the blob '' of
-- one judged at the count it has.
register_always('gw_peek', function(_, a)
  local q, flow, scan = a[1], a[2], tonumber(a[3])
  local judged = {}
  for i = 4, #a do
    local id, count = string.match(a[i], '^(%S+) (%S+)$')
    if id then judged[id] = count end
  end
  local c = redis.call('HMGET', k_queue_config(q), 'egress')
  if not c[1] then return { 'noqueue' } end
  if c[1] ~= '1' then return { 'egress' } end
  if not redis.call('ZSCORE', k_queue_flows(q), flow) then return { 'noflow' } end
  local s = k_queue_stream(q)
  local now = now_ms()
  local out = { 'ok' }
  local avoiding = avoid_key(q)
  local waiting = sort_key(q) and sorted_waiting(q, s, scan) or held_entries(s, scan)
  for _, e in ipairs(waiting) do
    local r = not avoided(avoiding, e[1], flow) and redis.call('XRANGE', s, e[1], e[1]) or {}
    if #r > 0 then
      local x = tonumber(entry_field(r[1][2], 'x'))
      if x and x <= now then
        redis.call('XCLAIM', s, GROUP, flow, 0, e[1], 'JUSTID')
        unindex(q, e[1], r[1][2])
        dead_letter(q, s, e[1], entry_blob(r[1][2]), 'expired',
          redis.call('HGET', k_queue_config(q), 'respect_ttl') == '1')
      else
        out[#out + 1] = e[1]
        out[#out + 1] = e[4]
        out[#out + 1] = judged[e[1]] == tostring(e[4]) and '' or entry_blob(r[1][2])
      end
    end
  end
  return out
end)

-- ARGV: queue, flow, ids... Takes the given entries if they are still waiting (another
-- flow may have taken one since the peek). Same reply as gw_fetch.
register_always('gw_take', function(_, a)
  local q, flow = a[1], a[2]
  if not redis.call('ZSCORE', k_queue_flows(q), flow) then return { 'noflow' } end
  local s = k_queue_stream(q)
  local c = redis.call('HMGET', k_queue_config(q), 'max_redelivery', 'respect_ttl')
  local lim = fetch_limits(c[1], c[2])
  local out = { 'ok', 0 }
  local avoiding = avoid_key(q)
  for i = 3, #a do
    local fields = take_held(q, s, flow, a[i], lim, out, avoiding)
    if fields then unindex(q, a[i], fields) end
  end
  return out
end)

-- One entry as a browser sees it, appended to `out` as id, blob, meta (as gw_fetch's):
-- blob '' when it is not on the queue (gone, settled, expired: meta ''), or held until a
-- delivery time (meta: that time, epoch ms; the browser asks for it again then).
local function browsed(out, id, fields, shown, now)
  out[#out + 1] = id
  local x = fields and tonumber(entry_field(fields, 'x'))
  if not fields or not shown or (x and x <= now) then
    out[#out + 1] = ''
    out[#out + 1] = ''
    return
  end
  local h = entry_field(fields, 'h')
  if h and tonumber(h) > now then
    out[#out + 1] = ''
    out[#out + 1] = h
    return
  end
  out[#out + 1] = entry_blob(fields)
  out[#out + 1] = entry_meta(fields)
end

-- Entries a browser saw held, asked for again once due (ARGV from `first` on): appended
-- as `browsed` gives them, after their count.
local function browse_again(out, s, a, first, now, kept, last)
  out[#out + 1] = #a - first + 1
  for i = first, #a do
    local id = a[i]
    local e = redis.call('XRANGE', s, id, id)
    local shown = true
    if e[1] and kept and last and not id_less(last, id) then  -- as in gw_browse
      shown = #redis.call('XPENDING', s, GROUP, id, id, 1) == 1
    end
    browsed(out, id, e[1] and e[1][2], shown, now)
  end
end

-- ARGV: queue, flow (a consumer of a non-destructive queue, registered by gw_bind; '' for
-- a browser of another queue, registered nowhere), cursor (an entry id; sorted: an index
-- member), count, since (epoch ms: replay period start, or 0), arrivals (sorted: the last
-- stream entry id seen arrive, '' at first; else ''), created (the created_ms of the queue
-- it bound to, or ''), then the ids of entries this browser saw held that are due now.
-- Browsing: up to `count` messages on the queue after `cursor`, oldest first, without
-- taking them: {'ok', n, the n entries asked for again, then the page: id, blob, meta,
-- ...} (see `browsed`). Settled entries kept for stream readers and expired entries are
-- not shown; held ones are shown once due. {'noqueue'} when the queue is gone, or is
-- another one made under its name. {'partitioned'} when the queue has partitions
-- now (browsers are refused on those). {'noflow'} when the flow is no longer
-- registered (its node was presumed dead): it binds again, or the last consumer of an
-- auto-delete queue to go would delete it while this one browses.
-- A sorted queue is browsed in its order, over the entries waiting on it (those delivered
-- and not yet settled are not shown): {'sorted', arrivals, behind (1: more may have
-- arrived), n, the n asked for again, m, the m late ones, then the page}, the late and
-- the page's entries named by their index members. Late ones arrived since `arrivals`
-- (`count` of the arrivals looked at a call) with a key sorting before the cursor:
-- the browser sees them though it has passed their place, as Qpid's sorted queue moves
-- its browsers back. The page shows only entries looked at as arrivals, so none is both.
local function browse_sorted(q, s, cursor, count, since, a)
  admit_sorted(q)
  local idx = k_queue_sorted(q)
  local now = now_ms()
  local function shown(id) return not (since > 0 and id_less(id, since .. '-0')) end
  local arrivals, behind = a[6], 0
  local late = {}
  if arrivals == '' then  -- what is stored now, the pages show
    local newest = redis.call('XREVRANGE', s, '+', '-', 'COUNT', 1)[1]
    arrivals = newest and newest[1] or '0-0'
  else
    local arrived = redis.call('XRANGE', s, '(' .. arrivals, '+', 'COUNT', count)
    if #arrived == count then behind = 1 end  -- more may have arrived
    for _, e in ipairs(arrived) do
      arrivals = e[1]
      local m = sort_member(e[1], entry_field(e[2], 'sk'))
      -- waiting, before the cursor (in the index's byte order: Lua's `<` follows the locale)
      if cursor ~= '0-0'
        and redis.call('ZRANGE', idx, '[' .. m, '(' .. cursor, 'BYLEX', 'LIMIT', 0, 1)[1] == m
      then
        late[#late + 1] = { m, e }
      end
    end
  end
  local out = { 'sorted', arrivals, behind }
  browse_again(out, s, a, 8, now)
  out[#out + 1] = #late
  for _, l in ipairs(late) do browsed(out, l[1], l[2][2], shown(l[2][1]), now) end
  local start = cursor == '0-0' and '-' or '(' .. cursor
  for _, m in ipairs(redis.call('ZRANGE', idx, start, '+', 'BYLEX', 'LIMIT', 0, count)) do
    local id = member_id(m)
    if not id_less(arrivals, id) then  -- one not looked at as an arrival yet is left to
      local e = redis.call('XRANGE', s, id, id)  -- that: late then, if the cursor passed it
      browsed(out, m, e[1] and e[1][2], shown(id), now)
    end
  end
  return out
end

register_always('gw_browse', function(_, a)
  local q, flow, cursor, count, since = a[1], a[2], a[3], tonumber(a[4]), tonumber(a[5])
  local c = redis.call('HMGET', k_queue_config(q), 'egress', 'sort_key', 'parent',
    'partition_count', 'created_ms')
  -- made again under its name since it bound (its deletion's event lost): not the queue
  -- its access was checked for
  if not c[1] or c[3] or (a[7] ~= '' and a[7] ~= c[5]) then return { 'noqueue' } end
  if c[1] ~= '1' then return { 'egress' } end
  -- repartitioned since it bound (gw_repartition unbinds only the flows registered): ended
  -- as a new browser would be refused, not left reading the parent's empty stream
  if (tonumber(c[4]) or 0) > 0 then return { 'partitioned' } end
  if flow ~= '' and not redis.call('ZSCORE', k_queue_flows(q), flow) then
    return { 'noflow' }
  end
  local s = k_queue_stream(q)
  if c[2] and c[2] ~= '' then return browse_sorted(q, s, cursor, count, since, a) end
  if since > 0 and id_less(cursor, since .. '-0') then cursor = since .. '-0' end
  -- acked entries stream readers keep, or kept before the last of them was forgotten
  local kept = redis.call('EXISTS', k_queue_readers(q), k_queue_kept(q)) > 0
  local last = kept and last_delivered(s)
  local now = now_ms()
  local out = { 'ok' }
  browse_again(out, s, a, 8, now, kept, last)
  local start = '(' .. cursor
  if cursor == '0-0' then start = '-' end
  local entries = redis.call('XRANGE', s, start, '+', 'COUNT', count)
  for _, e in ipairs(entries) do
    local on_queue = true
    if kept and last and not id_less(last, e[1]) then  -- delivered: on the queue if unsettled
      on_queue = #redis.call('XPENDING', s, GROUP, e[1], e[1], 1) == 1
    end
    browsed(out, e[1], e[2], on_queue, now)  -- the cursor moves past it, shown or not
  end
  return out
end)

-- The size of a settlement group's j-th entry: its sizes come as one binary argument of
-- little-endian uint32s, read only when the entries are settled one by one.
local function size_at(sizes, j)
  return (struct.unpack('<I4', sizes, 4 * j - 3))
end

-- Acks for entries of one flow in one XACK, the common case. If some were settled before
-- (the count comes back short), deleting them one by one tells which were still there.
local function ack_batch(q, s, a, first, n, bytes, sizes)
  local last = first + n - 1
  local acked
  forget_last_values(q, s, a, first, last)
  if redis.call('EXISTS', k_queue_readers(q)) == 1 then
    -- kept for stream readers: acked one by one, so the bytes count only the acked ones
    acked, bytes = 0, 0
    for i = first, last do
      if redis.call('XACK', s, GROUP, a[i]) == 1 then
        acked = acked + 1
        bytes = bytes + size_at(sizes, i - first + 1)
      end
    end
  else
    acked = ids_call('XACK', s, a, first, last)
    if acked < n then
      acked, bytes = 0, 0
      for i = first, last do
        if redis.call('XDEL', s, a[i]) == 1 then
          acked = acked + 1
          bytes = bytes + size_at(sizes, i - first + 1)
        end
      end
    else
      drop_acked(q, s, a, first, last)
    end
  end
  if acked > 0 then
    account(q, -acked, -bytes)
    redis.call('HINCRBY', k_queue_stats(q), 'acked', acked)
  end
  return acked
end

-- Of entries a flow gives back with a failed delivery, those that had their last delivery
-- max_redelivery allows go to the dead message queue now, as RabbitMQ's delivery-limit
-- does on return (they stayed, counted toward the queue's limits, until a fetch reached
-- them: none, when their only consumer gave up). Returns the rest.
local function dead_letter_exhausted(q, s, flow, ids)
  local max = tonumber(redis.call('HGET', k_queue_config(q), 'max_redelivery')) or 0
  if max <= 0 then return ids end
  local rest = {}
  for _, id in ipairs(ids) do
    local p = redis.call('XPENDING', s, GROUP, id, id, 1, flow)[1]
    local e = p and deliveries(p[4]) > max and redis.call('XRANGE', s, id, id)[1]
    if e then
      unindex(q, id, e[2])
      dead_letter(q, s, id, entry_blob(e[2]) or '', 'max_redelivered', true)
    else
      rest[#rest + 1] = id
    end
  end
  return rest
end

-- Settle entries a flow holds. ARGV: mode ('ack' | 'reject' | 'requeue' | 'release': a
-- requeue whose delivery does not count toward max_redelivery | 'unsent': a release of
-- entries that never reached the client, not even marked acquired | 'avoid',
-- 'avoid_failed': a release, a requeue, and the flow does not get the entries again),
-- then groups of
-- queue, flow, n, their total size, their sizes (n little-endian uint32s in one argument),
-- then n entry ids. A flow that is no longer bound (released after its node was presumed
-- dead: its entries went back to the queue) settles nothing; entries it no longer holds
-- (settled already: a settlement may be sent again after its reply was lost) are skipped.
-- Returns the count settled.
register_always('gw_settle', function(_, a)
  local mode = a[1]
  local pos, total = 2, 0
  while pos <= #a do
    local q, flow, n = a[pos], a[pos + 1], tonumber(a[pos + 2])
    local bytes_total, sizes = tonumber(a[pos + 3]), a[pos + 4]
    local s = k_queue_stream(q)
    local first = pos + 5
    pos = first + n
    if n > 0 and redis.call('ZSCORE', k_queue_flows(q), flow) then
      local gmode = group_mode(q)
      local shared = gmode == 'shared'
      local default_group = shared and redis.call('HGET', k_queue_config(q), 'default_group')
      local mine, bytes, freed, woken = {}, 0, false, false
      local each = first
      if mode == 'ack' and not shared then
        total = total + ack_batch(q, s, a, first, n, bytes_total, sizes)
        each = pos  -- all settled in the batch
      end
      for i = each, pos - 1 do
        local id = a[i]
        local g = shared and entry_group(s, id, gmode, default_group)
        local settled
        if mode == 'ack' then
          settled = redis.call('XACK', s, GROUP, id) == 1
          if settled then bytes = bytes + size_at(sizes, i - first + 1) end
        elseif mode == 'reject' then  -- to the dead message queue, or discarded
          local e = redis.call('XRANGE', s, id, id)
          settled = #e > 0 and #redis.call('XPENDING', s, GROUP, id, id, 1, flow) == 1
          if settled then dead_letter(q, s, id, entry_blob(e[1][2]), 'rejected', true) end
        else  -- back to the queue, if the flow still holds it: a settlement sent again after
          -- its reply was lost must not take the entry from a consumer that got it since
          settled = #redis.call('XPENDING', s, GROUP, id, id, 1, flow) == 1
        end
        if settled then
          total = total + 1
          if mode ~= 'reject' then mine[#mine + 1] = id end
          if g and redis.call('HINCRBY', k_queue_group_held(q), g, -1) <= 0 then
            redis.call('HDEL', k_queue_group_held(q), g)  -- the group is free again
            redis.call('HDEL', k_queue_groups(q), g)
            freed = true  -- what waits for it may go to another consumer
          end
        end
      end
      if #mine > 0 then
        if mode ~= 'ack' then  -- back to the queue: requeue, release, avoid, avoid_failed
          local uncount = (mode == 'release' or mode == 'avoid') and 'release'
          if mode == 'requeue' or mode == 'avoid_failed' then
            mine = dead_letter_exhausted(q, s, flow, mine)
          end
          if #mine > 0 then
            if mode == 'avoid' or mode == 'avoid_failed' then avoid(q, mine, flow) end
            park(q, s, mine, uncount or (mode == 'unsent' and 'unsent'))
            redis.call('HINCRBY', k_queue_stats(q), 'requeued', #mine)
            wake(q)
            woken = true
          end
        else
          forget_last_values(q, s, mine, 1, #mine)
          -- a queue with stream readers (the Spark source) keeps settled entries until
          -- every reader passed them (gw_reap trims); otherwise they go at once
          if redis.call('EXISTS', k_queue_readers(q)) == 0 then
            drop_acked(q, s, mine, 1, #mine)
          end
          account(q, -#mine, -bytes)
          redis.call('HINCRBY', k_queue_stats(q), 'acked', #mine)
        end
      end
      local avoiding = (mode == 'ack' or mode == 'reject') and avoid_key(q)
      if avoiding then  -- settled for good: no flow to avoid any more
        for from = first, pos - 1, IDS_PER_CALL do
          redis.call('HDEL', avoiding, unpack(a, from, math.min(pos - 1, from + IDS_PER_CALL - 1)))
        end
      end
      if freed and not woken then wake(q) end  -- what waited for its group may go now
      if gmode == 'default' then free_groups_avoided_by(q, s, flow) end  -- any settle
    end
  end
  return total
end)

-- A queue turning selective parks unsettled entries in the holding consumer from now on:
-- those already back in the returned consumer move there too, or no fetch would see them.
local function adopt_returned(q)
  local s = k_queue_stream(q)
  while true do
    local p = redis.call('XPENDING', s, GROUP, '-', '+', IDS_PER_CALL, RETURNED)
    if #p == 0 then return waiting_again(q) end
    local ids = {}
    for i, e in ipairs(p) do ids[i] = e[1] end
    claim_justid(s, HOLDING, ids)
  end
end

-- ARGV: queue, flow, node, mode ('' | 'select': the flow has a selector | 'browse'), the
-- queue's created_ms the flow bound to before ('' at its first bind): a flow binding again
-- (its node presumed dead a while) binds only to that queue, not to one made again under
-- its name, whose access it was never checked for.
-- Registers a flow; bind order decides exclusive standby order. A selector makes the queue
-- selective: new messages wait in the holding consumer until a flow whose selector matches
-- takes them. Browsers take nothing and are no consumers: not registered (bind sequence
-- 0). Every consumer of a non-destructive queue browses, and is one: registered, so that
-- the last of them to go, on any node, deletes an auto-delete queue (release_flow).
-- Returns {'ok', bind sequence, access type, partition count, rebalance delay ms, mode,
-- 1 for a priority queue, created_ms, max_delivered_unacked_msgs_per_flow} or {'noqueue'} / {'egress'} / {'partitioned'} / {'grouped'} /
-- {'prioritised'}.
register_always('gw_bind', function(_, a)
  local q, flow, node, mode = a[1], a[2], a[3], a[4]
  local c = redis.call('HMGET', k_queue_config(q), 'egress', 'access', 'partition_count',
    'partition_rebalance_delay_ms', 'message_groups', 'non_destructive', 'parent', 'created_ms',
    'max_delivered_unacked_msgs_per_flow')
  local created = c[8] or ''
  local per_flow = tonumber(c[9]) or 0  -- 0: the node's default (a queue made before it)
  if not c[1] or c[7] or (a[5] and a[5] ~= '' and a[5] ~= created) then return { 'noqueue' } end
  if c[1] ~= '1' then return { 'egress' } end
  if c[6] == '1' then mode = 'browse' end  -- every consumer of it browses
  if mode ~= '' and (tonumber(c[3]) or 0) > 0 then return { 'partitioned' } end
  local prioritised = redis.call('HGET', k_queue_config(q), 'priorities') == '1'
  if mode ~= '' and prioritised then return { 'prioritised' } end
  if mode == 'browse' and c[6] ~= '1' then
    return { 'ok', 0, c[2], 0, 0, 'browse', 0, created, per_flow }
  end
  if mode == 'select' then
    if c[5] and c[5] ~= '' then return { 'grouped' } end
    if redis.call('HGET', k_queue_config(q), 'selective') ~= '1' then
      redis.call('HSET', k_queue_config(q), 'selective', '1')
      adopt_returned(q)
    end
  end
  local seq = redis.call('INCR', K_SEQ)
  local added = redis.call('ZADD', k_queue_flows(q), seq, flow) == 1
  redis.call('SADD', k_node_queues(node), q)
  count_flow(q, node, added)
  if prioritised then  -- it settles on the levels' streams
    for _, child in ipairs(children(q)) do redis.call('ZADD', k_queue_flows(child), seq, flow) end
  end
  return { 'ok', seq, c[2], tonumber(c[3]) or 0, tonumber(c[4]) or 0, mode,
    prioritised and 1 or 0, created, per_flow }
end)

-- ARGV: queue, flow. Unbinds a flow; its unacked messages go back for redelivery. A flow
-- not bound (released already, or a bind whose reply was lost never ran) changes nothing:
-- above all, it is no last consumer of an auto-delete queue.
register_always('gw_unbind', function(_, a)
  if not redis.call('ZSCORE', k_queue_flows(a[1]), a[2]) then return 0 end
  return release_flow(a[1], a[2])
end)

-- ARGV: queue. Exclusive access: the earliest-bound flow on a live node is active. Dead
-- nodes' flows met on the way are released first, so their messages are redelivered in order.
-- Returns {fence, active flow, every bound flow...} or {0, ''} with no live flow.
register_always('gw_lease', function(_, a)
  local q = a[1]
  local active = false
  local live = {}
  for _, flow in ipairs(redis.call('ZRANGE', k_queue_flows(q), 0, -1)) do
    if active or node_alive(node_of(flow)) then
      active = active or flow
      live[#live + 1] = flow
    else
      release_flow(q, flow)
    end
  end
  local lease = k_queue_lease(q)
  if not active then
    redis.call('DEL', lease)
    return { 0, '' }
  end
  local cur = redis.call('HMGET', lease, 'flow', 'fence')
  local fence = tonumber(cur[2])
  if cur[1] ~= active then
    fence = redis.call('INCR', K_SEQ)
    redis.call('HSET', lease, 'flow', active, 'fence', fence)
    redis.call('PUBLISH', K_EVENTS, 'lease ' .. q)
  end
  local out = { fence, active }
  for _, flow in ipairs(live) do out[#out + 1] = flow end
  return out
end)

-- ARGV: node, ttl_ms. Registers a node and its liveness key.
register_always('gw_node_up', function(_, a)
  local now, last = now_ms(), redis.call('HMGET', K_LIVENESS, 't', 'ttl')
  if last[1] and now - tonumber(last[1]) > tonumber(last[2]) then  -- see node_alive
    redis.call('SET', K_LIVENESS_GRACE, '1', 'PX', 2 * tonumber(a[2]))
  end
  redis.call('HSET', K_LIVENESS, 't', now, 'ttl', a[2])
  redis.call('SADD', K_NODES, a[1])
  redis.call('SET', k_node_alive(a[1]), '1', 'PX', a[2])
  return 1
end)

-- ARGV: node, 1 or 0: whether it has direct (not spooled) subscribers now.
register_always('gw_direct_node', function(_, a)
  if a[2] == '1' then return redis.call('SADD', K_DIRECT_NODES, a[1]) end
  return redis.call('SREM', K_DIRECT_NODES, a[1])
end)

-- ARGV: queue, reader, entry id, 1 to keep a place the reader already has[, the stream's
-- max-deleted-entry-id when the reader's query began at this place]. A (Spark) reader's
-- place in a queue it reads without taking: entries stay until every reader is past them
-- and they are settled. The max-deleted id is noted (k_queue_reader_baselines) when this
-- call gives the reader its place: holes made before then were never its to read, and a
-- restart from a checkpoint must not report them as data loss.
register_always('gw_reader_at', function(_, a)
  local added
  if a[4] == '1' then
    added = redis.call('HSETNX', k_queue_readers(a[1]), a[2], a[3])
  else
    added = redis.call('HSET', k_queue_readers(a[1]), a[2], a[3])
  end
  if added == 1 and a[5] then
    redis.call('HSET', k_queue_reader_baselines(a[1]), a[2], a[5])
  elseif added == 1 then  -- a place taken later, or anew: every deletion past it counts
    redis.call('HDEL', k_queue_reader_baselines(a[1]), a[2])
  end
  return redis.call('SADD', K_READ_QUEUES, a[1])
end)

-- ARGV: queue, reader. Forgets the reader's place; returns 1 if it had one (0 if not).
-- With the last one gone, the acked entries the readers kept go with later acks
-- (k_queue_kept: up to the last delivered entry, see drop_acked).
register_always('gw_forget_reader', function(_, a)
  local readers = k_queue_readers(a[1])
  local removed = redis.call('HDEL', readers, a[2])
  redis.call('HDEL', k_queue_reader_baselines(a[1]), a[2])
  if redis.call('HLEN', readers) == 0 then
    redis.call('SREM', K_READ_QUEUES, a[1])
    local s = k_queue_stream(a[1])
    if removed == 1 and redis.call('EXISTS', s) == 1 then
      redis.call('SET', k_queue_kept(a[1]), last_delivered(s))
    end
  end
  return removed
end)

-- The spool totals, quotas, raised alarms and alarm event counts, as one snapshot.
register_always('gw_spool_report', function()
  local alarms = redis.call('HGETALL', K_SPOOL_ALARMS)
  local counts = redis.call('HGETALL', K_SPOOL_ALARM_COUNTS)
  -- the queue scopes with an alarm or events: name, bytes stored, quota (none of a hidden
  -- child's, which an earlier release kept)
  local seen, queues = {}, {}
  local function add(scope)
    local q = string.match(scope, '^queue:(.*)$')
    if q and not seen[q] and redis.call('HEXISTS', k_queue_config(q), 'parent') == 0 then
      seen[q] = true
      local quota = redis.call('HGET', k_queue_config(q), 'max_spool_bytes') or '0'
      queues[#queues + 1] = q
      queues[#queues + 1] = tostring(queue_bytes(q))
      queues[#queues + 1] = quota
    end
  end
  for i = 1, #alarms, 2 do add(alarms[i]) end
  for i = 1, #counts, 2 do add(string.match(counts[i], '^%a+:(.*)$') or '') end
  return {
    redis.call('HGETALL', K_SPOOL_USAGE), redis.call('HGETALL', K_SPOOL_LIMITS),
    alarms, counts, queues,
  }
end, 'no-writes')

-- Claims are numbers from the node-wide counter, so they are ordered.
-- KEYS: a client's claims hash. ARGV: node, client id (hex), the user the connection acts
-- as. A connection claims its client id: returns
-- {claim, the holder before it ("node claim") when that was a connection on another live
-- node, else false}. The new connection waits for that one's teardown, which saves what
-- the session needs next, before it reads the state (gw_client_load).
local CLAIMS_TTL = 86400  -- renewed with a connected session's lease (gw_client_expire)

register_always('gw_claim', function(k, a)
  local claim = redis.call('INCR', K_SEQ)
  local before = redis.call('HGET', k[1], 'holder')
  if redis.call('EXISTS', k[1]) == 0 then  -- none for UNCLAIMED_TTL: what older connections
    redis.call('HSET', k[1], 'fresh', claim)  -- still hold marks nothing (gw_spool_marked)
  end
  redis.call('HSET', k[1], 'holder', a[1] .. ' ' .. claim, 'last', claim, 'user', a[3] or '')
  redis.call('EXPIRE', k[1], CLAIMS_TTL)
  if before then
    local node = string.match(before, '^(%S+) ')
    -- the session is this connection's now: the reap of that one's node leaves it be
    redis.call('HDEL', k_node_sessions(node), a[2])
    -- the key itself: a connection does not wait ~15 s for a handover from a node counted
    -- alive only for want of judging (see node_alive), e.g. a lone node's crashed self
    if node == a[1] or redis.call('EXISTS', k_node_alive(node)) == 0 then before = false end
  end
  return { claim, before or false }
end)

-- KEYS: a client's claims hash. ARGV: "node claim", the client id (hex). The connection
-- ended: while no newer one claimed the client, it is no longer held, and the hash goes
-- once an older connection still tearing down could no longer save (its 'loaded' refuses
-- that until then). Its node no longer holds the session, unless a newer connection there
-- does.
local UNCLAIMED_TTL = 120

register_always('gw_unclaim', function(k, a)
  local holder = redis.call('HGET', k[1], 'holder')
  if holder == a[1] then
    redis.call('HDEL', k[1], 'holder')
    redis.call('EXPIRE', k[1], UNCLAIMED_TTL)
  end
  local node = string.match(a[1], '^(%S+) ')
  if holder == a[1] or not holder or string.match(holder, '^(%S+) ') ~= node then
    redis.call('HDEL', k_node_sessions(node), a[2])
  end
  return 1
end)

-- Parting messages (an MQTT will; see gateway/engine/parting.py). KEYS[1] holds those of
-- one client's connections, by claim: '<claim>:node', ':delay' (ms), ':due' (epoch ms once
-- the connection ended, else 0), ':msg', and ':taken' once a node is publishing it. Node
-- sets and the due set name one as '<claim> <key>'. A live node publishes its connection's
-- only once it took it (gw_parting_own), so no other node sends it as well.

local PARTING_FIELDS = { ':node', ':delay', ':due', ':msg', ':taken' }

local function parting_fields(c)
  local fields = {}
  for i, f in ipairs(PARTING_FIELDS) do fields[i] = c .. f end
  return fields
end

local function parting(k, c)
  local r = redis.call('HMGET', k, unpack(parting_fields(c)))
  if not r[1] then return nil end
  return { node = r[1], delay = tonumber(r[2]), due = tonumber(r[3]), msg = r[4], taken = r[5] }
end

local function drop_parting(k, c, node)
  redis.call('HDEL', k, unpack(parting_fields(c)))
  redis.call('SREM', k_node_parting(node), c .. ' ' .. k)
  redis.call('ZREM', K_PARTING_DUE, c .. ' ' .. k)
end

-- Mark a record taken: due again after the lease, should its taker die before it dropped it.
local function take_parting(k, c, now, lease)
  redis.call('HSET', k, c .. ':taken', 1)
  redis.call('ZADD', K_PARTING_DUE, now + lease, c .. ' ' .. k)
end

-- What becomes of an earlier connection's record when a new connection to the session
-- comes (MQTT 5 §3.1.3.2.2): 'send' (its delay ended, its connection closed at once on a
-- node that died, or the new connection ends the session), 'drop' (it came within the
-- delay), or nil: its connection is still open on a live node, or a node publishes it.
local function parting_fate(k, c, r, node, ends, now)
  if r.taken then return nil end
  local due = tonumber(redis.call('ZSCORE', K_PARTING_DUE, c .. ' ' .. k))
  if not due and r.due > 0 then due = r.due end  -- ended: its delay runs on its node
  if due then return (due <= now or ends) and 'send' or 'drop' end
  if r.node == node or redis.call('EXISTS', k_node_alive(r.node)) == 1 then return nil end
  return (r.delay == 0 or ends) and 'send' or 'drop'  -- open when its node died
end

-- ARGV: node, claim, '1' if the connection starts afresh, delay ms, message ('': none),
-- lease ms. The connection of `claim` keeps its message; earlier connections' records are
-- settled (parting_fate): those to send now are returned as gw_parting_take returns due
-- ones, taken, to be dropped once sent.
register_always('gw_parting_hold', function(k, a)
  local now, ends, out = now_ms(), a[3] == '1', {}
  for _, f in ipairs(redis.call('HKEYS', k[1])) do
    local c = string.match(f, '^(%d+):node$')
    local r = c and parting(k[1], c)
    local fate = r and parting_fate(k[1], c, r, a[1], ends, now)
    if fate == 'send' then
      take_parting(k[1], c, now, tonumber(a[6]))
      out[#out + 1] = { k[1], c, r.msg }
    elseif fate then
      drop_parting(k[1], c, r.node)
    end
  end
  if a[5] ~= '' then
    local c = a[2]
    redis.call('HSET', k[1], c .. ':node', a[1], c .. ':delay', a[4], c .. ':due', 0,
      c .. ':msg', a[5])
    redis.call('SADD', k_node_parting(a[1]), c .. ' ' .. k[1])
  end
  return out
end)

-- ARGV: claim, due (epoch ms). The connection ended and its message waits on its node: it
-- goes at `due` should that node die first.
register_always('gw_parting_due', function(k, a)
  if redis.call('HEXISTS', k[1], a[1] .. ':node') == 1 then
    redis.call('HSET', k[1], a[1] .. ':due', a[2])
  end
  return 1
end)

-- ARGV: claim, lease ms. The node of the connection of `claim` is to publish its message:
-- {key, claim, message} as gw_parting_take returns due ones (now taken) if it is its to
-- publish, false if another connection or node settled it.
register_always('gw_parting_own', function(k, a)
  local r = parting(k[1], a[1])
  if not r or r.taken or redis.call('ZSCORE', K_PARTING_DUE, a[1] .. ' ' .. k[1]) then
    return false
  end
  take_parting(k[1], a[1], now_ms(), tonumber(a[2]))
  return { k[1], a[1], r.msg }
end)

-- ARGV: claim. The message of the connection of `claim` went, or is not to go.
register_always('gw_parting_drop', function(k, a)
  local r = parting(k[1], a[1])
  if r then drop_parting(k[1], a[1], r.node) end
  return 1
end)

-- ARGV: lease ms, limit. Due messages, as {key, claim, message} triples, taken.
register_always('gw_parting_take', function(_, a)
  local now, out = now_ms(), {}
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', K_PARTING_DUE, '-inf', now, 'LIMIT', 0, a[2])) do
    local c, k = string.match(m, '^(%d+) (.+)$')
    local r = parting(k, c)
    if r then
      take_parting(k, c, now, tonumber(a[1]))
      out[#out + 1] = { k, c, r.msg }
    else
      redis.call('ZREM', K_PARTING_DUE, m)
    end
  end
  return out
end)

-- KEYS: a client's state key, its claims hash. ARGV: the reader's claim. The stored state;
-- notes that this claim read it, so no older connection saves over it after.
register_always('gw_client_load', function(k, a)
  if tonumber(a[1]) > (tonumber(redis.call('HGET', k[2], 'loaded')) or 0) then
    redis.call('HSET', k[2], 'loaded', a[1])
    redis.call('EXPIRE', k[2], CLAIMS_TTL)
  end
  return redis.call('GET', k[1])
end)

-- KEYS: a client's state and received-ids keys, its claims hash. ARGV: the claim of a
-- connection whose session ends with it. Both keys go, unless a newer claim loaded them.
register_always('gw_client_forget', function(k, a)
  if (tonumber(redis.call('HGET', k[3], 'loaded')) or 0) > tonumber(a[1]) then return 0 end
  redis.call('DEL', k[1], k[2])
  return 1
end)

-- KEYS: a client's state and received-ids keys, its claims hash. ARGV: the claim of a
-- connection that starts a new session (none was stored, or a clean start): what an
-- ended one left goes, and the claim is kept as 'fresh', so that the marks of older
-- connections' publishes no longer count (gw_spool_marked).
register_always('gw_client_fresh', function(k, a)
  redis.call('DEL', k[1], k[2])
  if tonumber(a[1]) > (tonumber(redis.call('HGET', k[3], 'fresh')) or 0) then
    redis.call('HSET', k[3], 'fresh', a[1])
  end
end)

-- KEYS: a client's state key, its claims hash. ARGV: state, expiry in seconds (0: none),
-- the saver's claim. Refused (0) once a newer claim read the state: a connection taken
-- over does not overwrite what its successor loaded. Protocol sessions keep their state
-- while Redis is full, so clients can reconnect and drain their queues.
register_always('gw_client_save', function(k, a)
  if (tonumber(redis.call('HGET', k[2], 'loaded')) or 0) > tonumber(a[3]) then return 0 end
  if tonumber(a[2]) > 0 then
    redis.call('SET', k[1], a[1], 'EX', a[2])
  else
    redis.call('SET', k[1], a[1])
  end
  return 1
end)

-- KEYS: a client's state and received-ids keys, optionally its claims hash. ARGV: seconds
-- until the first two expire; 0 deletes them now, -1 keeps them for good (the client is
-- connected again). A connected session's claims hash lives CLAIMS_TTL more. With a node,
-- the client id (hex), the connection's claim and its session's expiry (s): that node's
-- connection holds the session, which expires that long after the node dies
-- (release_sessions).
register_always('gw_client_expire', function(k, a)
  local seconds = tonumber(a[1])
  if a[2] then redis.call('HSET', k_node_sessions(a[2]), a[3], a[4] .. ' ' .. a[5]) end
  if k[3] then
    if seconds ~= 0 and redis.call('EXISTS', k[3]) == 1 then
      redis.call('EXPIRE', k[3], CLAIMS_TTL)
    end
    k[3] = nil
  end
  for _, key in ipairs(k) do
    if seconds > 0 then
      redis.call('EXPIRE', key, seconds)
    elseif seconds == 0 then
      redis.call('DEL', key)
    else
      redis.call('PERSIST', key)
    end
  end
  return 1
end)

-- Retained messages held by a delivery delay wait in their topic's sorted set (KEYS[3]),
-- scored by the epoch ms they fall due, each member the publish order (16 hex digits, so
-- equal scores keep it) and the message ('' for a clear); KEYS[2] lists topics with some.

-- The latest held member of topic set `held` due by `now`, as its message; nil if none.
local function fallen_due(held, now)
  local m = redis.call('ZREVRANGEBYSCORE', held, now, '-inf', 'LIMIT', 0, 1)[1]
  return m and string.sub(m, 17)
end

-- KEYS: the retained-messages hash, the held topics set, the topic's held set. ARGV:
-- topic, now (epoch ms), the message ('' clears the topic), the epoch ms it is due ('' if
-- now). The topic's value is what its live subscribers heard last: a held message takes
-- it when due, not when published; one published later and due sooner goes before it.
-- What fell due is promoted first (the latest due wins), so a reader (gw_retained) takes
-- any held one due by now as newer than the value. One sorted-set step a store.
local function retain(k, a)
  local topic, now, blob, due = a[1], tonumber(a[2]), a[3], tonumber(a[4])
  local value = fallen_due(k[3], now)
  if value then redis.call('ZREMRANGEBYSCORE', k[3], '-inf', now) end
  if blob == nil then  -- a read (gw_retained): what fell due only
  elseif due and due > now then
    redis.call('ZADD', k[3], due, string.format('%016x', redis.call('INCR', K_SEQ)) .. blob)
  else
    value = blob
  end
  if value == '' then
    redis.call('HDEL', k[1], topic)
  elseif value then
    redis.call('HSET', k[1], topic, value)
  end
  if redis.call('EXISTS', k[3]) == 1 then
    redis.call('SADD', k[2], topic)
  else
    redis.call('SREM', k[2], topic)
  end
  return 1
end

-- The retained copy of a message its queues already hold (the publish was taken), or a
-- clear: completes while Redis is full. gw_retain_new (a message no queue took, new data)
-- is refused then, as a publish is.
register_always('gw_retain', retain)
redis.register_function('gw_retain_new', retain)

-- KEYS: as gw_retain's. ARGV: topic, now (epoch ms). The topic's retained message as of
-- now (nil: none), what fell due promoted first (so a topic's held set goes once all of
-- it fell due, read or not): one instant, and it frees memory, so it runs when full too.
register_always('gw_retained', function(k, a)
  retain(k, a)
  return redis.call('HGET', k[1], a[1])
end)

-- KEYS: the retained-messages hash. ARGV: topic, the retained message a reader found
-- expired. It goes unless another took its place meanwhile (MQTT 5 §3.3.2.3.3: the server
-- deletes its copy of an expired message); it frees memory, so it runs when full too.
register_always('gw_retained_expired', function(k, a)
  if redis.call('HGET', k[1], a[1]) == a[2] then redis.call('HDEL', k[1], a[1]) end
  return 1
end)

-- KEYS: a client's received-ids key; its claims hash and state key. ARGV: a message id;
-- the claim of the connection that sent it. 1 if it was new, 0 if recorded or not marked:
-- as gw_spool_marked marks, only while the session lasts (held or stored) and no newer
-- connection started a new session (a publish resolved late swallows none of its ids).
-- An older node's call names the received-ids key alone: marked as it was.
register_always('gw_client_mark', function(k, a)
  if k[2] and (tonumber(a[2]) < (tonumber(redis.call('HGET', k[2], 'fresh')) or 0) or (
      redis.call('HEXISTS', k[2], 'holder') == 0 and redis.call('EXISTS', k[3]) == 0)) then
    return 0
  end
  return redis.call('SADD', k[1], a[1])
end)

-- ARGV: node. 1 while it is not presumed dead (node_alive): a handover waits for it.
register_always('gw_node_alive', function(_, a)
  return node_alive(a[1]) and 1 or 0
end, 'no-writes')

-- ARGV: node. A clean shutdown: same clean-up as for a dead node.
register_always('gw_node_down', function(_, a)
  return reap_node(a[1])
end)

-- The heartbeat's sweep (gw_reap) and its helpers, in a block of their own: the main chunk
-- holds at most 200 locals at a time.
do
-- Trim a read queue's settled entries below every reader's committed id, never past an
-- unsettled (pending) or undelivered entry.
local function trim_read_queue(q)
  local s = k_queue_stream(q)
  local committed = redis.call('HVALS', k_queue_readers(q))
  if #committed == 0 or redis.call('EXISTS', s) == 0 then
    redis.call('SREM', K_READ_QUEUES, q)
    return 0
  end
  local floor = committed[1]
  for _, id in ipairs(committed) do
    if id_less(id, floor) then floor = id end
  end
  local pending = redis.call('XPENDING', s, GROUP)
  if pending[2] and id_less(pending[2], floor) then floor = pending[2] end
  local last = last_delivered(s)
  if id_less(last, floor) then floor = last end
  return redis.call('XTRIM', s, 'MINID', floor)
end

-- Messages whose delivery time came: back to the queue (before newer ones, in id order).
local function release_due(q, now)
  local timed = k_queue_timed(q)
  local due = redis.call('ZRANGEBYSCORE', timed, '-inf', now, 'LIMIT', 0, 1000)
  if #due > 0 then
    if redis.call('EXISTS', k_queue_config(q)) == 1 then
      park(q, k_queue_stream(q), due)
      wake(q)
    end
    redis.call('ZREM', timed, unpack(due))
  end
  local first = redis.call('ZRANGE', timed, 0, 0, 'WITHSCORES')
  if #first == 0 then
    redis.call('ZREM', K_TIMED_QUEUES, q)
  else
    redis.call('ZADD', K_TIMED_QUEUES, first[2], q)  -- due again when its first is
  end
end

-- Messages nobody takes expire too, as on Solace and RabbitMQ: the entries waiting on a
-- queue that stored some with an expiry (returned, held for a group, selector, sort order
-- or delivery time, and never delivered) go to the dead message queue (respect_ttl) or are
-- discarded once expired, so they no longer count toward its limits. Each of those lists
-- is swept a page (EXPIRE.scan entries) a visit, on from where the last visit stopped
-- (k_queue_expiry_cursor), and up to EXPIRE.pages pages while they are wholly expired
-- (EXPIRE.extra_pages more than one a list in all, so one call stays short): an
-- expired entry behind ones that never expire goes too, and a non-destructive queue, whose
-- messages nobody takes, sheds a backlog. Delivered, unsettled ones stay with their
-- consumers. A queue leaves the set once empty.
-- extra_pages: past each list's first, for all queues a sweep; queues: looked at a sweep
local EXPIRE = { scan = 100, pages = 10, extra_pages = 40, queues = 200 }

-- Sweeps q's waiting entries; returns when to look at it next: the earliest expiry ahead
-- once every list was read to its end, now while one is read on from a cursor or after
-- entries came back to wait meanwhile, +inf when none waiting expires (a spool or a park
-- of q brings it forward), nil once q is gone.
local function expire_waiting(q, now, budget)
  local s, cursors = k_queue_stream(q), k_queue_expiry_cursor(q)
  if redis.call('EXISTS', k_queue_config(q)) == 0 or redis.call('XLEN', s) == 0 then
    redis.call('DEL', cursors)
    return nil
  end
  local to_dmq = redis.call('HGET', k_queue_config(q), 'respect_ttl') == '1'
  -- the earliest expiry ahead, from the visits before this one too while lists are read
  -- on; whether entries came back to wait since this round of visits began
  local soonest, again, fresh = math.huge, false, true
  local state = redis.call('HGETALL', cursors)
  for i = 1, #state, 2 do
    if state[i] == 'soonest' then
      soonest = tonumber(state[i + 1])
    elseif state[i] == 'again' then
      again = true
    else
      fresh = false
    end
  end
  again = again and not fresh  -- this visit reads every list from its head
  local function expire(id, fields)
    local x = tonumber(entry_field(fields, 'x'))
    if x and x <= now then
      unindex(q, id, fields)
      dead_letter(q, s, id, entry_blob(fields) or '', 'expired', to_dmq)
      return true
    end
    if x and x < soonest then soonest = x end
  end
  local unfinished = false
  -- one list, from its cursor: page(after) gives the next entries as {id, fields or false}
  local function sweep(list, page, expired_one)
    local after = redis.call('HGET', cursors, list)
    for _ = 1, EXPIRE.pages do
      local entries = page(after)
      local expired = 0
      for _, e in ipairs(entries) do
        if e[2] and expire(e[1], e[2]) then
          expired = expired + 1
          if expired_one then expired_one(e[1]) end
        end
      end
      if #entries < EXPIRE.scan then  -- its end: the next sweep starts at its head
        redis.call('HDEL', cursors, list)
        return
      end
      after = entries[#entries][1]
      if expired < #entries or budget.pages == 0 then break end
      budget.pages = budget.pages - 1
    end
    redis.call('HSET', cursors, list, after)
    unfinished = true
  end
  local timed = k_queue_timed(q)
  for _, consumer in ipairs({ RETURNED, HOLDING, TIMED }) do
    sweep(consumer, function(after)
      local entries = {}
      local from = after and '(' .. after or '-'
      for _, p in ipairs(redis.call('XPENDING', s, GROUP, from, '+', EXPIRE.scan, consumer)) do
        local e = redis.call('XRANGE', s, p[1], p[1])
        entries[#entries + 1] = { p[1], #e > 0 and e[1][2] }
      end
      return entries
    end, consumer == TIMED and function(id) redis.call('ZREM', timed, id) end)
  end
  -- never delivered. While stream readers keep entries, dead_letter leaves them in the
  -- stream, where a fetch would still find them: the group first takes the leading run of
  -- expired ones (in the returned consumer, settled at once); a later one waits its turn,
  -- so the queue is looked at again each sweep
  local floor = last_delivered(s)
  if redis.call('EXISTS', k_queue_readers(q)) == 1 then
    local waiting = redis.call('XRANGE', s, '(' .. floor, '+', 'COUNT', EXPIRE.scan)
    local last = 0
    for _, e in ipairs(waiting) do
      local x = tonumber(entry_field(e[2], 'x'))
      if not (x and x <= now) then break end
      last = last + 1
    end
    if last > 0 then
      redis.call('XREADGROUP', 'GROUP', GROUP, RETURNED, 'COUNT', last, 'STREAMS', s, '>')
      for i = 1, last do expire(waiting[i][1], waiting[i][2]) end
    end
    redis.call('HSET', cursors, 'again', 1)  -- once readers are gone, a round from the heads
    return now
  end
  sweep('new', function(after)
    if not after or id_less(after, floor) then after = floor end  -- delivered since
    return redis.call('XRANGE', s, '(' .. after, '+', 'COUNT', EXPIRE.scan)
  end)
  if unfinished then
    if soonest < math.huge then redis.call('HSET', cursors, 'soonest', soonest) end
    return now
  end
  redis.call('DEL', cursors)
  if again then return now end
  return soonest == math.huge and '+inf' or soonest
end

-- Reap every node whose liveness key expired. Returns the number of flows released.
-- Also trims the queues that stream readers hold open (see trim_read_queue), returns
-- messages whose delivery time came and expires waiting ones, on up to EXPIRE.queues
-- queues due each, the longest due first: thousands of device queues holding a message
-- that expires in an hour cost a sweep nothing until then.
register_always('gw_reap', function(_, _)
  -- the sets of the release before, whose members every sweep looked at: each due at once
  local function adopt_earlier(set, sorted)
    if redis.call('EXISTS', set) == 0 then return end
    for _, q in ipairs(redis.call('SMEMBERS', set)) do redis.call('ZADD', sorted, 'LT', 0, q) end
    redis.call('DEL', set)
  end
  local released = 0
  for _, n in ipairs(redis.call('SMEMBERS', K_NODES)) do
    if not node_alive(n) then released = released + reap_node(n) end
  end
  for _, q in ipairs(redis.call('SMEMBERS', K_READ_QUEUES)) do trim_read_queue(q) end
  adopt_earlier(K_EARLIER_TIMED_QUEUES, K_TIMED_QUEUES)
  adopt_earlier(K_EARLIER_EXPIRING_QUEUES, K_EXPIRING_QUEUES)
  local now = now_ms()
  local due = { '-inf', now, 'LIMIT', 0, EXPIRE.queues }
  for _, q in ipairs(redis.call('ZRANGEBYSCORE', K_TIMED_QUEUES, unpack(due))) do
    release_due(q, now)
  end
  local budget = { pages = EXPIRE.extra_pages }
  for _, q in ipairs(redis.call('ZRANGEBYSCORE', K_EXPIRING_QUEUES, unpack(due))) do
    local at = expire_waiting(q, now, budget)
    if at then
      redis.call('ZADD', K_EXPIRING_QUEUES, at, q)
    else
      redis.call('ZREM', K_EXPIRING_QUEUES, q)
    end
  end
  return released
end)
end  -- the sweep

-- Stream, consumer group and counters of a queue whose config hash is written.
local function init_queue(q)
  unaccount_all(q)
  redis.call('DEL', k_queue_stream(q), k_queue_stats(q), k_queue_flows(q), k_queue_lease(q))
  redis.call('XGROUP', 'CREATE', k_queue_stream(q), GROUP, '0', 'MKSTREAM')
  redis.call('HSET', k_queue_stats(q), 'msgs', 0, 'bytes', 0, 'spooled', 0, 'acked', 0)
end

-- A partition copies its parent's settings but is exclusive (one owner flow at a time)
-- and hidden from the queue list.
-- Children copy their parent's settings. A partition is exclusive (one owner flow at a
-- time); a priority level is read by every flow of the parent, under the parent's lease.
local function child_settings(q, child)
  redis.call('HSET', k_queue_config(child), unpack(redis.call('HGETALL', k_queue_config(q))))
  local access = partition_count(q) > 0 and 'exclusive' or 'non-exclusive'
  redis.call('HSET', k_queue_config(child), 'access', access, 'partition_count', 0,
    'priorities', 0, 'parent', q)
end

local function create_partition(q, i)
  local child = partition_queue(q, i)
  child_settings(q, child)
  init_queue(child)
end

-- ARGV: queue, then field/value pairs. Creates the queue (and its partitions) unless it
-- exists. Returns {1} when created, else {0, field, value, ...} of the existing config.
register_always('gw_queue_create', function(_, a)
  local q = a[1]
  local cfg = k_queue_config(q)
  if redis.call('EXISTS', cfg) == 1 then
    local out = { 0 }
    for _, v in ipairs(redis.call('HGETALL', cfg)) do out[#out + 1] = v end
    return out
  end
  redis.call('HSET', cfg, unpack(a, 2))
  -- created_ms tells this queue from others made under its name (gw_bind, gw_spool): two
  -- made in one millisecond, or by nodes whose clocks differ, must not share one
  local made = tonumber(redis.call('HGET', cfg, 'created_ms')) or 0
  local last = tonumber(redis.call('GET', K_LAST_CREATED)) or 0
  if made <= last then
    made = last + 1
    redis.call('HSET', cfg, 'created_ms', made)
  end
  redis.call('SET', K_LAST_CREATED, made)
  init_queue(q)
  for i = 0, partition_count(q) - 1 do create_partition(q, i) end
  if redis.call('HGET', cfg, 'priorities') == '1' then
    for p = 0, PRIORITY_LEVELS - 1 do
      local child = priority_queue(q, p)
      child_settings(q, child)
      init_queue(child)
    end
  end
  redis.call('SADD', K_QUEUES, q)
  routes_changed(q)  -- nodes learn its routing info (lvq_key)
  for i = 2, #a - 1, 2 do
    if a[i] == 'owner_node' and a[i + 1] ~= '' then
      redis.call('SADD', k_node_queues(a[i + 1]), q)  -- so the reaper finds it
    end
  end
  return { 1 }
end)

-- ARGV: queue, node, created_ms. A node that declared a non-durable queue another node
-- owns becomes one of its owners: the queue lives while one of them does (a node started
-- again after a crash declares its config file's queues while the dead node still owns
-- them; nodes share a config file). Returns 0 if that queue is gone (made again since).
register_always('gw_queue_co_own', function(_, a)
  local q, node = a[1], a[2]
  local c = redis.call('HMGET', k_queue_config(q), 'created_ms', 'durable', 'owner_node')
  if c[1] ~= a[3] then return 0 end
  if c[2] == '0' and c[3] and c[3] ~= '' and c[3] ~= node then
    redis.call('SADD', k_queue_owner_nodes(q), node)
    redis.call('SADD', k_node_queues(node), q)
  end
  return 1
end)

-- ARGV: queue, then field/value pairs to change (partitions follow their parent).
-- Returns 0 if the queue does not exist. A changed max_spool_bytes re-evaluates the
-- queue's threshold alarms.
register_always('gw_queue_update', function(_, a)
  local q = a[1]
  local cfg = k_queue_config(q)
  if redis.call('EXISTS', cfg) == 0 or hidden(q) then return 0 end
  if #a > 1 then redis.call('HSET', cfg, unpack(a, 2)) end
  for _, child in ipairs(children(q)) do child_settings(q, child) end
  queue_alarms(q)
  redis.call('PUBLISH', K_EVENTS, 'qcfg ' .. q)
  redis.call('PUBLISH', k_queue_wake(q), '')
  return 1
end)

-- A queue's event counters (spooled, acked, ...: not its depth, nor its blocked state), by
-- field; they never go back, so a repartition keeps those of what it deletes.
local STATE_STATS = { msgs = true, bytes = true, blocked = true, flow_held = true }

local function event_counters(q)
  local out = {}
  local st = redis.call('HGETALL', k_queue_stats(q))
  for i = 1, #st, 2 do
    if not STATE_STATS[st[i]] then out[st[i]] = st[i + 1] end
  end
  return out
end

local function add_counters(q, counters)
  for field, n in pairs(counters) do redis.call('HINCRBY', k_queue_stats(q), field, n) end
end

-- The names of the stream readers that have a place in any of `queues`.
local function reader_names(queues)
  local names, seen = {}, {}
  for _, queue in ipairs(queues) do
    for _, name in ipairs(redis.call('HKEYS', k_queue_readers(queue))) do
      if not seen[name] then
        seen[name] = true
        names[#names + 1] = name
      end
    end
  end
  return names
end

-- Streams a repartition adds get the queue's readers at their start (0-0): consumers'
-- acks there must keep entries until each reader read them, as in the queue's other
-- streams. Every deletion there counts as the readers' loss (no baseline).
local function place_readers(queues, names)
  if #names == 0 then return end
  for _, queue in ipairs(queues) do
    for _, name in ipairs(names) do
      if redis.call('HSETNX', k_queue_readers(queue), name, '0-0') == 1 then
        redis.call('HDEL', k_queue_reader_baselines(queue), name)
      end
    end
    redis.call('SADD', K_READ_QUEUES, queue)
  end
end

-- ARGV: queue, new partition count, and the max_spool_bytes the same change sets, if it
-- does (a last value queue ceasing to be one is partitioned then). Scaling partitions or
-- switching between partitioned and not is only allowed with egress disabled; every flow
-- is unbound. Messages of
-- removed partitions (or of the old layout when switching kind) are deleted and counted;
-- their event counters stay, the queue's own.
-- Returns {'ok', deleted messages} or {'noqueue'} / {'egress'}, or a refusal of what
-- cannot be partitioned: {'exclusive'} / {'sorted'} / {'priority'} / {'grouped'} /
-- {'non_destructive'} / {'lvq'}.
register_always('gw_repartition', function(_, a)
  local q, new_n = a[1], tonumber(a[2])
  local cfg = k_queue_config(q)
  local c = redis.call('HMGET', cfg, 'egress', 'partition_count', 'access', 'priorities',
    'message_groups', 'non_destructive', 'parent', 'lvq_key', 'max_spool_bytes')
  if not c[1] or c[7] then return { 'noqueue' } end
  if c[1] == '1' then return { 'egress' } end
  if new_n > 0 then  -- the rules of QueueConfig.validate
    if c[3] ~= 'non-exclusive' then return { 'exclusive' } end
    if sort_key(q) then return { 'sorted' } end
    if c[4] == '1' then return { 'priority' } end
    if c[5] and c[5] ~= '' then return { 'grouped' } end
    if c[6] == '1' then return { 'non_destructive' } end
    if (c[8] and c[8] ~= '') or (a[3] or c[9]) == '0' then return { 'lvq' } end
  end
  local old_n = tonumber(c[2]) or 0
  if old_n == new_n then return { 'ok', 0 } end
  local readers = reader_names(old_n == 0 and { q } or children(q))
  for _, flow in ipairs(redis.call('ZRANGE', k_queue_flows(q), 0, -1)) do
    release_flow(q, flow, true, true)  -- they bind again; an auto-delete queue stays
  end
  local deleted = 0
  if old_n == 0 then
    deleted = tonumber(redis.call('HGET', k_queue_stats(q), 'msgs') or '0') or 0
    local counters = event_counters(q)
    init_queue(q)
    add_counters(q, counters)
    -- its readers' places go with its stream (they move to the partitions, where
    -- forget_reader finds them): else one retired there came back on the stream unpartitioned
    redis.call('DEL', k_queue_readers(q), k_queue_reader_baselines(q))
    redis.call('SREM', K_READ_QUEUES, q)
  end
  for i = new_n, old_n - 1 do
    local child = partition_queue(q, i)
    deleted = deleted + (tonumber(redis.call('HGET', k_queue_stats(child), 'msgs') or '0') or 0)
    add_counters(q, event_counters(child))
    delete_queue(child)
  end
  redis.call('HSET', cfg, 'partition_count', new_n)
  for i = old_n, new_n - 1 do create_partition(q, i) end
  if new_n == 0 then
    place_readers({ q }, readers)
  elseif new_n > old_n then
    local added = {}
    for i = old_n, new_n - 1 do added[#added + 1] = partition_queue(q, i) end
    place_readers(added, readers)
  end
  redis.call('DEL', k_queue_parts(q))
  redis.call('PUBLISH', K_EVENTS, 'qcfg ' .. q)
  return { 'ok', deleted }
end)

-- ARGV: queue. Rebalances a partitioned queue's partitions (and moves handoffs along).
register_always('gw_rebalance', function(_, a)
  return rebalance(a[1], now_ms()) and 1 or 0
end)

-- ARGV: queue. Returns {n, then per partition: owner flow, fence, target flow, holder,
-- then every flow bound to the queue}: the owner dispatches (with that fence); a holder
-- differing from the target is handing off.
register_always('gw_partitions', function(_, a)
  local q = a[1]
  local n = partition_count(q)
  local parts = k_queue_parts(q)
  local out = { n }
  for i = 0, n - 1 do
    local l = redis.call('HMGET', k_queue_lease(partition_queue(q, i)), 'flow', 'fence')
    local st = redis.call('HMGET', parts, 't:' .. i, 'o:' .. i)
    out[#out + 1] = l[1] or ''
    out[#out + 1] = l[2] or ''
    out[#out + 1] = st[1] or ''
    out[#out + 1] = st[2] or ''
  end
  for _, flow in ipairs(redis.call('ZRANGE', k_queue_flows(q), 0, -1)) do
    out[#out + 1] = flow
  end
  return out
end, 'no-writes')

-- ARGV: queue. Deletes the queue, its messages and its topic subscriptions.
register_always('gw_queue_delete', function(_, a)
  if hidden(a[1]) then return 0 end
  return delete_queue(a[1])
end)

-- ARGV: queue, member, until (epoch ms, or 'inf'). Records a member of a queue that lives
-- while it has members (an MQTT shared subscription group, or a persistent session's own
-- queue until its expiry), before its queue is declared and bound, so a concurrent
-- gw_queue_leave or gw_queue_lapsed keeps the queue.
register_always('gw_queue_join', function(_, a)
  redis.call('ZADD', k_queue_members(a[1]), a[3], a[2])
  return 1
end)

-- ARGV: queue, member ('' for none), now (epoch ms). The member leaves; memberships that
-- lapsed go too. With no member left and no flow of a live node bound, the queue is
-- deleted with its messages. Returns 1 when deleted, 0 while members remain, 2 when only
-- bound flows keep it (a member that is leaving elsewhere: ask again later).
register_always('gw_queue_leave', function(_, a)
  local q, member, now = a[1], a[2], tonumber(a[3])
  local m = k_queue_members(q)
  if member ~= '' then redis.call('ZREM', m, member) end
  redis.call('ZREMRANGEBYSCORE', m, '-inf', now)
  if redis.call('ZCARD', m) > 0 then return 0 end
  if redis.call('EXISTS', k_queue_config(q)) == 0 then return 1 end
  if #live_flows(q) > 0 then return 2 end
  return delete_queue(q)
end)

-- ARGV: queue, now (epoch ms). A queue whose memberships all lapsed goes, with its
-- messages, unless a flow of a live node is bound. A queue that never had members lives
-- by other rules and stays. Returns 1 when deleted (or gone), 0 when kept, 2 when only
-- bound flows keep it.
register_always('gw_queue_lapsed', function(_, a)
  local q, now = a[1], tonumber(a[2])
  local m = k_queue_members(q)
  if redis.call('EXISTS', m) == 0 then return 0 end
  if redis.call('ZCOUNT', m, '(' .. now, '+inf') > 0 then return 0 end
  if redis.call('EXISTS', k_queue_config(q)) == 0 then
    redis.call('DEL', m)
    return 1
  end
  if #live_flows(q) > 0 then return 2 end
  return delete_queue(q)
end)

-- ARGV: queue, 'add' | 'remove', subscription entries... Returns the number changed,
-- or -1 if the queue does not exist.
register_always('gw_subscription', function(_, a)
  local q = a[1]
  if redis.call('EXISTS', k_queue_config(q)) == 0 or hidden(q) then return -1 end
  local cmd = a[2] == 'add' and 'SADD' or 'SREM'
  local changed = redis.call(cmd, k_queue_subs(q), unpack(a, 3))
  if changed > 0 then routes_changed(q) end
  return changed
end)

-- A node's routing trie: gw_routes_since loads the routes changed since the version it
-- loaded, or every route.
do
-- Appends q's routes to out: queue, key (the property of its LVQ key or sort key; its
-- spool needs it), its subscription selector (applied by the routing node), its
-- created_ms (which gw_spool checks), n, its n subscription entries. A queue gone: n is
-- -1 and the rest empty.
local function append_routes(out, q)
  out[#out + 1] = q
  local keyed = redis.call('HMGET', k_queue_config(q), 'lvq_key', 'sort_key',
    'subscription_selector', 'created_ms')
  if redis.call('SISMEMBER', K_QUEUES, q) == 0 then
    for _ = 1, 3 do out[#out + 1] = '' end
    out[#out + 1] = -1
    return
  end
  local subs = redis.call('SMEMBERS', k_queue_subs(q))
  out[#out + 1] = (keyed[1] ~= '' and keyed[1]) or keyed[2] or ''
  out[#out + 1] = keyed[3] or ''
  out[#out + 1] = keyed[4] or ''
  out[#out + 1] = #subs
  for _, e in ipairs(subs) do out[#out + 1] = e end
end

local function sub_version()
  return tonumber(redis.call('GET', K_SUB_VERSION) or '0')
end

-- Every route as {version, queue, ... as append_routes}, for a node of the release before
-- during a rolling upgrade.
register_always('gw_routes', function(_, _)
  local out = { sub_version() }
  for _, q in ipairs(redis.call('SMEMBERS', K_QUEUES)) do append_routes(out, q) end
  return out
end)

-- ARGV: the version a node loaded and the generation it was of ('' for none). Returns
-- {version, generation, 'changed', queue, ... as append_routes} for the queues changed
-- since, or {version, generation, 'all', ...} with every queue when those changes are no
-- longer kept or Redis is not the one the node loaded from (it came back without its data:
-- the generation, made with the first change log, is another).
register_always('gw_routes_since', function(_, a)
  local since, version = tonumber(a[1]), sub_version()
  local state = redis.call('HMGET', K_ROUTE_CHANGES_STATE, 'generation', 'floor')
  local generation = state[1]
  if not generation then
    local now = redis.call('TIME')
    generation = now[1] .. '.' .. now[2]
    redis.call('HSET', K_ROUTE_CHANGES_STATE, 'generation', generation)
  end
  if a[2] ~= generation or since < tonumber(state[2] or '0') or since > version then
    local out = { version, generation, 'all' }
    for _, q in ipairs(redis.call('SMEMBERS', K_QUEUES)) do append_routes(out, q) end
    return out
  end
  local out = { version, generation, 'changed' }
  for _, q in ipairs(redis.call('ZRANGEBYSCORE', K_ROUTE_CHANGES, '(' .. since, '+inf')) do
    append_routes(out, q)
  end
  return out
end)
end  -- the routing trie's loads

-- ARGV: broker quota (bytes, 0: none), threshold set percent, clear percent, then pairs of
-- VPN name and quota. Replaces the spool limits every node enforces, then raises or clears
-- the broker's and the VPNs' threshold alarms as the new limits decide.
-- No ARGV. Computes the broker and VPN totals from every queue's own byte counter (hidden
-- children counted in their parent's VPN) when the totals hash lacks its 'format' marker:
-- a Redis written before the totals existed, or after they were lost. Returns 1 if rebuilt.
register_always('gw_spool_rebuild', function()
  if redis.call('HEXISTS', K_SPOOL_USAGE, 'format') == 1 then return 0 end
  local totals = { broker = 0 }
  for _, q in ipairs(redis.call('SMEMBERS', K_QUEUES)) do
    local f = 'v:' .. (redis.call('HGET', k_queue_config(q), 'vpn') or 'default')
    local names = children(q)
    names[#names + 1] = q
    for _, name in ipairs(names) do
      local b = tonumber(redis.call('HGET', k_queue_stats(name), 'bytes') or '0') or 0
      totals.broker = totals.broker + b
      totals[f] = (totals[f] or 0) + b
    end
  end
  redis.call('DEL', K_SPOOL_USAGE)
  local pairs_ = { 'format', 1 }
  for f, b in pairs(totals) do
    pairs_[#pairs_ + 1] = f
    pairs_[#pairs_ + 1] = b
  end
  redis.call('HSET', K_SPOOL_USAGE, unpack(pairs_))
  return 1
end)

-- Store the spool limits and raise or clear the alarms they decide. `parts`: those set ('b'
-- the broker quota, 'v' the VPN quotas, 't' the threshold percents); a: the broker quota,
-- set and clear percents, then VPN name / quota pairs, from a[first]. A part not set keeps
-- its stored value (all take the given ones when none are stored), read and written in
-- this one call: nodes starting together each keep what the other set.
local function store_spool_limits(parts, a, first)
  local raw_limits = redis.call('HGETALL', K_SPOOL_LIMITS)
  local fresh = #raw_limits == 0
  local function sets(p) return fresh or string.find(parts, p, 1, true) ~= nil end
  local old, old_vpns = {}, {}
  for i = 1, #raw_limits, 2 do
    local f, v = raw_limits[i], raw_limits[i + 1]
    old[f] = v
    if string.sub(f, 1, 2) == 'v:' then
      old_vpns[#old_vpns + 1] = string.sub(f, 3)
      old_vpns[#old_vpns + 1] = v
    end
  end
  local broker = sets('b') and a[first] or old.broker or '0'
  local set, clear = a[first + 1], a[first + 2]
  if not sets('t') then set, clear = old.set or '80', old.clear or '60' end
  local vpn_quotas = old_vpns
  if sets('v') then
    vpn_quotas = {}
    for i = first + 3, #a do vpn_quotas[#vpn_quotas + 1] = a[i] end
  end
  redis.call('DEL', K_SPOOL_LIMITS)
  redis.call('HSET', K_SPOOL_LIMITS, 'broker', broker, 'set', set, 'clear', clear)
  for i = 1, #vpn_quotas - 1, 2 do
    redis.call('HSET', K_SPOOL_LIMITS, 'v:' .. vpn_quotas[i], vpn_quotas[i + 1])
  end
  local set_pct, clear_pct = tonumber(set), tonumber(clear)
  local usage, vpns, seen = {}, {}, {}
  local function vpn(name)
    if not seen[name] then
      seen[name] = true
      vpns[#vpns + 1] = name
    end
  end
  local raw = redis.call('HGETALL', K_SPOOL_USAGE)
  for i = 1, #raw, 2 do
    usage[raw[i]] = tonumber(raw[i + 1]) or 0
    if string.sub(raw[i], 1, 2) == 'v:' then vpn(string.sub(raw[i], 3)) end
  end
  for i = 1, #vpn_quotas - 1, 2 do vpn(vpn_quotas[i]) end
  local alarms = {}
  raw = redis.call('HGETALL', K_SPOOL_ALARMS)
  for i = 1, #raw, 2 do
    alarms[raw[i]] = true
    if string.sub(raw[i], 1, 4) == 'vpn:' then vpn(string.sub(raw[i], 5)) end
  end
  spool_threshold('broker', usage.broker or 0, tonumber(broker) or 0, set_pct, clear_pct,
    alarms.broker)
  for _, name in ipairs(vpns) do
    local _, quota = spool_limits(name)
    spool_threshold('vpn:' .. name, usage['v:' .. name] or 0, quota, set_pct, clear_pct,
      alarms['vpn:' .. name])
  end
  for _, q in ipairs(redis.call('SMEMBERS', K_QUEUES)) do queue_alarms(q) end
  return 1
end

-- Args: parts (see store_spool_limits), the broker quota, set and clear percents, VPN
-- name / quota pairs.
register_always('gw_spool_merge_limits', function(_, a)
  return store_spool_limits(a[1], a, 2)
end)

-- The earlier layout, without the parts (all set), for a node of the release before during
-- a rolling upgrade: the same name with another layout would misread its arguments.
register_always('gw_spool_limits', function(_, a)
  return store_spool_limits('bvt', a, 1)
end)
