-- clock.lua: put before every script that reads the clock. now is the
-- Redis clock in microseconds (TIME), unless ARGV[1] holds an explicit
-- time: the module's own tests pass one through an internal hook; nothing
-- outside the module can.
local now
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
else
  now = tonumber(ARGV[1])
end
