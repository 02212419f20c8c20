-- leave.lua: ARGV[4] the id of a waiter that gives up. It leaves the
-- queue; if it was granted meanwhile, the lease is given back (and its
-- wake-up, if one was pushed, taken off the list), so that a waiter that
-- gave up never holds a lease; its id is kept in L for a TTL, so that
-- its acquire call, if it comes later, does not queue it again. Status 1
-- if it had been granted.
-- ARGV[5] (optional) the fencing token of a lease granted to the waiter
-- that its holder has released: a grant with that token is left to its
-- release call (which this call may have overtaken), and only a later
-- grant (made after a keep call put the waiter back in the queue) is
-- given back.
sweep()
local id = ARGV[4]
redis.call('ZREM', Q, id)
redis.call('ZREM', W, id)
redis.call('ZADD', L, fmt(now + ttl), id)
local token = redis.call('HGET', T, id)
local was = 0
if token ~= ARGV[5] then
  was = redis.call('ZREM', H, id)
  redis.call('HDEL', T, id)
  if token then
    local n = NB .. owner(id)
    redis.call('LREM', n, 0, id .. ' ' .. token)
  end
end
admit()
return finish(was)
