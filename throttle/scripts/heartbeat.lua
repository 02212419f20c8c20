-- heartbeat.lua: records that one process is alive for a limiter and
-- returns how many are. One sorted set per limiter, member = process id,
-- score = last heartbeat (microseconds on the Redis clock); members older
-- than the TTL are dropped, and the set expires if every process stops.
--
-- KEYS[1]  the set
-- ARGV[1]  this process's id
-- ARGV[2]  TTL in milliseconds
-- Returns the number of live processes, this one included.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], string.format('%d', now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('(%d', now - ttl * 1000))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return redis.call('ZCARD', KEYS[1])
