package throttle_test

// Review of 3e30840 (helper-140): RunScriptPastBreaker's one place past
// the open breaker (breaker.past): whether a panicking Observer leaks
// it, and how it meets the breaker's probe.

import (
	"context"
	"errors"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/internal/redistest"
	"github.com/slotbook/slotbook/throttle"
)

// pb2Panicky panics in ObserveCall while armed is set (once: it clears
// armed), and counts the calls it is told of.
type pb2Panicky struct {
	armed atomic.Bool
	calls atomic.Int32
}

func (o *pb2Panicky) ObserveDecision(string, throttle.Outcome, time.Duration) {}
func (o *pb2Panicky) ObserveRefund(string, time.Duration)                     {}
func (o *pb2Panicky) ObserveBreaker(bool)                                     {}
func (o *pb2Panicky) ObserveCall(string, time.Duration, error) {
	o.calls.Add(1)
	if o.armed.CompareAndSwap(true, false) {
		panic("pb2: observer")
	}
}

// TestReviewPastBreaker2PanickingObserver: Redis stopped (refused dials),
// the breaker open with a probe not due for 10 s (WithProbeBackoff). A
// call past the breaker whose ObserveCall panics (recovered by the
// test), then, one after another, five more. RunScriptPastBreaker's doc:
// "the node's open breaker lets it by, one such call at a time". Checks:
// each of the five is let by (its error is not ErrBreakerOpen), as in
// the control (the first call's Observer not panicking).
func TestReviewPastBreaker2PanickingObserver(t *testing.T) {
	incr := throttle.NewScript(`return redis.call('INCR', KEYS[1])`)
	for _, panics := range []bool{false, true} {
		srv := redistest.Start(t)
		obs := &pb2Panicky{}
		eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)), throttle.WithObserver(obs),
			throttle.WithProbeBackoff(10*time.Second, 10*time.Second))
		require.NoError(t, err)
		ctx := context.Background()
		redistest.UntilOK(t, func() error { _, err := eng.RunScript(ctx, incr, []string{"pb2"}); return err })
		srv.Stop()
		_, err = eng.RunScript(ctx, incr, []string{"pb2"})
		require.Error(t, err)
		open, _ := eng.Unavailable()
		require.True(t, open, "breaker open after a refused call")
		obs.armed.Store(panics)
		func() {
			defer func() { _ = recover() }()
			_, _ = eng.RunScriptPastBreaker(ctx, incr, []string{"pb2"})
		}()
		refused := 0
		for range 5 {
			_, err := eng.RunScriptPastBreaker(ctx, incr, []string{"pb2"})
			require.Error(t, err)
			if errors.Is(err, throttle.ErrBreakerOpen) {
				refused++
			}
		}
		t.Logf("first call's observer panics %v: %d of the 5 calls past the breaker after it refused", panics, refused)
		assert.Zero(t, refused, "observer panics %v: calls past the breaker refused with none out", panics)
		srv.Restart(t)
	}
}

// TestReviewPastBreaker2ProbeAndPast: Redis paused (SIGSTOP: calls time
// out after sending), engine timeout 50 ms, the breaker open. A first
// call past the breaker, X, goes out; 20 ms later, with X still out, a
// second, Y. RunScriptPastBreaker's doc: "the node's open breaker lets it
// by, one such call at a time (another that comes while one is out is
// refused, as RunScript's would be). It is not the breaker's probe,
// unless it comes when one is due". Checks: Y is refused
// (ErrBreakerOpen) whether X came when the probe was not due (control)
// or when it was (X is then the probe, out for up to four timeouts).
func TestReviewPastBreaker2ProbeAndPast(t *testing.T) {
	incr := throttle.NewScript(`return redis.call('INCR', KEYS[1])`)
	for _, due := range []bool{false, true} {
		srv := redistest.Start(t)
		eng, err := throttle.New(srv.Client(t), throttle.WithPrefix(redistest.Prefix(t)),
			throttle.WithTimeout(50*time.Millisecond), throttle.WithProbeBackoff(300*time.Millisecond, time.Second))
		require.NoError(t, err)
		ctx := context.Background()
		redistest.UntilOK(t, func() error { _, err := eng.RunScript(ctx, incr, []string{"pb2p"}); return err })
		pid := srv.Pid()
		require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
		_, err = eng.RunScript(ctx, incr, []string{"pb2p"})
		require.ErrorIs(t, err, throttle.ErrReplyLost)
		open, probeIn := eng.Unavailable()
		require.True(t, open)
		if due {
			time.Sleep(probeIn + 10*time.Millisecond)
		}
		xDone := make(chan error, 1)
		xStart := time.Now()
		go func() { _, err := eng.RunScriptPastBreaker(ctx, incr, []string{"pb2p"}); xDone <- err }()
		time.Sleep(20 * time.Millisecond)
		_, yErr := eng.RunScriptPastBreaker(ctx, incr, []string{"pb2p"})
		xErr := <-xDone
		xTook := time.Since(xStart)
		t.Logf("probe due %v: X took %v, error %v; Y's error %v", due, xTook, xErr, yErr)
		require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		assert.ErrorIs(t, yErr, throttle.ErrBreakerOpen, "probe due %v: a second call past the breaker while the first was out was let by", due)
	}
}
