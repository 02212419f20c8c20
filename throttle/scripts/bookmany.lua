-- bookmany.lua: book1.lua for several single requests in one call, each on
-- its own key under its own limit, judged in order: the engine gathers
-- into one call the single bookings that find every connection to a node
-- busy. A key may come more than once; each request then sees the ones
-- before it.
--
-- KEYS     k keys
-- ARGV     "" or a test clock, then for each key in turn: I, tau, n,
--          max_wait (microseconds)
-- reply    {now, then for each key in turn: tat, w}: tat and w as
--          book1.lua answers them; tat = -1 (w = 0) for a key whose stored
--          value could not be read as a TAT (or not read at: a key of
--          another type), or whose SET failed (out of memory), on which
--          nothing was done: the engine sends that request again alone, to
--          answer it with its own error. A key given again after such a
--          failure gets the same answer.
-- now: set by clock.lua, put before this script by the engine.
local out = {now}
local cur = {} -- key -> its TAT as this call left it, or false if unread
for i = 1, #KEYS do
  local a = 4 * i - 2
  local interval, tau, n, maxwait = ARGV[a] + 0, ARGV[a + 1] + 0, ARGV[a + 2] + 0, ARGV[a + 3] + 0
  local key = KEYS[i]
  local tat = cur[key]
  if tat == nil then
    local ok, v = pcall(stored, key, now, interval, tau)
    if ok then tat = v or now else tat = false end
    cur[key] = tat
  end
  if tat == false then
    out[2 * i], out[2 * i + 1] = -1, 0
  else
    if tat < now then tat = now end
    local wait = tat + (n - 1) * interval - tau - now
    if wait < 0 then wait = 0 end
    if wait > maxwait then
      out[2 * i], out[2 * i + 1] = tat, -1 - wait
    else
      local new = tat + n * interval
      if pcall(redis.call, 'SET', key, string.format('%d', new), 'PX', px(new, now, hold)) then
        out[2 * i], out[2 * i + 1] = tat, wait
        cur[key] = new
      else
        out[2 * i], out[2 * i + 1] = -1, 0
        cur[key] = false
      end
    end
  end
end
return out
