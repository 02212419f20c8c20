-- book.lua: judges a list of requests against one GCRA key, in order, and
-- books each one that fits its max wait. One call, one key, one integer.
--
-- KEYS[1]   the key; its value is TAT, the theoretical arrival time, as an
--           integer count of microseconds on the Redis clock
-- ARGV[1]   emission interval I, microseconds
-- ARGV[2]   tolerance tau = burst * I, microseconds
-- ARGV[3]   "" to read the clock with TIME; a microsecond count in tests
-- ARGV[4..] pairs (n, max_wait): units wanted, longest acceptable wait in
--           microseconds (-1: no bound)
--
-- Returns {now, booked_1, wait_1, tat_1, booked_2, wait_2, tat_2, ...}:
-- booked is 1 or 0, wait the exact delay until the request's slot (for a
-- refusal, the delay it would have needed), tat the TAT after the decision.
-- A refused request writes nothing. All values stay integral: a Lua number
-- handed back to Redis is formatted with %.17g, so SET gets string.format.
local interval = tonumber(ARGV[1])
local tau = tonumber(ARGV[2])

local now
if ARGV[3] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
else
  now = tonumber(ARGV[3])
end

local tat = now
local stored = redis.call('GET', KEYS[1])
if stored then
  local v = tonumber(stored)
  if v == nil then
    return redis.error_reply('slotbook: key ' .. KEYS[1] .. ' does not hold a TAT')
  end
  if v > now then tat = v end
end
local first = tat

local out = {now}
for i = 4, #ARGV, 2 do
  local n = tonumber(ARGV[i])
  local maxwait = tonumber(ARGV[i + 1])
  local wait = tat + (n - 1) * interval - tau - now
  if wait < 0 then wait = 0 end
  if maxwait >= 0 and wait > maxwait then
    out[#out + 1] = 0
  else
    tat = tat + n * interval
    out[#out + 1] = 1
  end
  out[#out + 1] = wait
  out[#out + 1] = tat
end

if tat ~= first then
  redis.call('SET', KEYS[1], string.format('%d', tat),
    'PX', string.format('%d', math.ceil((tat - now) / 1000) + 1))
end
return out
