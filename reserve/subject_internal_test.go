package reserve

import (
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestCheckSubjectMatchesEngineKeyRules: checkSubject, which judges a
// subject without building its engine key, accepts exactly the subjects
// whose key "name:{key}" the engine accepts (throttle.CheckKey) with room
// for a period suffix, and returns the same errors.
func TestCheckSubjectMatchesEngineKeyRules(t *testing.T) {
	// No Redis call is made: a client for an address never dialled.
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true})
	defer rdb.Close()
	eng, err := throttle.New(rdb)
	require.NoError(t, err)
	built := func(l *Limiter, key string) error { // the rule as the key is built
		if key == "" {
			return l.checkSubject(key) // both name the empty key
		}
		k := l.name + ":{" + key + "}"
		if len(k)+24 > throttle.MaxKeyLen {
			return l.checkSubject(key) // both name its length
		}
		return throttle.CheckKey(k)
	}
	for _, name := range []string{"a", "api", strings.Repeat("n", 100)} {
		l, err := New(eng, name, throttle.PerSecond(1, 1))
		require.NoError(t, err)
		max := throttle.MaxKeyLen - 24 - len(name) - 3
		keys := []string{"", "x", "}", "}x", "x}", "{", "{}", "}{", "a{b}c", "{x}", "}}", "x}y{z", "tenant-42",
			strings.Repeat("k", max), strings.Repeat("k", max+1), "}" + strings.Repeat("k", max-1), "}" + strings.Repeat("k", max)}
		for _, key := range keys {
			want := built(l, key)
			got := l.checkSubject(key)
			if want == nil {
				require.NoError(t, got, "name %q key %q", name, key)
				continue
			}
			require.Error(t, got, "name %q key %q", name, key)
			require.ErrorIs(t, got, throttle.ErrInvalidRequest)
			require.Equal(t, want.Error(), got.Error(), "name %q key %q", name, key)
		}
		require.Error(t, l.checkSubject(strings.Repeat("k", max+1)), "too long")
		require.NoError(t, l.checkSubject(strings.Repeat("k", max)), "just short enough")
		require.Error(t, l.checkSubject("}"), "no hash tag")
	}
}
