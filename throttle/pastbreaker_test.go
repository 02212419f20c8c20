package throttle_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// TestRunScriptPastBreaker: with the breaker open and its next probe a
// long way off (the server stopped, then back), RunScript is refused at
// once, unsent (ErrUnavailable, not ErrReplyLost, and the script does not
// run), while RunScriptPastBreaker runs the script; its answer closes the
// breaker, so RunScript goes through again.
func TestRunScriptPastBreaker(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	eng, err := throttle.New(rdb, throttle.WithPrefix(redistest.Prefix(t)), throttle.WithTimeout(time.Second),
		throttle.WithProbeBackoff(time.Minute, time.Minute)) // no probe due during the test
	require.NoError(t, err)
	ctx := context.Background()
	incr := throttle.NewScript(`return redis.call('INCR', KEYS[1])`)
	redistest.UntilOK(t, func() error { _, err := eng.RunScript(ctx, incr, []string{"n"}); return err })
	srv.Stop()
	_, err = eng.RunScript(ctx, incr, []string{"n"})
	require.ErrorIs(t, err, throttle.ErrUnavailable)
	srv.Restart(t)
	open, _ := eng.Unavailable()
	require.True(t, open, "the breaker once a call found the server gone")

	_, err = eng.RunScript(ctx, incr, []string{"n"})
	require.ErrorIs(t, err, throttle.ErrUnavailable, "RunScript while the breaker is open")
	require.NotErrorIs(t, err, throttle.ErrReplyLost)
	require.Equal(t, "", rdb.Get(ctx, eng.Prefix()+"n").Val(), "the refused call ran (the restarted server has no key)")

	got, err := eng.RunScriptPastBreaker(ctx, incr, []string{"n"})
	require.NoError(t, err, "RunScriptPastBreaker while the breaker is open")
	require.Equal(t, int64(1), got)
	open, _ = eng.Unavailable()
	require.False(t, open, "Redis's answer closed the breaker")
	got, err = eng.RunScript(ctx, incr, []string{"n"})
	require.NoError(t, err)
	require.Equal(t, int64(2), got)
}
