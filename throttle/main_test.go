package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/internal/testhook"
	"github.com/slotbook/slotbook/throttle"
)

func TestMain(m *testing.M) { redistest.Main(m) }

// env is one test's engine, with the client under it and its call counter.
type env struct {
	srv    *redistest.Server
	rdb    *redis.Client
	calls  *callcount.Counter
	eng    *throttle.Engine
	prefix string
}

func newEnv(t testing.TB) *env {
	t.Helper()
	srv := redistest.Shared(t)
	rdb := srv.Client(t)
	calls := callcount.Attach(rdb)
	prefix := redistest.Prefix(t)
	// A generous timeout: these tests check logic, not latency, on a
	// machine that may be busy.
	eng, err := throttle.New(rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	return &env{srv: srv, rdb: rdb, calls: calls, eng: eng, prefix: prefix}
}

// at returns a context under which the scripts see now = base + d.
func at(base int64, d time.Duration) context.Context {
	return testhook.WithNow(context.Background(), base+d.Microseconds())
}

// base is a fake clock origin near the real one, so key expiry stays sane.
func base() int64 { return time.Now().UnixMicro() }

// fresh returns e on a key prefix of its own.
func (e *env) fresh(t testing.TB) *env {
	prefix := redistest.Prefix(t)
	eng, err := throttle.New(e.rdb, throttle.WithPrefix(prefix), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	return &env{srv: e.srv, rdb: e.rdb, calls: e.calls, eng: eng, prefix: prefix}
}
