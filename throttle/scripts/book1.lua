-- book1.lua: book.lua for the common case, one request on one key, and
-- the cheapest call of the protocol, so it stands alone (clock.lua is not
-- put before it) and does without function definitions, tables and
-- number formatting wherever it can: it makes the same decision as
-- book.lua, but answers with one string that the engine reads.
--
-- KEYS[1]  the key holding TAT (integer microseconds on the Redis clock)
-- ARGV     "" or a test clock, step = n * I, reach = tau + I, max_wait
--          (microseconds): what the decision needs, worked out by the
--          client, since every argument read costs the server a strtod
--          and every argument sent an element of ARGV.
--
-- Reply: the words "s u", "s u tat", "s u -" or "s u -tat", where
-- now = s * 1000000 + u (TIME's seconds and microseconds as Redis wrote
-- them; "0 <now>" under a test clock); tat is the stored TAT the request
-- was judged against, absent when the key was idle (tat = now); "-"
-- marks a refusal, which writes nothing. The engine works out the wait,
-- max(0, tat + step - reach - now) = max(0, tat + (n - 1) * I - tau - now),
-- as this script does. Strings
-- Redis gave the script are answered as they came: a table reply, or
-- numbers formatted for one, cost the server more than the rest of the
-- answer's work.
local s, u, now, hold
if ARGV[1] == '' then
  local t = redis.call('TIME')
  s, u = t[1], t[2]
  now = s * 1000000 + u
  hold = 0
else
  -- A test clock: see clock.lua.
  s, u = '0', ARGV[1]
  now = tonumber(u)
  hold = 3600000
end
-- x + 0 converts as tonumber(x) does, without a function call.
local step, reach, maxwait = ARGV[2] + 0, ARGV[3] + 0, ARGV[4] + 0
local tat = now
local v = redis.call('GET', KEYS[1])
if v then
  -- clock.lua's stored(), written out: the same checks, the same errors.
  local x
  if #v <= 16 and string.find(v, '^%d+$') then x = v + 0 end
  if x == nil or x > 9007199254740992 then
    return error({err = 'SLOTBOOK_CORRUPT key ' .. KEYS[1] .. ' holds ' .. string.format('%q', string.sub(v, 1, 40)) ..
      ', not a TAT (an integer count of microseconds, at most 2^53): Reset the subject'})
  end
  -- The horizon plus 2 * (tau + I), as stored() checks.
  if x - now > 31622400000000 + 2 * reach then
    return error({err = 'SLOTBOOK_CORRUPT key ' .. KEYS[1] .. ' holds a TAT ' .. string.format('%d', x - now) ..
      ' microseconds ahead, further than any booking under its limit reaches: Reset the subject'})
  end
  if x > now then tat = x else v = nil end
end
local wait = tat + step - reach - now
if wait < 0 then wait = 0 end
if wait > maxwait then
  if v then return s .. ' ' .. u .. ' -' .. v end
  return s .. ' ' .. u .. ' -'
end
local new = tat + step
-- PX as clock.lua's px() works it out: ceil((new - now) / 1000) + 1 (+ hold).
local d = (now - new) / 1000
redis.call('SET', KEYS[1], string.format('%d', new), 'PX', string.format('%d', d % 1 - d + 1 + hold))
if v then return s .. ' ' .. u .. ' ' .. v end
return s .. ' ' .. u
