-- keep.lua: one call for all of a process's leases and waiters of one
-- subject, every TTL/3 (and, while it has waiters, every poll interval).
-- ARGV[4] the number h of held lease ids that follow; then h held ids;
-- then the ids of the process's waiters.
-- Held leases are extended to now + ttl; those that have lapsed are
-- returned in extra (lost). Waiters are refreshed; one that was granted
-- (its wake-up lost or not yet read) is returned in mine; one that left
-- the queue because its refresh came late joins it again at the back; one
-- that gave up (in L) is left alone.
sweep()
local h = tonumber(ARGV[4])
local lost = {}
for i = 5, 4 + h do
  local id = ARGV[i]
  if redis.call('ZSCORE', H, id) then
    redis.call('ZADD', H, fmt(now + ttl), id)
  else
    lost[#lost + 1] = id
  end
end
for i = 5 + h, #ARGV do
  local id = ARGV[i]
  local token = redis.call('HGET', T, id)
  if redis.call('ZSCORE', L, id) then
    -- Gone: its leave call came first (this call was on its way). Not
    -- queued again, so that it is not granted a lease nobody holds.
  elseif token then
    granted(id, token)
    redis.call('LREM', NB .. proc, 0, id .. ' ' .. token)
  else
    if not redis.call('ZSCORE', Q, id) then
      redis.call('ZADD', Q, redis.call('INCR', C), id)
    end
    redis.call('ZADD', W, fmt(now + ttl), id)
  end
end
admit()
return finish(#lost, lost)
