-- block.lua: shared back-off. Pushes each key's TAT so that no slot is
-- granted before now + d, for every process: after an upstream "429, retry
-- after d". Slots booked before keep their times. Requests resume one
-- interval apart from then, not in a burst.
--
-- KEYS      the keys
-- ARGV[1]   "" to read the clock with TIME; a microsecond count in tests (clock.lua)
-- ARGV[2]   d, microseconds
-- ARGV[3..] per key, tau (burst * I)
--
-- Returns {now, tat_1 .. tat_m}.
-- now: set by clock.lua, put before this script by the engine.
local until_ = now + tonumber(ARGV[2])
local out = {now}
for i = 1, #KEYS do
  -- The first slot is tat - tau: put it at until_.
  local target = until_ + tonumber(ARGV[2 + i])
  local tat = math.max(stored(KEYS[i]) or target, target)
  redis.call('SET', KEYS[i], string.format('%d', tat),
    'PX', px(tat))
  out[#out + 1] = tat
end
return out
