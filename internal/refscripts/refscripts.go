// Package refscripts holds the reference Lua scripts that slotbook's
// script cost is judged against, so that cmd/slotbench's cost table and
// package throttle's BenchmarkBook1ServerCost measure the same scripts.
// Each does a GCRA's Redis commands with less or no arithmetic; none is
// a rate limiter.
package refscripts

// Floor does only TIME, GET and SET PX: what every GCRA script must do
// (slotbench's "TIME+GET+SET PX reference").
const Floor = `local t = redis.call('TIME')
local v = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], t[1], 'PX', 1000)
return 1
`

// Protocol is Floor taking book1.lua's four arguments (unread) and
// answering as book1.lua answers an idle key, with TIME's two words
// joined: what slotbook's wire protocol adds before any arithmetic.
const Protocol = `local t = redis.call('TIME')
local v = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], t[1], 'PX', 1000)
return t[1] .. ' ' .. t[2]
`

// Integer is Protocol working out the Redis time in microseconds as a
// number and storing it as an integer (string.format: a Lua number past
// 14 digits has no exact tostring), as book1.lua works out and stores a
// TAT: the arithmetic on TIME's words and the formatting that a script
// storing a sum of microseconds (tat + step) as one integer cannot skip.
// The width itself costs nothing measurable (BenchmarkBook1ServerCost's
// "wide" probe).
const Integer = `local t = redis.call('TIME')
local v = redis.call('GET', KEYS[1])
redis.call('SET', KEYS[1], string.format('%d', t[1] * 1000000 + t[2]), 'PX', 1000)
return t[1] .. ' ' .. t[2]
`
