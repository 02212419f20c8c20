package reserve_test

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/contention"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// highLimit never makes anyone wait in these benchmarks.
var highLimit = throttle.PerSecond(1_000_000, 1_000_000)

// BenchmarkReserve64 reserves from 64 goroutines on one key, with
// coalescing on and off: ns/op is per reservation, calls/op the Redis calls
// per reservation.
func BenchmarkReserve64(b *testing.B) {
	for _, coalesce := range []bool{true, false} {
		name := "coalesced"
		if !coalesce {
			name = "uncoalesced"
		}
		b.Run(name, func(b *testing.B) {
			e := newEnv(b)
			l, err := reserve.New(e.eng, "bench", highLimit, reserve.WithCoalescing(coalesce))
			require.NoError(b, err)
			require.NoError(b, e.eng.Load(context.Background()))
			before := e.calls.Load()
			b.ReportAllocs()
			b.SetParallelism(32) // 64 goroutines on 2 cores
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				ctx := context.Background()
				for pb.Next() {
					if _, err := l.Reserve(ctx, "k"); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(e.calls.Load()-before)/float64(b.N), "calls/op")
		})
	}
}

// BenchmarkCoalescingSpeedup measures both ways in one run, 64 goroutines
// and 20,000 reservations each way, and reports the ratio of reservations
// per second (target: at least 3) and coalesced calls per reservation
// (target: at most 0.3). The uncoalesced callers make one call each: their
// engine does not merge (throttle.WithMerging(false)), as slotbench's
// target baseline does not.
func BenchmarkCoalescingSpeedup(b *testing.B) {
	e := newEnv(b)
	require.NoError(b, e.eng.Load(context.Background()))
	alone, err := throttle.New(e.rdb, throttle.WithPrefix(e.prefix), throttle.WithTimeout(5*time.Second), throttle.WithMerging(false))
	require.NoError(b, err)
	rate := func(coalesce bool) (perSec, callsPer float64) {
		eng := e.eng
		if !coalesce {
			eng = alone
		}
		l, err := reserve.New(eng, "speedup", highLimit, reserve.WithCoalescing(coalesce))
		require.NoError(b, err)
		perSec, callsPer, err = contention.Throughput(context.Background(), l, "k", 64, 20_000, e.calls.Load)
		require.NoError(b, err)
		return perSec, callsPer
	}
	for i := 0; i < b.N; i++ {
		on, callsOn := rate(true)
		off, _ := rate(false)
		b.ReportMetric(on/off, "speedup")
		b.ReportMetric(callsOn, "calls/reservation")
		b.ReportMetric(on, "coalesced-res/s")
		b.ReportMetric(off, "uncoalesced-res/s")
	}
}

// BenchmarkReserveScaling reserves under a limit never reached from 1, 4
// and 64 goroutines (more than one through SetParallelism, so on a
// GOMAXPROCS that divides them), on one hot key and on
// 10,000 keys, coalesced and not: ns/op and allocs/op are per reservation,
// calls/op the Redis calls per reservation. It is the benchmark to profile
// the client path with:
//
//	go test -run '^$' -bench 'ReserveScaling/keys=1/g=64/coalesced' -cpuprofile cpu.out ./reserve
func BenchmarkReserveScaling(b *testing.B) {
	for _, keys := range []int{1, 10_000} {
		names := make([]string, keys)
		for i := range names {
			names[i] = fmt.Sprintf("k%d", i)
		}
		for _, g := range []int{1, 4, 64} {
			for _, coalesce := range []bool{true, false} {
				mode := "coalesced"
				if !coalesce {
					mode = "uncoalesced"
				}
				b.Run(fmt.Sprintf("keys=%d/g=%d/%s", keys, g, mode), func(b *testing.B) {
					e := newEnv(b)
					l, err := reserve.New(e.eng, "bench", highLimit, reserve.WithCoalescing(coalesce))
					require.NoError(b, err)
					require.NoError(b, e.eng.Load(context.Background()))
					procs := runtime.GOMAXPROCS(0)
					var next atomic.Int64
					before := e.calls.Load()
					b.ReportAllocs()
					b.ResetTimer()
					if g == 1 {
						ctx := context.Background()
						for i := 0; i < b.N; i++ {
							if _, err := l.Reserve(ctx, names[i%keys]); err != nil {
								b.Fatal(err)
							}
						}
						b.ReportMetric(float64(e.calls.Load()-before)/float64(b.N), "calls/op")
						return
					}
					b.SetParallelism(max(1, g/procs))
					b.RunParallel(func(pb *testing.PB) {
						ctx := context.Background()
						i := int(next.Add(7919))
						for pb.Next() {
							i++
							if _, err := l.Reserve(ctx, names[i%keys]); err != nil {
								b.Error(err)
								return
							}
						}
					})
					b.ReportMetric(float64(e.calls.Load()-before)/float64(b.N), "calls/op")
				})
			}
		}
	}
}

// instantRedis answers the engine's booking scripts at once, booking every
// request with no wait, so that BenchmarkClientPath measures the client's
// own cost per reservation (the reserve and throttle layers, without
// go-redis or a network): what it costs beside the round trip every
// limiter pays.
type instantRedis struct{}

func (instantRedis) reply(ctx context.Context, args []any) *redis.Cmd {
	cmd := redis.NewCmd(ctx)
	if len(args) == 4 { // book1.lua: "s u", the key idle, so the request booked at once
		now := time.Now().UnixMicro()
		cmd.SetVal(strconv.FormatInt(now/1_000_000, 10) + " " + strconv.FormatInt(now%1_000_000, 10))
		return cmd
	}
	// book.lua: now, m, m limits, then runs (count, n, max wait)
	m, reqs := args[1].(int), 0
	for i := 2 + 2*m; i+2 < len(args); i += 3 {
		reqs += toInt(args[i])
	}
	// {now, tat_1..tat_m, then a wait per request}: every key is free
	// (tat = now) and every request booked at once (wait 0).
	now := time.Now().UnixMicro()
	vals := make([]any, 1+m+reqs)
	for i := range vals {
		vals[i] = int64(0)
	}
	for i := 0; i <= m; i++ {
		vals[i] = now
	}
	cmd.SetVal(vals)
	return cmd
}

// toInt reads a run's count, as the engine passes it.
func toInt(v any) int {
	switch v := v.(type) {
	case int:
		return v
	case int64:
		return int(v)
	case string:
		n, _ := strconv.Atoi(v)
		return n
	}
	panic(fmt.Sprintf("instantRedis: argument %T", v))
}

func (r instantRedis) Eval(ctx context.Context, _ string, _ []string, args ...any) *redis.Cmd {
	return r.reply(ctx, args)
}

func (r instantRedis) EvalSha(ctx context.Context, _ string, _ []string, args ...any) *redis.Cmd {
	return r.reply(ctx, args)
}

func (r instantRedis) EvalRO(ctx context.Context, _ string, _ []string, args ...any) *redis.Cmd {
	return r.reply(ctx, args)
}

func (r instantRedis) EvalShaRO(ctx context.Context, _ string, _ []string, args ...any) *redis.Cmd {
	return r.reply(ctx, args)
}

func (instantRedis) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	cmd := redis.NewBoolSliceCmd(ctx)
	cmd.SetVal(make([]bool, len(hashes)))
	return cmd
}

func (instantRedis) ScriptLoad(ctx context.Context, _ string) *redis.StringCmd {
	return redis.NewStringCmd(ctx)
}

// BenchmarkClientPath is the client's own cost per reservation, one
// goroutine, against a Redis stand-in that answers at once: ns/op and
// allocs/op of the reserve and throttle layers alone.
func BenchmarkClientPath(b *testing.B) {
	benchClientPath(b, func(*testing.B) redis.Scripter { return instantRedis{} })
}

// benchClientPath runs the client-path sub-benchmarks (coalescing on and
// off, the caller's context with and without a deadline) on an engine over
// the client rdb makes, with the engine's timeout 5s.
func benchClientPath(b *testing.B, rdb func(*testing.B) redis.Scripter) {
	for _, coalesce := range []bool{true, false} {
		for _, dl := range []bool{false, true} {
			name := fmt.Sprintf("coalesce=%v/deadline=%v", coalesce, dl)
			b.Run(name, func(b *testing.B) {
				eng, err := throttle.New(rdb(b), throttle.WithTimeout(5*time.Second))
				require.NoError(b, err)
				l, err := reserve.New(eng, "bench", highLimit, reserve.WithCoalescing(coalesce))
				require.NoError(b, err)
				ctx := context.Background()
				if dl {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, time.Hour)
					defer cancel()
				}
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					r, err := l.Reserve(ctx, "k")
					if err != nil || !r.OK() {
						b.Fatal(err, r.Err())
					}
				}
			})
		}
	}
}

// instantHook answers the engine's script calls on a real go-redis
// Client as instantRedis does, without a network: the command never
// leaves the process, so BenchmarkClientPathGoRedis measures the reserve
// and throttle layers plus go-redis's own command handling, with the
// engine's choices that depend on the client's type (its options).
type instantHook struct{}

func (instantHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (instantHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (instantHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		a := cmd.Args()
		if name := cmd.Name(); name != "evalsha" && name != "eval" {
			return next(ctx, cmd)
		}
		keys := a[2].(int)
		cmd.(interface{ SetVal(any) }).SetVal(instantRedis{}.reply(ctx, a[3+keys:]).Val())
		return nil
	}
}

// BenchmarkClientPathGoRedis is BenchmarkClientPath through a go-redis
// Client (default options) whose commands are answered in process by
// instantHook.
func BenchmarkClientPathGoRedis(b *testing.B) {
	benchClientPath(b, func(b *testing.B) redis.Scripter {
		rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true})
		b.Cleanup(func() { _ = rdb.Close() })
		rdb.AddHook(instantHook{})
		return rdb
	})
}
