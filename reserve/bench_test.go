package reserve_test

import (
	"context"
	"testing"

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
// (target: at most 0.3).
func BenchmarkCoalescingSpeedup(b *testing.B) {
	e := newEnv(b)
	require.NoError(b, e.eng.Load(context.Background()))
	rate := func(coalesce bool) (perSec, callsPer float64) {
		l, err := reserve.New(e.eng, "speedup", highLimit, reserve.WithCoalescing(coalesce))
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
