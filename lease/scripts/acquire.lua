-- acquire.lua: ARGV[4] the lease id, ARGV[5] 'wait' or 'try'.
-- wait: joins the queue (once: a retry after a lost reply keeps its place)
-- and admits from its head; the caller's grant, if any, is in mine.
-- try: takes a lease only if one is free and nobody waits; status 1 if it
-- did, 0 if not; it never queues.
sweep()
local id = ARGV[4]
local held = redis.call('HGET', T, id)
if held then -- granted already (a retry after a lost reply)
  granted(id, held)
  return finish(1)
end
if redis.call('ZSCORE', L, id) then -- gone: its leave call came first
  return finish(0)
end
if ARGV[5] == 'try' then
  admit()
  if redis.call('ZCARD', Q) == 0 and redis.call('ZCARD', H) < limit then
    mine[#mine + 1] = id
    mine[#mine + 1] = grant(id)
    mine[#mine + 1] = ttl
    return finish(1)
  end
  return finish(0)
end
if not redis.call('ZSCORE', Q, id) then
  redis.call('ZADD', Q, redis.call('INCR', C), id)
end
redis.call('ZADD', W, fmt(now + ttl), id)
admit()
return finish(0)
