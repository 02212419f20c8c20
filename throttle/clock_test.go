package throttle_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/throttle"
)

// TestExplicitClockOutlivesRedisExpiry: under the tests' explicit clock,
// which stands still while Redis's moves, a key must not expire in real
// time before the explicit clock has passed its TAT. (CI once failed
// TestDifferentialRandom this way: a pause longer than a key's TTL
// between two operations at one explicit time made the engine see no key
// where the model saw a TAT 12.5ms ahead.)
func TestExplicitClockOutlivesRedisExpiry(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	lim := throttle.PerSecond(50, 0) // I = 20ms
	b0 := base()
	first, err := e.eng.Book(at(b0, 0), "k", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.True(t, first.OK)
	time.Sleep(60 * time.Millisecond) // three TTLs of real time; no explicit time
	second, err := e.eng.Book(at(b0, 0), "k", lim, throttle.Request{N: 1, MaxWait: throttle.Forever})
	require.NoError(t, err)
	require.True(t, second.OK)
	require.Equal(t, 20*time.Millisecond, second.Wait, "the first booking's TAT must still hold")
}
