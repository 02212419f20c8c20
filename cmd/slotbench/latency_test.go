package main

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
)

// TestServerCPUIgnoresOneSlowRound: one phase that the server spends far
// longer on (on a busy machine: the server thread preempted) must not set a
// probe's server CPU per call. Two probes run the same cheap script; one of
// them, once, also runs a script that spins for 30ms on the server. Its
// figure must stay near the other's.
func TestServerCPUIgnoresOneSlowRound(t *testing.T) {
	srv := redistest.Start(t) // its own server: no other test's EVALSHA in commandstats
	srv.RequireReal(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	cheap := redis.NewScript(`return 1`)
	spin := redis.NewScript(`
local t = redis.call('TIME')
local t0 = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - t0 >= 30000
return 1`)
	require.NoError(t, spin.Load(ctx, rdb).Err())
	spun, n := false, 0
	probes := []probe{
		{name: "plain", command: "evalsha", call: func(ctx context.Context) error { return cheap.Run(ctx, rdb, nil).Err() }},
		{name: "one slow call", command: "evalsha", call: func(ctx context.Context) error {
			n++
			if n == 250 { // past the warm-up's 200 calls: in the first round
				spun = true
				return spin.Run(ctx, rdb, nil).Err()
			}
			return cheap.Run(ctx, rdb, nil).Err()
		}},
	}
	rows, err := measureLatency(ctx, rdb, probes, 2000, latencyRounds(2000))
	require.NoError(t, err)
	require.True(t, spun)
	require.Less(t, rows[1].UsecPerCall, 2*rows[0].UsecPerCall,
		"server µs per call: %.2f with one slow call, %.2f without", rows[1].UsecPerCall, rows[0].UsecPerCall)
}
