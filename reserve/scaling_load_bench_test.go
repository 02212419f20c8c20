package reserve_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/reserve"
	"github.com/slotbook/slotbook/throttle"
)

// BenchmarkScalingLoad makes, against a real redis-server, the requests of
// slotbench -scaling's load (cmd/slotbench/scaling.go, prepareLoad) from 4
// goroutines, on 10,000 keys and on 1: "slotbook reserve" coalesced and
// uncoalesced (Reserve on a Limiter of an engine with a 5s timeout, over a
// go-redis Client with ContextTimeoutEnabled), and go-redis/redis_rate's
// Allow on the same client, under a limit never reached. ns/op and
// allocs/op are per request, calls/op the Redis calls per request. It is
// the benchmark to profile the client path with, beside redis_rate's:
//
//	go test -run '^$' -bench 'ScalingLoad/keys=10000/coalesced' -cpuprofile cpu.out ./reserve
func BenchmarkScalingLoad(b *testing.B) {
	open := throttle.PerSecond(1_000_000, 1_000_000)
	for _, keys := range []int{10_000, 1} {
		names := make([]string, keys)
		for i := range names {
			names[i] = fmt.Sprintf("k%07d", i)
		}
		for _, strat := range []string{"coalesced", "uncoalesced", "redis_rate"} {
			b.Run(fmt.Sprintf("keys=%d/%s", keys, strat), func(b *testing.B) {
				srv := redistest.Shared(b)
				srv.RequireReal(b)
				rdb := redis.NewClient(&redis.Options{Addr: srv.Addr, ContextTimeoutEnabled: true})
				b.Cleanup(func() { _ = rdb.Close() })
				var calls atomic.Int64
				rdb.AddHook(countHook{&calls})
				prefix := "rate:" + redistest.Prefix(b)
				var op func(ctx context.Context, key string) error
				if strat == "redis_rate" {
					rr := redis_rate.NewLimiter(rdb)
					lim := redis_rate.Limit{Rate: open.Rate, Burst: open.Burst, Period: open.Period}
					op = func(ctx context.Context, key string) error {
						r, err := rr.Allow(ctx, prefix+key, lim)
						if err == nil && r.Allowed == 0 {
							err = fmt.Errorf("refused")
						}
						return err
					}
				} else {
					eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
					require.NoError(b, err)
					require.NoError(b, eng.Load(context.Background()))
					l, err := reserve.New(eng, "scale", open, reserve.WithCoalescing(strat == "coalesced"))
					require.NoError(b, err)
					op = func(ctx context.Context, key string) error {
						r, err := l.Reserve(ctx, key)
						if err == nil && !r.OK() {
							err = r.Err()
						}
						return err
					}
				}
				var next atomic.Int64
				cpu0, srv0 := clientCPU(), serverCPU(srv.Pid())
				b.SetParallelism(max(1, 4/runtime.GOMAXPROCS(0)))
				b.ReportAllocs()
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					ctx := context.Background()
					i := int(next.Add(7919))
					for pb.Next() {
						i++
						if err := op(ctx, names[i%keys]); err != nil {
							b.Error(err)
							return
						}
					}
				})
				b.StopTimer()
				b.ReportMetric(float64(calls.Load())/float64(b.N), "calls/op")
				b.ReportMetric(float64(clientCPU()-cpu0)/float64(b.N), "client-cpu-ns/op")
				if s := serverCPU(srv.Pid()); s >= 0 && srv0 >= 0 {
					b.ReportMetric(float64(s-srv0)/float64(b.N), "server-cpu-ns/op")
				}
			})
		}
	}
}

// clientCPU is the process's user and system CPU so far.
func clientCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// serverCPU is the user and system CPU of the process pid so far, read
// from /proc (-1 where it cannot be read).
func serverCPU(pid int) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil || pid <= 0 {
		return -1
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return -1
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * (time.Second / 100) // USER_HZ
}

// countHook counts the commands a client processes.
type countHook struct{ n *atomic.Int64 }

func (countHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h countHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.n.Add(1)
		return next(ctx, cmd)
	}
}
func (h countHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		h.n.Add(int64(len(cmds)))
		return next(ctx, cmds)
	}
}
