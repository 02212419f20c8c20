-- release.lua: ARGV[4] the lease id. Gives the lease back and admits the
-- next waiters. Status 1 if the lease was held, 0 if it had lapsed (or was
-- released before: releasing is idempotent).
sweep()
local id = ARGV[4]
local was = redis.call('ZREM', H, id)
redis.call('HDEL', T, id)
admit()
return finish(was)
