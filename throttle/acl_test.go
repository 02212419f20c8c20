package throttle_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/callcount"
	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// aclCommands is what slotbook needs from Redis: its scripts and what they
// call, SCRIPT LOAD for Engine.Load, and go-redis's handshake (HELLO; the
// CLIENT SETINFO it sends too may be refused: go-redis ignores that).
const aclCommands = "+evalsha +eval +script|load +time +get +set +del +zadd +zremrangebyscore +pexpire +zcard +zrange +hello +ping"

// TestACL runs the engine as a Redis user limited to its key prefix and the
// commands it needs; a user without access to the keys gets a clear error,
// at once, and the breaker stays closed.
func TestACL(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	user := func(name, keys string) *redis.Client {
		require.NoError(t, admin.Do(ctx, append([]any{"ACL", "SETUSER", name, "on", ">secret", "resetkeys", keys, "resetchannels", "-@all"},
			splitAny(aclCommands)...)...).Err())
		o := srv.Options()
		o.Username, o.Password = name, "secret"
		c := redis.NewClient(o)
		t.Cleanup(func() { c.Close() })
		return c
	}

	// A generous timeout: on a busy machine a call may miss the default
	// 50ms, and this test is about permissions.
	eng, err := throttle.New(user("slotbook", "~slotbook:*"), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	require.NoError(t, eng.Load(ctx))
	lim := throttle.PerSecond(10, 1)
	b, err := eng.Book(ctx, "api:{k}", lim, throttle.Request{N: 1, MaxWait: time.Second})
	require.NoError(t, err)
	require.True(t, b.OK)
	_, err = eng.Allow(ctx, "api:{k}", lim)
	require.NoError(t, err)
	b, err = eng.Book(ctx, "api:{k}", lim, throttle.Request{N: 1, MaxWait: time.Second})
	require.NoError(t, err)
	_, err = eng.Refund(ctx, "api:{k}", lim, b)
	require.NoError(t, err)
	require.NoError(t, eng.Block(ctx, "api:{k}", lim, time.Second))
	_, err = eng.Heartbeat(ctx, "api", "p", time.Second)
	require.NoError(t, err)
	_, err = eng.AllowWindow(ctx, "w", throttle.Window{Max: 3, Span: time.Second}, 1)
	require.NoError(t, err)

	outsiderClient := user("outsider", "~other:*")
	calls := callcount.Attach(outsiderClient)
	outsider, err := throttle.New(outsiderClient, throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	_, err = outsider.Allow(ctx, "api:{k}", lim)
	require.Error(t, err)
	require.Contains(t, err.Error(), "NOPERM")
	// At once: Redis's own answer (not a timeout, which would match
	// ErrUnavailable), after at most EVALSHA and EVAL: no retrying.
	require.False(t, errors.Is(err, throttle.ErrUnavailable), "a refused permission is not an outage")
	require.LessOrEqual(t, calls.Load(), int64(2), "round trips for a refused permission")
	open, _ := outsider.Unavailable()
	require.False(t, open)
}

// TestKeysStayUnderThePrefix: whatever a subject holds, its key starts
// with the engine's prefix.
func TestKeysStayUnderThePrefix(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix("app:"), throttle.WithTimeout(5*time.Second))
	require.NoError(t, err)
	ctx := context.Background()
	subjects := []string{"../x", "*", "{x}}", "{x}{", ":", "\x00", "a\r\nSET x 1", " ", "app:", "ü"}
	for _, s := range subjects {
		_, err := eng.Allow(ctx, s, throttle.PerSecond(1, 0))
		require.NoError(t, err, strconv.Quote(s))
	}
	// Braces without a hash tag are refused before any call (a Cluster
	// could not place a refund's tombstone beside such a key).
	for _, s := range []string{"}{", "{", "a{}b"} {
		_, err := eng.Allow(ctx, s, throttle.PerSecond(1, 0))
		require.ErrorIs(t, err, throttle.ErrInvalidRequest, strconv.Quote(s))
	}
	keys, err := rdb.Keys(ctx, "*").Result()
	require.NoError(t, err)
	require.Len(t, keys, len(subjects))
	for _, k := range keys {
		require.Equal(t, "app:", k[:4], "key %q", k)
	}
}

func splitAny(s string) []any {
	var out []any
	for _, f := range strings.Fields(s) {
		out = append(out, f)
	}
	return out
}
