package main

import (
	"context"
	"fmt"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"

	"github.com/slotbook/slotbook/internal/refscripts"
	"github.com/slotbook/slotbook/throttle"
)

// A strategy is one way to keep a limit of perMinute per minute in Redis,
// measured side by side.
type strategy struct {
	name string
	// fill makes key hold the state of a limit filled to the brim.
	fill func(ctx context.Context, key string) error
	// check makes one check on key under a limit it never reaches.
	check func(ctx context.Context, key string) error
	// keyOf is the Redis key the strategy keeps for key.
	keyOf func(key string) string
	// command is the INFO commandstats entry its checks run as.
	command string
	// load, if set, loads every script the strategy may send (a slotbook
	// engine's fill may merge bookings into a script of its own, which one
	// warm-up call does not load).
	load func(ctx context.Context) error
	// on makes the same strategy on another client (a slotbook engine of
	// its own with newEngine's options): measureMemory fills through
	// connections it closes before its second reading.
	on func(c *redis.Client) (strategy, error)
}

// newEngine is the engine strategies are given: redis_rate's key prefix,
// so that every strategy keeps the same key names.
func newEngine(c *redis.Client) (*throttle.Engine, error) {
	return throttle.New(c, throttle.WithPrefix("rate:"), throttle.WithTimeout(5*time.Second))
}

const perMinute = 100

// floatGCRA is GCRA as the common guides write it: TAT kept as fractional
// milliseconds, handed back to Redis as a Lua number (so stored as a
// %.17g string, never int-encoded), with an expiry.
var floatGCRA = redis.NewScript(`
local period_ms = tonumber(ARGV[1])
local count = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local separation = period_ms / count
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local tat = math.max(now_ms, tonumber(redis.call('GET', KEYS[1]) or now_ms))
if tat + (n - 1) * separation - burst * separation > now_ms then
  return 0
end
local new_tat = tat + n * separation
redis.call('SET', KEYS[1], new_tat, 'PX', math.ceil(new_tat - now_ms) + 1)
return 1
`)

// Reference scripts for the cost table: what any script costs, and what
// the three commands every GCRA here needs (TIME, GET, SET with an expiry)
// cost, with the protocol's arguments and reply, and with the time worked
// out and stored as an integer (internal/refscripts, which package
// throttle's BenchmarkBook1ServerCost runs too).
var (
	emptyScript         = redis.NewScript(`return 1`)
	floorScript         = redis.NewScript(refscripts.Floor)
	protocolFloorScript = redis.NewScript(refscripts.Protocol)
	integerFloorScript  = redis.NewScript(refscripts.Integer)
)

// strategies are the ways to keep a limit measured side by side, on rdb;
// eng is an engine on rdb made as newEngine makes one.
func strategies(rdb *redis.Client, eng *throttle.Engine) []strategy {
	filled := throttle.PerMinute(perMinute, perMinute-1) // 100 pass at once
	open := throttle.PerSecond(1_000_000, 1_000_000)     // never reached
	rr := redis_rate.NewLimiter(rdb)
	rrFilled := redis_rate.Limit{Rate: perMinute, Burst: perMinute, Period: time.Minute}
	rrOpen := redis_rate.Limit{Rate: 1_000_000, Burst: 1_000_000, Period: time.Second}
	window := throttle.Window{Max: perMinute, Span: time.Minute}
	bigWindow := throttle.Window{Max: 1 << 30, Span: time.Millisecond}
	// Every strategy keeps its state under the same name: redis_rate's.
	rated := func(k string) string { return "rate:" + k }

	list := []strategy{
		{
			name:    "slotbook (GCRA, integer TAT)",
			fill:    func(ctx context.Context, k string) error { return mustAllow(eng.AllowN(ctx, k, filled, perMinute)) },
			check:   func(ctx context.Context, k string) error { return mustAllow(eng.AllowN(ctx, k, open, 1)) },
			keyOf:   rated,
			command: "evalsha",
			load:    eng.Load,
		},
		{
			name: "go-redis/redis_rate v10 (GCRA, float TAT)",
			fill: func(ctx context.Context, k string) error {
				r, err := rr.AllowN(ctx, k, rrFilled, perMinute)
				if err == nil && r.Allowed != perMinute {
					err = fmt.Errorf("redis_rate allowed %d of %d", r.Allowed, perMinute)
				}
				return err
			},
			check: func(ctx context.Context, k string) error {
				_, err := rr.Allow(ctx, k, rrOpen)
				return err
			},
			keyOf:   rated,
			command: "evalsha",
		},
		{
			name: "guide-style GCRA script (TAT as a float string)",
			fill: func(ctx context.Context, k string) error {
				return floatGCRA.Run(ctx, rdb, []string{rated(k)}, 60_000, perMinute, perMinute-1, perMinute).Err()
			},
			check: func(ctx context.Context, k string) error {
				return floatGCRA.Run(ctx, rdb, []string{rated(k)}, 1000, 1_000_000, 1_000_000, 1).Err()
			},
			keyOf:   rated,
			command: "evalsha",
		},
		{
			name: "sliding-window log (sorted set)",
			fill: func(ctx context.Context, k string) error {
				return mustAllow(eng.AllowWindow(ctx, k, window, perMinute))
			},
			check:   func(ctx context.Context, k string) error { return mustAllow(eng.AllowWindow(ctx, k, bigWindow, 1)) },
			keyOf:   rated,
			command: "evalsha",
			load:    eng.Load,
		},
		{
			name: "floor: one integer with an expiry",
			fill: func(ctx context.Context, k string) error {
				return rdb.Set(ctx, rated(k), time.Now().UnixMicro()+60_000_000, time.Minute).Err()
			},
			keyOf: rated,
		},
	}
	for i := range list {
		list[i].on = func(c *redis.Client) (strategy, error) {
			e, err := newEngine(c)
			if err != nil {
				return strategy{}, err
			}
			return strategies(c, e)[i], nil
		}
	}
	return list
}

func mustAllow(r throttle.Result, err error) error {
	if err == nil && !r.Allowed {
		err = fmt.Errorf("denied: %+v", r)
	}
	return err
}
