package throttle

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// A Script is a Lua script of another package (package lease has some)
// that runs through an Engine with RunScript, as the engine's own scripts
// do. Build one with NewScript; it is safe for concurrent use.
type Script struct{ s *script }

// NewScript returns a Script of the Lua source src.
func NewScript(src string) *Script { return &Script{s: newScript(src)} }

// RunScript runs s on keys (before the engine's prefix, which RunScript
// puts before each) with args, as the engine runs its own scripts: through
// the breaker, within the engine's timeout, never retried by go-redis once
// it may have reached Redis, reported to the observer under the label of
// keys[0], and with its error classified as the package doc describes
// (ErrUnavailable, ErrReplyLost). The keys must share a hash tag if there
// are several; keys[0] must pass CheckKey.
func (e *Engine) RunScript(ctx context.Context, s *Script, keys []string, args ...any) (any, error) {
	if len(keys) == 0 {
		return nil, ErrInvalidRequest
	}
	if err := CheckKey(keys[0]); err != nil {
		return nil, err
	}
	return e.runReply(ctx, s.s, keys, args)
}

// RunScriptPastBreaker is RunScript for a call its caller must get to
// Redis, and bounds itself (package lease's leave calls after Close, each
// sent once side by side): the node's open breaker lets it by, one such
// call at a time (another that comes while one is out is refused, as
// RunScript's would be). It is not the breaker's probe, unless it comes
// when one is due; Redis's answer, or a failure, is told to the breaker
// as any call's (an answer closes it).
func (e *Engine) RunScriptPastBreaker(ctx context.Context, s *Script, keys []string, args ...any) (any, error) {
	return e.RunScript(context.WithValue(ctx, pastBreakerKey{}, true), s, keys, args...)
}

// pastBreakerKey marks the context of a call of RunScriptPastBreaker.
type pastBreakerKey struct{}

// pastBreaker reports whether ctx is a RunScriptPastBreaker call's: read
// only once the breaker has refused the call, off the hot path.
func pastBreaker(ctx context.Context) bool { return ctx.Value(pastBreakerKey{}) != nil }

// HoldConn is for a blocking command of another package on key (package
// lease's BLPOP wake-ups), sent on the engine's client: it takes one of
// the connection tokens of key's node, which the engine's calls take too,
// so that they queue for a connection, bounded by their callers' contexts,
// rather than time out on a pool the blocking commands have emptied (see
// the engine's gates). It does not wait: ok is false, and nothing is
// held, while blocking commands hold half the node's tokens, or every
// token is taken, or the node is unknown (a Cluster whose slot map cannot
// be read); the caller then does without the blocking command. On a Ring,
// whose calls are not gated, blocking commands are counted alone, at most
// half a shard's pool at once. For a client of another kind, nothing is
// held and ok is true. Call release after the command; calls after the
// first do nothing.
func (e *Engine) HoldConn(ctx context.Context, key string) (release func(), ok bool) {
	return e.holdConn(ctx, key, false)
}

// HoldConnWait is HoldConn that, when every connection token of key's node
// is taken, waits for one until ctx ends, queued with the engine's own
// calls (ok is false then, and nothing is held). It still fails at once
// while blocking commands hold half the node's tokens, or for a node it
// cannot name.
func (e *Engine) HoldConnWait(ctx context.Context, key string) (release func(), ok bool) {
	return e.holdConn(ctx, key, true)
}

func (e *Engine) holdConn(ctx context.Context, key string, wait bool) (release func(), ok bool) {
	if e.gates == nil {
		if e.ring == nil {
			return func() {}, true
		}
		if e.ringHolds.Add(1) > e.ringHoldCap {
			e.ringHolds.Add(-1)
			return nil, false
		}
		return once(func() { e.ringHolds.Add(-1) }), true
	}
	ref, _, err := e.nodeFor(ctx, e.prefix+key, time.Now())
	if err != nil || ref == e.unread {
		return nil, false
	}
	if int(ref.blocking.Add(1)) > cap(ref.gate)/2 {
		ref.blocking.Add(-1)
		return nil, false
	}
	got := false
	if wait {
		select {
		case ref.gate <- struct{}{}:
			got = true
		case <-ctx.Done():
		}
	} else {
		select {
		case ref.gate <- struct{}{}:
			got = true
		default:
		}
	}
	if !got {
		ref.blocking.Add(-1)
		return nil, false
	}
	return once(func() {
		<-ref.gate
		ref.blocking.Add(-1)
	}), true
}

// once returns a func that runs f on its first call only.
func once(f func()) func() {
	var done atomic.Bool
	return func() {
		if done.CompareAndSwap(false, true) {
			f()
		}
	}
}

// LoadScript sends s to Redis, so that its first run does not pay for a
// NOSCRIPT round trip (on a Cluster, to the node the client picks). It is
// optional.
func (e *Engine) LoadScript(ctx context.Context, s *Script) error {
	ctx, cancel := e.callContext(ctx)
	defer cancel()
	return s.s.Load(ctx, e.rdb).Err()
}

// Client returns the Redis client the engine was built with, for packages
// that need commands besides scripts (package lease blocks on a list with
// BLPOP, which must not count against the engine's timeout).
func (e *Engine) Client() redis.Scripter { return e.rdb }

// Prefix returns the prefix the engine puts before every key.
func (e *Engine) Prefix() string { return e.prefix }

// Timeout returns the bound the engine puts on each Redis call (0: none).
func (e *Engine) Timeout() time.Duration { return e.timeout }
