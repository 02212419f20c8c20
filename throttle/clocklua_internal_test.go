package throttle

import (
	"context"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
)

// clock.lua's helpers are written for speed (px rounds up with Lua
// arithmetic instead of math.ceil, stored reads the value with v + 0 once
// its pattern has passed, and neither uses an upvalue). These tests hold
// them to the plain forms they replace, on the Redis they run on, value
// for value.

// pxPlain is px as first written: math.ceil of the float quotient.
const pxPlain = `
local out = {}
for i = 2, #ARGV do
  local tat = now + tonumber(ARGV[i])
  local want = string.format('%d', math.ceil((tat - now) / 1000) + 1 + hold)
  local got = px(tat, now, hold)
  if got ~= want then
    out[#out + 1] = string.format('now %d tat %d: px %s, math.ceil gives %s', now, tat, got, want)
  end
end
return out
`

func TestPxMatchesCeil(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	rdb := srv.Client(t)
	ctx := context.Background()

	offsets := []string{}
	add := func(d int64) { offsets = append(offsets, strconv.FormatInt(d, 10)) }
	for _, k := range []int64{0, 1, 2, 3, 1000, 123456789, 9_007_199_254} {
		for _, e := range []int64{-2, -1, 0, 1, 2} {
			add(k*1000 + e)
			add(-k*1000 + e)
		}
	}
	r := rand.New(rand.NewPCG(16, 1))
	for range 2000 {
		d := r.Int64N(1 << 53)
		if r.IntN(2) == 0 {
			d = r.Int64N(1 << 36) // within the horizon, where the scripts live
		}
		if r.IntN(4) == 0 {
			d = -d
		}
		add(d)
	}
	// Explicit clocks (hold is an hour) and Redis's own ("": hold is 0).
	for _, now := range []string{"", "0", "1", "999", "1764720000123456", "4503599627370496"} {
		args := []any{now}
		for _, o := range offsets {
			args = append(args, o)
		}
		bad, err := rdb.Eval(ctx, clockSrc+pxPlain, nil, args...).StringSlice()
		require.NoError(t, err)
		require.Empty(t, bad, "now %q", now)
	}
}

// storedPlain checks each value against stored as first written:
// string.match and tonumber, the same accept and reject set.
const storedPlain = `
local out = {}
local key = KEYS[1]
for i = 2, #ARGV do
  local v = ARGV[i]
  local want
  if #v <= 16 and string.match(v, '^%d+$') then want = tonumber(v) end
  if want == nil or want > 9007199254740992 then want = 'corrupt' else want = string.format('%d', want) end
  redis.call('SET', key, v)
  local ok, got = pcall(stored, key, now)
  if ok then
    got = string.format('%d', got)
  else
    if type(got) == 'table' then got = got.err end
    if type(got) == 'string' and string.find(got, '^SLOTBOOK_CORRUPT key ') then
      got = 'corrupt'
    else
      got = 'error ' .. tostring(got)
    end
  end
  if got ~= want then
    out[#out + 1] = string.format('%q: stored %s, want %s', v, got, want)
  end
end
-- The horizon: 366 days, plus 2*(tau + I) for the key's limit.
for off = -1, 1 do
  local v = string.format('%d', now + 31622400000000 + 2 * (5000 + 1000) + off)
  redis.call('SET', key, v)
  local ok, got = pcall(stored, key, now, 1000, 5000)
  if ok ~= (off <= 0) or (ok and string.format('%d', got) ~= v) then
    out[#out + 1] = string.format('%s ahead of the horizon by %d: ok %s', v, off, tostring(ok))
  end
end
redis.call('DEL', key)
return out
`

func TestStoredAcceptsWhatItDid(t *testing.T) {
	srv := redistest.Shared(t)
	srv.RequireReal(t)
	rdb := srv.Client(t)
	ctx := context.Background()

	values := []any{"", "0", "00", "007", "1", " 1", "1 ", "+1", "-1", "-0", "1.0", "1.", ".5", "1e3", "1E3",
		"0x10", "0X1F", "inf", "nan", "1\x00", "１", "12a", "a12",
		"1764720000123456", "0001764720000123", "9007199254740991", "9007199254740992", "9007199254740993",
		"9007199254740994", "9999999999999999", "10000000000000000", "99999999999999999",
		"1.76472000012e15", "0x038D7EA4C68000"}
	r := rand.New(rand.NewPCG(16, 2))
	for range 500 {
		values = append(values, strconv.FormatUint(r.Uint64N(1<<54), 10))
	}
	args := append([]any{""}, values...)
	bad, err := rdb.Eval(ctx, clockSrc+storedPlain, []string{redistest.Prefix(t) + "v"}, args...).StringSlice()
	require.NoError(t, err)
	require.Empty(t, bad)
}
